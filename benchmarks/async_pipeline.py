"""Asynchronous against synchronous GRPO on the CPU demo task with a slow reward: wall-clock per step and held-out
accuracy, seeds interleaved.

    python -m benchmarks.async_pipeline --threads 1                    # 3 seeds x (synchronous, thread worker)
    python -m benchmarks.async_pipeline --threads 1 --workers thread process   # and the worker in its own process
    python -m benchmarks.async_pipeline --steps 2 --seeds 0 --eval-samples 4 --prompts 2 --sft-steps 2   # checks the script

The demo's stage 2 (`hybridrl demo`: GRPO from the SFT model, 32 prompts x 8 samples, exact-match reward), with the
reward made to take `--reward-delay-s` per batch (a remote grader or a sandbox: the process waits, the CPU is
free). The SFT model and data are made once under `--out` (the demo's stage 1) and shared by every run. For each
seed the sides run one after the other: `trainer.max_staleness=0` (the synchronous loop) and `=1` with each
`--workers` (`trainer.rollout_worker`), their order rotating from seed to seed, so a machine shared with other work
slows them alike; all use truncated importance sampling (`algorithm.rollout_correction_cap=2.0`), the identity for
the synchronous run. Wall-clock per step is `train()`'s time over its steps (no evaluation inside); held-out
accuracy is greedy exact match on `--eval-samples` problems after the last step.

Prints a table last; writes JSON to $OUT/async_pipeline_benchmark.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from hybridrl.cli import DEMO_CONFIGS, DEMO_PERIOD_RATE
from hybridrl.config.loading import load_config
from hybridrl.data.tasks import write_arithmetic_task
from hybridrl.rewards import exact_match
from hybridrl.training.sft import run_sft
from hybridrl.training.trainer import RLTrainer

def slow_exact_match(delay_s: float):
    def exact_match_slow(prompts, completions, **columns):
        time.sleep(delay_s)
        return exact_match(prompts, completions, **columns)

    exact_match_slow.__name__ = "exact_match"
    return exact_match_slow


def prepare(out: Path, sft_steps: int, sft_model: str | None) -> tuple[dict[str, Path], Path]:
    """The demo's data and SFT model (made once; reused when present, or `sft_model` when given)."""
    data = write_arithmetic_task(out / "data", period_rate=DEMO_PERIOD_RATE)
    model = Path(sft_model) if sft_model else out / "sft" / "model"
    if not (model / "config.json").is_file():
        overrides = [f"data.train_path={data['train']}", f"trainer.output_dir={out / 'sft'}", "logging.sinks=[jsonl]"]
        if sft_steps:
            overrides.append(f"sft.max_steps={sft_steps}")
        model = run_sft(load_config(DEMO_CONFIGS / "arithmetic_sft.yaml", overrides))
    return data, model


SIDES = {"synchronous": (0, "thread"), "thread": (1, "thread"), "process": (1, "process")}
"""Side -> (trainer.max_staleness, trainer.rollout_worker)."""


def run(out: Path, data: dict[str, Path], model: Path, seed: int, side: str, args) -> dict[str, float]:
    staleness, worker = SIDES[side]
    overrides = [f"model.path={model}", f"data.train_path={data['train']}", f"data.eval_path={data['eval']}",
                 f"data.max_eval_samples={args.eval_samples}", f"trainer.total_steps={args.steps}",
                 f"trainer.seed={seed}", f"trainer.prompts_per_step={args.prompts}", f"trainer.max_staleness={staleness}",
                 f"trainer.rollout_worker={worker}", "trainer.eval_every=0",
                 "trainer.save_model=false", "trainer.resume=off", "algorithm.rollout_correction_cap=2.0",
                 f"trainer.output_dir={out / f'seed{seed}_{side}'}", "logging.sinks=[jsonl]",
                 "logging.num_samples_to_print=0"]
    trainer = RLTrainer(load_config(DEMO_CONFIGS / "arithmetic_grpo.yaml", overrides),
                        reward_fn=slow_exact_match(args.reward_delay_s))
    start = time.perf_counter()
    history = trainer.train()
    seconds = time.perf_counter() - start
    accuracy = trainer.evaluate()["eval/accuracy"]
    return {"seed": seed, "side": side, "max_staleness": staleness, "s_per_step": seconds / args.steps, "accuracy": accuracy,
            "staleness_mean": statistics.mean(row.get("rollout/staleness_mean", 0.0) for row in history),
            "wait_s": statistics.mean(row["timing/rollout_s"] for row in history),
            "reward_mean": statistics.mean(row["reward/mean"] for row in history[-10:])}


def table(rows: list[dict[str, float]]) -> str:
    lines = ["| seed | side | max_staleness | s/step | trainer waits for rollout (s/step) | held-out accuracy |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['seed']} | {r['side']} | {r['max_staleness']} | {r['s_per_step']:.3f} | {r['wait_s']:.3f} | "
              f"{r['accuracy']:.1%} |" for r in rows]
    sides = list(dict.fromkeys(r["side"] for r in rows))
    step = {side: statistics.mean(r["s_per_step"] for r in rows if r["side"] == side) for side in sides}
    accuracy = {side: statistics.mean(r["accuracy"] for r in rows if r["side"] == side) for side in sides}
    for side in sides:
        against = (f": {1 - step[side] / step['synchronous']:.1%} less wall-clock per step, accuracy "
                   f"{(accuracy[side] - accuracy['synchronous']) * 100:+.1f} points" if side != "synchronous" else "")
        lines.append(f"mean {side}: {step[side]:.3f} s/step, held-out accuracy {accuracy[side]:.1%}{against}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/async_bench")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reward-delay-s", type=float, default=0.1)
    parser.add_argument("--eval-samples", type=int, default=500)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (the demo's 32; x 8 samples)")
    parser.add_argument("--sft-steps", type=int, default=0, help="cap the SFT stage (0: the demo's)")
    parser.add_argument("--workers", nargs="+", choices=["thread", "process"], default=["thread"],
                        help="the max_staleness=1 sides (trainer.rollout_worker), each against the synchronous loop")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--sft-model", help="an SFT model directory to start from (default: made under --out)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    data, model = prepare(out, args.sft_steps, args.sft_model)
    print(f"torch threads: {torch.get_num_threads()}; reward delay {args.reward_delay_s * 1000:.0f} ms per batch",
          flush=True)
    rows = []
    sides = ["synchronous", *args.workers]
    for index, seed in enumerate(args.seeds):  # the order rotates from seed to seed
        for side in sides[index % len(sides):] + sides[:index % len(sides)]:
            rows.append(run(out, data, model, seed, side, args))
            print(json.dumps(rows[-1]), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "async_pipeline_benchmark.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
