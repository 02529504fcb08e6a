"""Learning against TRL: hybridrl's GRPO and TRL's `GRPOTrainer` on the same SFT model, tokenizer, prompts,
reward and settings, several seeds run one after another (interleaved), held-out accuracy at each evaluation point.

    python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0 trl   # TRL apart from hybridrl
    python -m benchmarks.learning_vs_trl                       # the demo task, seeds 0 1 2, 60 steps
    python -m benchmarks.learning_vs_trl --task clean          # the clean-teacher task (no trailing periods)
    python -m benchmarks.learning_vs_trl --task carry          # the teacher slips on carries: RL must fix the arithmetic
    python -m benchmarks.learning_vs_trl --dry-run             # print the plan and the worker commands only
    python -m benchmarks.learning_vs_trl --sides hybridrl --hybridrl-overrides algorithm.dynamic_sampling=true
    python -m benchmarks.learning_vs_trl --tiny --sides hybridrl   # a tiny random model, 2 steps: checks the script

The task is the CPU demo's: `hybridrl make-data` arithmetic, the demo's SFT config on the tiny Llama (character
tokenizer), saved as a Hugging Face directory that both trainers load. Settings matched on both sides: prompts per
step x group size (one optimizer step per rollout), learning rate (constant, AdamW, no weight decay, gradient norm
1), sampling temperature, response length, clip 0.2, no KL term, token-mean loss (TRL's "dapo"), group-std
advantages; `trl_learning_worker.py` lists what still differs. Accuracy is measured by one evaluator for both
(`greedy_accuracy.py`: greedy, exact match on held-out problems never trained on). Each side runs in its own
process (TRL's in its own virtual environment), so neither shares the other's threads or imports; the training
wall-clock counts the steps only, not the evaluations. Seeds alternate which side runs first, so a change in the
machine's load falls on both.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.greedy_accuracy import greedy_accuracy, read_rows, sampled_pass_rates
from hybridrl.cli import DEMO_CONFIGS, DEMO_SFT_OVERRIDES, DEMO_TEACHERS
from hybridrl.config.loading import load_config
from hybridrl.data.tasks import write_arithmetic_task
from hybridrl.models.loading import build_tiny_model, save_hf_model
from hybridrl.training.sft import run_sft
from hybridrl.training.trainer import RLTrainer

ROOT = Path(__file__).resolve().parent.parent
TASKS = {  # name -> (the teacher's slips: write_arithmetic_task's keyword arguments, extra SFT overrides)
    "demo": (DEMO_TEACHERS["arithmetic"], []),
    "clean": ({}, ["sft.max_steps=2000"]),  # examples/clean_teacher_experiment.sh's SFT
    "carry": (DEMO_TEACHERS["carry"], DEMO_SFT_OVERRIDES["carry"]),  # forgets carries and borrows (tasks.slipped_answer)
}
SIDES = ("hybridrl", "trl")
TRL_VENV_HINT = "python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0 trl"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="demo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (one rollout each)")
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--max-eval-samples", type=int, default=500)
    parser.add_argument("--pass-k", type=int, default=8,
                        help="samples per held-out problem for sampled pass@1 / pass@k before and after RL (0: skip)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each process (on a shared machine more threads than free cores "
                             "make every step several times slower)")
    parser.add_argument("--sft-steps", type=int, default=0,
                        help="SFT optimizer steps when the script makes the SFT model (0: the demo config's)")
    parser.add_argument("--hybridrl-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for hybridrl's side only, e.g. algorithm.dynamic_sampling=true (a variant "
                             "beside the matched run; TRL's side is unchanged)")
    parser.add_argument("--sides", default="hybridrl,trl", help="comma-separated, from: " + ", ".join(SIDES))
    parser.add_argument("--trl-python", default="/tmp/trl-venv/bin/python",
                        help=f"the Python of TRL's virtual environment (made by: {TRL_VENV_HINT})")
    parser.add_argument("--sft-model", help="an SFT model directory to start from (default: made by the demo's SFT)")
    parser.add_argument("--out-dir", default="runs/learning_vs_trl")
    parser.add_argument("--save-models", action="store_true",
                        help="hybridrl's side saves each seed's final policy under <out-dir>/<task>/hybridrl_seed<N>/model "
                             "(for benchmarks/skill_task.py)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the worker commands, run nothing")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny random model, 64 problems, 2 steps: checks the script, measures nothing")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)  # internal: one side, one seed
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.prompts_per_step, args.group_size, args.eval_every, args.max_eval_samples = 2, 2, 2, 1, 16
    sides = [side for side in args.sides.split(",") if side]
    unknown = [side for side in sides if side not in SIDES]
    if unknown or not sides:
        parser.error(f"--sides {args.sides!r}: choose from {', '.join(SIDES)} (comma-separated).")
    args.sides = sides
    if args.sft_steps < 0:
        parser.error("--sft-steps must be >= 0 (0: the demo config's).")
    if args.pass_k < 0:
        parser.error("--pass-k must be >= 0 (0 skips the sampled pass rates).")
    for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "max_eval_samples", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.group_size < 2:
        parser.error("--group-size must be at least 2 (GRPO compares the samples of a prompt).")
    return args


def spec_for(args: argparse.Namespace, seed: int, model: str, data: dict[str, Path]) -> dict:
    """What one worker needs: the same dict for both sides."""
    return {"seed": seed, "model": str(model), "train_path": str(data["train"]), "eval_path": str(data["eval"]),
            "steps": args.steps, "prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
            "lr": args.lr, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
            "eval_every": args.eval_every, "max_eval_samples": args.max_eval_samples, "threads": args.threads,
            "pass_k": args.pass_k, "hybridrl_overrides": list(args.hybridrl_overrides), "save_model": args.save_models}


def worker_command(side: str, spec: dict, out: Path, trl_python: str) -> list[str]:
    if side == "trl":
        return [trl_python, "-m", "benchmarks.trl_learning_worker", "--spec", json.dumps(spec), "--out", str(out)]
    return [sys.executable, "-m", "benchmarks.learning_vs_trl", "--worker", "hybridrl", "--spec", json.dumps(spec),
            "--out", str(out)]


def due(step: int, every: int, last: int) -> bool:
    return (every and step % every == 0) or step == last


def hybridrl_trainer(spec: dict) -> RLTrainer:
    """The demo's GRPO config with the spec's settings (and its hybridrl-only overrides)."""
    batch = spec["prompts_per_step"] * spec["group_size"]
    overrides = [f"model.path={spec['model']}", f"data.train_path={spec['train_path']}", "data.eval_path=null",
                 f"trainer.seed={spec['seed']}", f"trainer.total_steps={spec['steps']}",
                 f"trainer.prompts_per_step={spec['prompts_per_step']}",
                 f"rollout.num_samples_per_prompt={spec['group_size']}", f"actor.lr={spec['lr']}",
                 f"rollout.temperature={spec['temperature']}", f"rollout.max_new_tokens={spec['max_new_tokens']}",
                 f"actor.micro_batch_size={batch}", "trainer.eval_every=0", f"trainer.device={spec.get('device', 'cpu')}", "trainer.resume=off",
                 "trainer.save_model=false", "logging.sinks=[jsonl]",
                 f"trainer.output_dir={Path(spec['out_dir']) / 'hybridrl_run'}", *spec.get("hybridrl_overrides", [])]
    return RLTrainer(load_config(DEMO_CONFIGS / "arithmetic_grpo.yaml", overrides))


def synchronize() -> None:
    """Wait for the GPU's queued work, so a step's wall-clock includes it (nothing on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_hybridrl(spec: dict) -> dict:
    """hybridrl's side, stepped here so the shared evaluator runs at the same points as on TRL's side. Optional spec
    keys (time_to_accuracy.py): `max_seconds` stops after that much training wall-clock, `target_accuracy` at the
    first evaluation that reaches it; either way the last step is evaluated; `eval_steps` are evaluated besides
    every `eval_every`-th; `partial_path` gets the result so far
    after each evaluation (a run cut short keeps its curve)."""
    torch.set_num_threads(spec["threads"])
    trainer = hybridrl_trainer(spec)
    model, tokenizer = trainer.parts.actor, trainer.parts.tokenizer
    rows = read_rows(spec["eval_path"])[:spec["max_eval_samples"]]
    accuracy, sampled, rewards, seconds, seconds_at_eval, step_seconds, phases = {}, {}, [], 0.0, {}, [], []

    def evaluate(step: int, last: bool = False) -> None:
        accuracy[step], seconds_at_eval[step] = greedy_accuracy(model, tokenizer, rows, spec["max_new_tokens"]), seconds
        if (step == 0 or last) and spec["pass_k"]:
            sampled[step] = sampled_pass_rates(model, tokenizer, rows, spec["max_new_tokens"], spec["pass_k"],
                                               spec["temperature"], spec["seed"])
        print(f"hybridrl seed {spec['seed']} step {step} ({seconds:.1f} s): held-out accuracy {accuracy[step]:.3f} "
              f"{sampled.get(step, '')}", flush=True)
        if spec.get("partial_path"):
            Path(spec["partial_path"]).write_text(json.dumps(result()))

    def result() -> dict:
        return {"side": "hybridrl", "seed": spec["seed"], "accuracy": accuracy, "sampled": sampled,
                "train_seconds": seconds, "reward_per_step": rewards, "seconds_at_eval": seconds_at_eval,
                "step_seconds": step_seconds, "phase_seconds": phases}

    evaluate(0)
    for step in range(1, spec["steps"] + 1):
        start = time.perf_counter()
        metrics = trainer.step()
        synchronize()
        step_seconds.append(time.perf_counter() - start)
        seconds += step_seconds[-1]
        rewards.append(float(metrics["reward/mean"]))
        phases.append({key: float(value) for key, value in metrics.items() if key.startswith("timing/")})
        last = step == spec["steps"] or seconds >= spec.get("max_seconds", float("inf"))
        if due(step, spec["eval_every"], spec["steps"]) or step in spec.get("eval_steps", ()) or last:
            evaluate(step, last)
            if last or accuracy[step] >= spec.get("target_accuracy", float("inf")):
                break
    if spec.get("save_model"):
        save_hf_model(model, tokenizer, Path(spec["out_dir"]) / "model")
    return result()


def prepare(args: argparse.Namespace, out: Path) -> tuple[Path, dict[str, Path]]:
    """The task's data and its SFT model (made once, reused when present)."""
    teacher, sft_overrides = TASKS[args.task]
    sizes = {"num_train": 64, "num_eval": 16} if args.tiny else {}
    data = write_arithmetic_task(out / "data", **teacher, **sizes)
    if args.sft_model:
        return Path(args.sft_model), data
    model_dir = out / "sft" / "model"
    if (model_dir / "config.json").is_file():
        print(f"reusing the SFT model in {model_dir} (delete it to train it again)", flush=True)
    elif args.tiny:
        save_hf_model(*build_tiny_model("llama", seed=0), model_dir)
    else:
        print(f"SFT ({args.task} task): the demo's config -> {model_dir}", flush=True)
        run_sft(load_config(DEMO_CONFIGS / "arithmetic_sft.yaml", [
            f"data.train_path={data['train']}", f"trainer.output_dir={out / 'sft'}", "trainer.device=cpu",
            "logging.sinks=[jsonl]", *sft_overrides, *([f"sft.max_steps={args.sft_steps}"] if args.sft_steps else [])]))
    return model_dir, data


def check_trl(trl_python: str) -> None:
    found = subprocess.run([trl_python, "-c", "import trl"], capture_output=True).returncode == 0 \
        if Path(trl_python).exists() else False
    if not found:
        sys.exit(f"error: {trl_python} cannot import trl; make TRL's environment with: {TRL_VENV_HINT} "
                 "(or pass --trl-python, or --sides hybridrl)")


def table(results: list[dict], sides: list[str]) -> str:
    """Accuracy (%) per seed and evaluation point for each side, then each side's mean and the training time."""
    points = sorted({int(step) for result in results for step in result["accuracy"]})
    lines = ["| side | seed | " + " | ".join(f"step {p}" for p in points) + " | training s |",
             "| --- | ---: | " + " | ".join("---:" for _ in points) + " | ---: |"]
    for side in sides:
        runs = sorted((r for r in results if r["side"] == side), key=lambda r: r["seed"])
        for run in runs:
            cells = [f"{100 * run['accuracy'][str(p)]:.1f}" if str(p) in run["accuracy"] else "" for p in points]
            lines.append(f"| {side} | {run['seed']} | " + " | ".join(cells) + f" | {run['train_seconds']:.0f} |")
        if runs:
            means = [statistics.mean(100 * r["accuracy"][str(p)] for r in runs) for p in points]
            seconds = statistics.mean(r["train_seconds"] for r in runs)
            lines.append(f"| **{side} mean** | | " + " | ".join(f"**{m:.1f}**" for m in means) + f" | {seconds:.0f} |")
    return "\n".join(lines)


def sampled_table(results: list[dict], sides: list[str]) -> str:
    """Sampled pass@1 and pass@k (%) before and after RL, per seed and each side's mean; empty when not measured."""
    measured = [r for r in results if len(r.get("sampled", {})) == 2]
    if not measured:
        return ""
    names = list(next(iter(measured[0]["sampled"].values())))  # ["pass@1", "pass@k"]
    lines = ["| side | seed | " + " | ".join(f"{name} before -> after" for name in names) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in names) + " |"]

    def cells(before: dict, after: dict) -> str:
        return " | ".join(f"{100 * before[n]:.1f} -> {100 * after[n]:.1f}" for n in names)

    for side in sides:
        runs = sorted((r for r in measured if r["side"] == side), key=lambda r: r["seed"])
        for run in runs:
            before, after = (run["sampled"][key] for key in sorted(run["sampled"], key=int))
            lines.append(f"| {side} | {run['seed']} | {cells(before, after)} |")
        if runs:
            mean = [{n: statistics.mean(r["sampled"][key][n] for r in runs) for n in names}
                    for key in sorted(runs[0]["sampled"], key=int)]
            lines.append(f"| **{side} mean** | | {cells(*mean)} |")
    return "\n".join(lines)


