"""Kill loop: SIGKILL a CPU training run at random moments of every phase, resume it each time, and check that it
ends bitwise equal to a run that was never interrupted, with no step lost or repeated.

Each attempt is a forked child of this process (a restart costs no interpreter start-up or imports; the parent
imports torch but runs no torch operation, so the fork is safe) that trains the tiny test model with a checkpoint
after every step and `trainer.resume=auto`. The child reports the phase it is in through shared memory (the
trainer's phase methods are wrapped). The parent picks a phase at random (start-up, resume, rollout, score,
log-probs, advantages, update, logging, checkpoint write; the final model save last) and its first, second or third
entry, waits until the child gets there, sleeps a random few milliseconds more and sends SIGKILL, noting the phase
the child was in at that moment and whether a checkpoint was half-written. After the last kill a child runs to the
end. Then the metric rows (timings aside) and `model/model.safetensors` must equal those of an uninterrupted run
byte for byte, `metrics.jsonl` must hold steps 1..N once each, and no `.tmp-step_*` directory may be left.

    python -m benchmarks.kill_loop --kills 24 --steps 40 --seed 0
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from hybridrl import PromptDataset, RLTrainer
from hybridrl.metrics.sinks import MetricsLogger
from hybridrl.models.loading import build_tiny_model

PHASES = ["startup", "resume", "rollout", "score", "logprobs", "advantages", "update", "log", "checkpoint",
          "save_model"]
TRAINER_METHODS = {"resume": "resume", "rollout": "rollout", "score": "score", "logprobs": "compute_logprobs",
                   "advantages": "compute_advantages", "update": "update", "checkpoint": "save_checkpoint",
                   "save_model": "save_model"}
SETTINGS = dict(rollout__max_new_tokens=4, rollout__num_samples_per_prompt=4, trainer__prompts_per_step=4,
                actor__micro_batch_size=16, trainer__device="cpu", logging__sinks=["jsonl"], actor__lr=1e-2,
                algorithm__kl_coef=0.1, actor__lr_schedule="cosine", trainer__save_every=1, trainer__keep_last_n=2,
                trainer__divergence_check=False)
MODEL_FILE = Path("model") / "model.safetensors"
MAX_ENTRY = 3
"""A phase of a step is hit at its first, second or third entry in an attempt: attempts finish (and checkpoint) up to
two steps before the kill, so most resumes load a real checkpoint."""
MAX_DELAY_S = 0.04
"""Longest pause between the child entering the chosen phase and the SIGKILL (tiny-model phases last 5-100 ms)."""


def contains_seven(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    return [float("7" in completion) for completion in completions]


def train_child(out: str, total_steps: int, phase: Any, entries: Any) -> None:
    """One attempt: build the tiny model and train (resuming from the newest checkpoint), reporting the phase it is
    in (`phase`) and how often it entered each (`entries`: a phase of a millisecond is not missed by polling)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the trainer's console lines
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # the model save's progress bar on stderr
    torch.set_num_threads(1)
    code = {name: index for index, name in enumerate(PHASES)}

    def reporting(name: str, method: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            phase.value = code[name]
            entries[code[name]] += 1
            return method(*args, **kwargs)
        return wrapper

    for name, method in TRAINER_METHODS.items():
        setattr(RLTrainer, method, reporting(name, getattr(RLTrainer, method)))
    MetricsLogger.log = reporting("log", MetricsLogger.log)
    phase.value = code["startup"]
    entries[code["startup"]] += 1
    actor = build_tiny_model("llama", seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
    prompts = [{"prompt": f"{i % 10}+{(i * 7) % 10}="} for i in range(64)]
    dataset = PromptDataset(prompts, actor.tokenizer, max_length=16)
    RLTrainer(actor=actor, reward_fn=contains_seven, dataset=dataset, trainer__output_dir=out,
              trainer__total_steps=total_steps, **SETTINGS).train()


def attempt(out: Path, total_steps: int, target: tuple[str, int, float] | None) -> dict[str, Any] | None:
    """Run one child; with `target` (phase, its n-th entry, delay) kill it there and return what was hit, else wait
    for the end."""
    context = multiprocessing.get_context("fork")
    phase = context.Value("i", -1, lock=False)
    entries = context.Array("i", len(PHASES), lock=False)
    child = context.Process(target=train_child, args=(str(out), total_steps, phase, entries))
    started = time.monotonic()
    latest = out / "checkpoints" / "latest"
    resumed_from = latest.read_text().strip() if latest.is_file() else None
    child.start()
    while child.is_alive():
        if target is not None and entries[PHASES.index(target[0])] >= target[1]:
            time.sleep(target[2])
            hit = PHASES[phase.value] if phase.value >= 0 else "startup"
            half_written = any((out / "checkpoints").glob(".tmp-step_*"))
            os.kill(child.pid, signal.SIGKILL)
            child.join()
            return {"target": target[0], "phase": hit, "half_written_checkpoint": half_written,
                    "seconds": time.monotonic() - started, "resumed_from": resumed_from}
        time.sleep(0.001)
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the training child exited with status {child.exitcode} (its error is printed above)")
    return None


def comparable_rows(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kill_loop(work_dir: Path, kills: int, total_steps: int, seed: int) -> dict[str, Any]:
    """Kill a run `kills` times at random phases, let it finish, and compare it with an uninterrupted run."""
    rng = random.Random(seed)
    reference, killed = work_dir / "reference", work_dir / "killed"
    start = time.monotonic()
    attempt(reference, total_steps, None)
    reference_s = time.monotonic() - start
    events: list[dict[str, Any]] = []
    while len(events) < kills:
        last = len(events) == kills - 1  # the final model save can come only once every step is done
        phase = "save_model" if last else rng.choice(PHASES[:-1])
        entry = 1 if phase in ("startup", "resume", "save_model") else rng.randint(1, MAX_ENTRY)
        target = (phase, entry, rng.uniform(0.0, MAX_DELAY_S))
        event = attempt(killed, total_steps, target)
        if event is None:  # the run ended before reaching its target phase
            raise RuntimeError(f"the run finished after {len(events)} kills; give more --steps than {total_steps}")
        events.append(event)
    start = time.monotonic()
    attempt(killed, total_steps, None)
    final_s = time.monotonic() - start
    rows, reference_rows = comparable_rows(killed), comparable_rows(reference)
    steps = [row["step"] for row in rows]
    resumes = [json.loads(line).get("perf/resume_s") for line in (killed / "metrics.jsonl").read_text().splitlines()]
    return {
        "kills": len(events), "events": events, "by_phase": Counter(event["phase"] for event in events),
        "half_written_checkpoints": sum(event["half_written_checkpoint"] for event in events),
        "resumed_attempts": sum(event["resumed_from"] is not None for event in events),
        "metrics_equal": rows == reference_rows, "steps": steps, "steps_expected": list(range(1, total_steps + 1)),
        "model_equal": sha256(killed / MODEL_FILE) == sha256(reference / MODEL_FILE),
        "leftover_temporary_dirs": len(list((killed / "checkpoints").glob(".tmp-step_*"))),
        "resume_s": [value for value in resumes if value is not None],
        "reference_s": reference_s, "final_attempt_s": final_s,
    }


def report(result: dict[str, Any]) -> str:
    lines = [f"{result['kills']} SIGKILLs, each followed by a resume; kills by the phase the run was in:"]
    for phase in PHASES:
        if result["by_phase"].get(phase):
            lines.append(f"  {phase:<11} {result['by_phase'][phase]}")
    lines.append(f"kills while a checkpoint was half-written: {result['half_written_checkpoints']}")
    lines.append(f"attempts that had resumed from a checkpoint before their kill: {result['resumed_attempts']}")
    lost = sorted(set(result["steps_expected"]) - set(result["steps"]))
    repeated = len(result["steps"]) - len(set(result["steps"]))
    lines.append(f"steps in metrics.jsonl: {len(result['steps'])} of {len(result['steps_expected'])} "
                 f"(lost {len(lost)}, repeated {repeated})")
    lines.append(f"metrics (timings aside) equal to the uninterrupted run: {result['metrics_equal']}")
    lines.append(f"model.safetensors byte-identical to the uninterrupted run's: {result['model_equal']}")
    lines.append(f"leftover .tmp-step_* directories: {result['leftover_temporary_dirs']}")
    if result["resume_s"]:
        lines.append(f"perf/resume_s of the resumes that reached a step: {len(result['resume_s'])}, "
                     f"max {max(result['resume_s']):.3f} s")
    lines.append(f"uninterrupted run {result['reference_s']:.1f} s; "
                 f"last (completing) attempt {result['final_attempt_s']:.1f} s")
    return "\n".join(lines)


def passed(result: dict[str, Any]) -> bool:
    return (result["metrics_equal"] and result["model_equal"] and result["steps"] == result["steps_expected"]
            and result["leftover_temporary_dirs"] == 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=24)
    parser.add_argument("--steps", type=int, default=40, help="trainer.total_steps of the run (about 1.5 per kill)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--work-dir", default=None, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kill_loop_"))
    try:
        result = kill_loop(work_dir, args.kills, args.steps, args.seed)
    finally:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    print(report(result))
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