def verdict(results: list[dict]) -> str:
    finals = {side: statistics.mean(100 * r["accuracy"][str(max(map(int, r["accuracy"])))] for r in results
                                    if r["side"] == side) for side in SIDES if any(r["side"] == side for r in results)}
    if len(finals) < 2:
        return ""
    gap = finals["hybridrl"] - finals["trl"]
    return (f"mean final held-out accuracy: hybridrl {finals['hybridrl']:.1f}%, TRL {finals['trl']:.1f}% "
            f"({gap:+.1f} points; the bar is >= -2.0: {'met' if gap >= -2.0 else 'NOT met'})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.spec)
        result = run_hybridrl(spec)
        Path(args.out).write_text(json.dumps(result))
        return
    out = Path(args.out_dir) / (f"{args.task}-tiny" if args.tiny else args.task)
    model_dir, data = Path(args.sft_model or out / "sft" / "model"), {
        "train": out / "data" / "train.jsonl", "eval": out / "data" / "eval.jsonl"}
    plan = [(seed, side) for i, seed in enumerate(args.seeds) for side in (args.sides if i % 2 == 0 else args.sides[::-1])]
    if args.dry_run:
        for seed, side in plan:
            spec = {**spec_for(args, seed, model_dir, data), "out_dir": str(out / f"{side}_seed{seed}")}
            print(shlex.join(worker_command(side, spec, out / f"{side}_seed{seed}.json", args.trl_python)))
        return
    if "trl" in args.sides:
        check_trl(args.trl_python)
    torch.set_num_threads(args.threads)
    model_dir, data = prepare(args, out)
    results, start = [], time.time()
    for seed, side in plan:
        result_path = out / f"{side}_seed{seed}.json"
        spec = {**spec_for(args, seed, model_dir, data), "out_dir": str(out / f"{side}_seed{seed}")}
        print(f"== {side}, seed {seed}", flush=True)
        threads = str(args.threads)
        subprocess.run(worker_command(side, spec, result_path, args.trl_python), cwd=ROOT, check=True,
                       env={**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
        results.append(json.loads(result_path.read_text()))
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"\n{args.task} task, {args.steps} steps x {args.prompts_per_step} prompts x {args.group_size} samples, "
          f"lr {args.lr}, temperature {args.temperature}; held-out accuracy (%) on {args.max_eval_samples} problems; "
          f"all runs {time.time() - start:.0f} s")
    print(table(results, args.sides))
    print(sampled_table(results, args.sides))
    print(verdict(results))


if __name__ == "__main__":
    main()
