"""Time to accuracy: the training wall-clock hybridrl needs to reach the held-out accuracy that TRL's `GRPOTrainer`
reaches, on the same model, task and settings, on one GPU.

    python -m benchmarks.time_to_accuracy               # one GPU: model, SFT, TRL, hybridrl within --budget seconds
    python -m benchmarks.time_to_accuracy --tiny        # CPU, a tiny model, a few steps: checks the script only

1. **Model**: the Qwen2.5-0.5B body (hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate 4864, tied head)
   with the demo's character tokenizer (a vocabulary of ~100, so the body and not the head sets the step cost),
   random init on the device.
2. **SFT** on the demo task (two-digit arithmetic from a teacher that ends half its answers with a period, which
   exact match rejects): the demo's SFT config at this model's learning rate, on the device. The periods hold its
   held-out accuracy near half of what it gets right, which leaves room for RL. Saved once; both trainers start
   from it.
3. Per seed (`--seeds N`: seeds 0 .. N-1, each its own sampling and prompt order, all from the one SFT model):
   **TRL** 1.16 `GRPOTrainer` for `--trl-seconds` of training (its GPU default: float32 master weights, bf16
   autocast, HF generate), then each **hybridrl** arm of `--hybridrl-variants` (`default`: its GPU default, bf16
   weights with stochastic rounding and the built-in engine; `master32`: float32 master weights as TRL keeps)
   until it reaches that seed's TRL final accuracy or `--hybridrl-seconds`. Settings are learning_vs_trl.py's
   matched ones (prompts x group size per optimizer step, lr, temperature, no KL, token-mean loss, clip 0.2); each
   run is its own process through that script's workers.

Both sides are evaluated by one evaluator (`greedy_accuracy.py`: greedy exact match on held-out problems) at the
same steps: each of the first 10, then every 2nd to 20, every 5th to 50, every `--eval-every`-th after. Training
wall-clock counts the steps only (each ended by a device sync), not the evaluations nor model loading, and includes
the first steps (hybridrl's engine capturing its CUDA graphs, TRL's warm-up): it is what a user waits. Printed per
seed: each run's curve (accuracy against training seconds and samples), the seconds each needs to reach TRL's final
accuracy (the mean of its last 3 evaluations) and half / 90% of TRL's gain, each arm's ratio TRL seconds / its
seconds (also without each side's first step), each run's own final accuracy (its plateau) and step times; then,
over the seeds, the median and range of each ratio and final accuracy, and the floor of one step. The runs share
`--budget`: each gets its wanted seconds, all still queued scaled down alike when the seconds left cannot hold them
(a printed line says what was cut, and a run with under 5 s left is skipped). JSON goes to
$OUT/time_to_accuracy.json (else <out-dir>/time_to_accuracy.json), rewritten after each run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.grpo_step import SHAPES, floor
from benchmarks.learning_vs_trl import ROOT, TRL_VENV_HINT, spec_for, worker_command
from hybridrl.cli import DEMO_CONFIGS, DEMO_TEACHERS
from hybridrl.config.loading import load_config
from hybridrl.data.tasks import write_arithmetic_task
from hybridrl.models.loading import build_char_tokenizer, save_hf_model, tiny_config
from hybridrl.training.sft import run_sft

BODIES = {"0.5b": {k: v for k, v in SHAPES["0.5b"].items() if k != "vocab_size"},  # the character vocabulary instead
          "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=True)}
LOAD_SECONDS, EVAL_SHARE = 12.0, 0.3  # per run: start, load and first evaluation; evaluations per training second
# (both from the H200 runs in docs/benchmarks.md, "Time to accuracy against TRL")
MIN_TRAINING_SECONDS = 5.0  # a run the budget leaves less is skipped: its curve would hold only the first step
FINAL_EVALUATIONS = 3
DENSE_EVALUATIONS = [*range(1, 11), *range(12, 21, 2), *range(25, 51, 5)]
"""Steps evaluated besides every --eval-every-th: a fast learner's first steps, where time-to-accuracy is decided."""
GAIN_FRACTIONS = (0.5, 0.9, 1.0)  # targets: the SFT start plus this share of TRL's gain (1.0: TRL's final accuracy)
VARIANTS = {"default": [], "master32": ["actor.master_weights=float32"]}
"""hybridrl's arms: config overrides on top of --hybridrl-overrides. The default keeps bf16 weights and writes the
float32 AdamW update back with stochastic rounding; at lr 1e-6 an update is a small fraction of bf16's spacing, so
each step moves a weight by a whole spacing or not at all (unbiased, but noisy). master32 keeps float32 master
weights as TRL does: run beside the default, it shows whether a plateau below TRL's is that precision."""
TINY = dict(body="tiny", device="cpu", sft_steps=4, sft_batch_size=8, sft_eval_every=2, steps=3, eval_every=1000,
            prompts_per_step=2, group_size=2, max_eval_samples=16, threads=1, hybridrl_overrides=[])


def training_seconds(left: float, sides: int) -> float:
    """The training wall-clock that `sides` worker runs can share in `left` seconds (loads and evaluations aside)."""
    return (left - 5 - sides * LOAD_SECONDS) / (1 + EVAL_SHARE)


def fitted_seconds(queued: list[float], left: float) -> float:
    """The training seconds of the first of the `queued` runs (each given as its wanted seconds): what it wants, or,
    when `left` seconds cannot hold them all with their loads and evaluations, that scaled down as much as all the
    others (so a cut falls on every remaining run alike, not all on the last)."""
    return queued[0] * max(0.0, min(1.0, training_seconds(left, sides=len(queued)) / sum(queued)))


def arm_name(variant: str) -> str:
    return "hybridrl" if variant == "default" else f"hybridrl-{variant}"


def plan(args: argparse.Namespace, has_trl: bool) -> list[tuple[int, str, float, list[str]]]:
    """(seed, run name, wanted training seconds, hybridrl overrides) in running order: per seed TRL first (its final
    accuracy is where the hybridrl arms stop), then each hybridrl variant."""
    arms = [("trl", args.trl_seconds, [])] if has_trl else []
    arms += [(arm_name(variant), args.hybridrl_seconds, [*args.hybridrl_overrides, *VARIANTS[variant]])
             for variant in args.hybridrl_variants]
    return [(seed, *arm) for seed in range(args.seeds) for arm in arms]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=465, help="seconds for the whole run; runs shrink to fit")
    parser.add_argument("--seeds", type=int, default=2,
                        help="seeds 0 .. N-1: the model and SFT once, then per seed TRL and each hybridrl arm")
    parser.add_argument("--hybridrl-variants", default="default",
                        help="hybridrl arms, comma-separated, from: " + ", ".join(VARIANTS)
                             + " (master32: actor.master_weights=float32)")
    parser.add_argument("--body", choices=sorted(BODIES), default="0.5b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sft-steps", type=int, default=600,
                        help="SFT optimizer steps (on an H200 at the defaults: ~75 s, held-out accuracy ~40%%)")
    parser.add_argument("--sft-lr", type=float, default=3e-4)
    parser.add_argument("--sft-batch-size", type=int, default=128)
    parser.add_argument("--sft-eval-every", type=int, default=600,
                        help="SFT steps between held-out evaluations (default: before and after only)")
    parser.add_argument("--trl-seconds", type=float, default=65,
                        help="TRL's training wall-clock per seed (with the defaults two seeds of TRL and two hybridrl "
                             "arms fit the budget on an H200; docs/benchmarks.md says why this length)")
    parser.add_argument("--hybridrl-seconds", type=float, default=20,
                        help="each hybridrl arm's training wall-clock at most, per seed (it stops at TRL's final "
                             "accuracy; the default allows it about as many steps as TRL's budget on an H200)")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps at most, each side")
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--lr", type=float, default=1e-6,
                        help="RL learning rate (the default of both trainers; a 358M model moves fast: the tiny demo "
                             "model learns the task in 5 steps at 3e-5)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=10,
                        help="optimizer steps between evaluations after the first 50 (DENSE_EVALUATIONS before), each "
                             "side")
    parser.add_argument("--max-eval-samples", type=int, default=500)
    parser.add_argument("--threads", type=int, default=4, help="torch CPU threads of each process")
    parser.add_argument("--hybridrl-overrides", nargs="*", default=["rollout.kv_cache_memory=2"], metavar="KEY=VALUE",
                        help="config overrides for hybridrl's side (default: a 2 GiB KV cache, ample for 256 x 22 "
                             "tokens)")
    trl_default = sys.executable if importlib.util.find_spec("trl") else "/tmp/trl-venv/bin/python"
    parser.add_argument("--trl-python", default=trl_default,
                        help=f"a Python that imports trl (default: this one if it does, else TRL's venv: "
                             f"{TRL_VENV_HINT})")
    parser.add_argument("--sft-model", help="start both sides from this SFT model (skips building and SFT; its "
                                            "tokenizer must be the character one)")
    parser.add_argument("--out-dir", default="runs/time_to_accuracy")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU, a few steps: checks the script")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tiny:
        vars(args).update(TINY)
    for name in ("sft_steps", "sft_batch_size", "steps", "prompts_per_step", "max_new_tokens", "eval_every",
                 "max_eval_samples", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.group_size < 2:
        parser.error("--group-size must be at least 2 (GRPO compares the samples of a prompt).")
    if args.seeds < 1:
        parser.error("--seeds must be at least 1.")
    args.hybridrl_variants = [name for name in args.hybridrl_variants.split(",") if name]
    unknown = [name for name in args.hybridrl_variants if name not in VARIANTS]
    if unknown or not args.hybridrl_variants or len(set(args.hybridrl_variants)) < len(args.hybridrl_variants):
        parser.error(f"--hybridrl-variants: {', '.join(unknown) or 'none given or one named twice'}; give each "
                     f"at most once, comma-separated, from: {', '.join(VARIANTS)}.")
    args.pass_k, args.save_models = 0, False  # what learning_vs_trl.spec_for reads beside the settings above
    return args


def build_model(body: str, device: str, path: Path) -> int:
    """A random model of `body` with the character tokenizer, initialized on `device`, saved to `path`; returns
    its parameter count."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    config = tiny_config("qwen2", vocab_size=len(tokenizer), max_position_embeddings=512, **BODIES[body])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                                 attn_implementation="sdpa")
    save_hf_model(model, tokenizer, path)
    return sum(p.numel() for p in model.parameters())


def step_floor(model_dir: Path, args: argparse.Namespace, prompt_tokens: int) -> dict:
    """The floor of one GRPO step of `args`' sizes on the model in `model_dir` (grpo_step.py's: decode reads the
    weights and KV once per token, prefill and 6 x parameters x tokens of training at the H200's rates)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    train_flops = 6 * params * args.prompts_per_step * args.group_size * (prompt_tokens + args.max_new_tokens)
    return floor(model, config, {"prompts": args.prompts_per_step, "n": args.group_size}, prompt_tokens,
                 args.max_new_tokens, train_flops)


def sft(args: argparse.Namespace, data: dict[str, Path], init: Path, out: Path) -> tuple[Path, list[dict]]:
    """The demo's SFT config on the random model; returns the saved model and its held-out curve (step, training
    seconds, accuracy, loss)."""
    model = run_sft(load_config(DEMO_CONFIGS / "arithmetic_sft.yaml", [
        f"model.path={init}", f"data.train_path={data['train']}", f"data.eval_path={data['eval']}",
        f"data.max_eval_samples={args.max_eval_samples}", f"trainer.output_dir={out}", f"trainer.device={args.device}",
        f"trainer.eval_every={args.sft_eval_every}", f"sft.max_steps={args.sft_steps}", "sft.num_epochs=100000",
        f"sft.lr={args.sft_lr}", f"sft.batch_size={args.sft_batch_size}", "logging.sinks=[jsonl]"]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    elapsed = {row["step"]: row["timing/elapsed_s"] for row in rows if "timing/elapsed_s" in row}
    curve = [{"step": row["step"], "seconds": elapsed.get(row["step"], 0.0), "accuracy": row["eval/accuracy"],
              "loss": row.get("eval/loss")} for row in rows if "eval/accuracy" in row]
    return model, curve


CACHES = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}  # kernel caches: variable -> folder


def use_caches(folder: Path) -> dict[str, str]:
    """The environment variables that point Triton's and Inductor's caches into `folder`."""
    return {variable: str(folder / name) for variable, name in CACHES.items()}


def run_side(worker: str, name: str, spec: dict, out: Path, trl_python: str, timeout: float,
             start_caches: Path | None = None) -> dict:
    """One run (`worker`: trl or hybridrl, its result saved as `name`) in its own process (learning_vs_trl.py's
    workers); a failure or a timeout becomes an `error`, beside the curve up to the worker's last evaluation. Each
    run gets Triton and Inductor caches of its own, copied from `start_caches` (what the SFT built) or empty, so every
    seed and arm starts from the same kernel builds as the first run does (else later runs would find the earlier
    runs' builds and skip them in their first step)."""
    out.mkdir(parents=True, exist_ok=True)
    result_path, partial_path, caches = out / f"{name}.json", out / f"{name}.partial.json", out / f"{name}_caches"
    for path in (result_path, partial_path):
        path.unlink(missing_ok=True)
    shutil.rmtree(caches, ignore_errors=True)
    if start_caches is not None and start_caches.is_dir():
        shutil.copytree(start_caches, caches)
    threads = str(spec["threads"])
    command = worker_command(worker, {**spec, "partial_path": str(partial_path)}, result_path, trl_python)
    timeout = max(1.0, timeout)
    try:
        done = subprocess.run(command, cwd=ROOT, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                                   **use_caches(caches)})
        error = f"exit status {done.returncode} (its output is above)" if done.returncode else None
    except subprocess.TimeoutExpired:
        error = f"cut after {timeout:.0f} s (the run's --budget)"
    if error is None and result_path.is_file():
        return json.loads(result_path.read_text())
    partial = json.loads(partial_path.read_text()) if partial_path.is_file() else {}
    return {**partial, "side": name, "error": error or "no result file"}


def curve(result: dict, samples_per_step: int) -> list[tuple[int, int, float, float]]:
    """(step, samples, training seconds, accuracy) at each evaluation, in step order."""
    return [(int(step), int(step) * samples_per_step, result["seconds_at_eval"][step], result["accuracy"][step])
            for step in sorted(result["accuracy"], key=int)]


def first_reach(points: list[tuple[int, int, float, float]], target: float) -> tuple[int, float] | None:
    """(step, training seconds) of the first evaluation at or above `target`, or None if none reached it."""
    return next(((step, seconds) for step, _, seconds, accuracy in points if accuracy >= target - 1e-9), None)


def final_accuracy(points: list[tuple[int, int, float, float]], before: int = 0) -> float | None:
    """The mean of the last FINAL_EVALUATIONS evaluations after the start: a plateau's level, not one evaluation's
    luck (None without a step evaluated); with `before` = 1, of the FINAL_EVALUATIONS evaluations before those (how
    much the level still moved)."""
    trained = [point[3] for point in points[1:]]
    trained = trained[:max(0, len(trained) - before * FINAL_EVALUATIONS)][-FINAL_EVALUATIONS:]
    return statistics.mean(trained) if trained else None


def targets(trl_points: list[tuple[int, int, float, float]]) -> dict[str, float]:
    """Accuracies to reach: TRL's start plus each GAIN_FRACTIONS share of its gain up to its final accuracy; none
    when TRL gained nothing."""
    start, final = trl_points[0][3], final_accuracy(trl_points)
    if final is None or final <= start:
        return {}
    return {f"{round(100 * f)}% of TRL's gain": start + f * (final - start) for f in GAIN_FRACTIONS}


def step_facts(result: dict) -> dict:
    seconds = result.get("step_seconds", [])
    return {"steps": len(seconds), "first_step_s": seconds[0] if seconds else None,
            "median_step_s": statistics.median(seconds[1:]) if len(seconds) > 1 else None}


def phase_text(phases: list[dict[str, float]]) -> str:
    """The median of each `timing/` phase over the steps after the first (hybridrl's side reports them)."""
    if len(phases) < 2:
        return ""
    return " (" + ", ".join(f"{key[len('timing/'):]} {statistics.median(p.get(key, 0.0) for p in phases[1:]):.3f} s"
                            for key in phases[1]) + ")"


def target_line(name: str, target: float, points: dict[str, list], steps: dict[str, dict]) -> tuple[str, dict]:
    """One target: when each run first reached it and each hybridrl arm's speed-up (TRL's seconds / the arm's),
    counting every training second (what a user waits) and without each side's first step (hybridrl's captures its
    CUDA graphs)."""
    reached = {side: first_reach(side_points, target) for side, side_points in points.items()}
    figures = {"accuracy": target, "reached": reached, "ratio": {}, "ratio_without_first_step": {}}
    cells = [f"{side} {'not reached' if reach is None else f'{reach[1]:.1f} s (step {reach[0]})'}"
             for side, reach in reached.items()]
    speedups, trl = [], reached.get("trl")
    for arm, ours in reached.items():
        if arm == "trl" or not (trl and ours and ours[0] > 0):
            continue
        figures["ratio"][arm] = trl[1] / ours[1]
        text = f"{arm} {figures['ratio'][arm]:.2f}x faster"
        if trl[0] > 1 and ours[0] > 1:
            figures["ratio_without_first_step"][arm] = ((trl[1] - steps["trl"]["first_step_s"])
                                                        / (ours[1] - steps[arm]["first_step_s"]))
            text += f" ({figures['ratio_without_first_step'][arm]:.2f}x without each side's first step)"
        speedups.append(text)
    line = f"to {100 * target:.1f}% ({name}): " + ", ".join(cells)
    return line + (": " + "; ".join(speedups) + " (goal >= 5x)" if speedups else ""), figures


def summary(results: dict, samples_per_step: int) -> tuple[list[str], dict]:
    """One seed's lines to print (curves, step times, each run's final accuracy, times to each target, ratios) and
    the same figures as a dict."""
    lines, figures = [], {"targets": {}, "steps": {}, "final": {}}
    points = {side: curve(r, samples_per_step) for side, r in results.items() if "accuracy" in r}
    for side, side_points in points.items():
        facts = figures["steps"][side] = step_facts(results[side])
        lines.append(f"{side}: " + ", ".join(f"step {step} ({samples} samples, {seconds:.1f} s) {100 * accuracy:.1f}%"
                                            for step, samples, seconds, accuracy in side_points))
        if facts["median_step_s"] is not None:
            lines.append(f"{side}: {facts['steps']} steps of {samples_per_step} samples; first step "
                         f"{facts['first_step_s']:.2f} s, median of the rest {facts['median_step_s']:.3f} s"
                         + phase_text(results[side].get("phase_seconds", [])))
    for side, side_points in points.items():
        final = figures["final"][side] = final_accuracy(side_points)
        earlier = figures.setdefault("final_before", {})[side] = final_accuracy(side_points, before=1)
        if final is not None:
            lines.append(f"{side}: final {100 * final:.1f}% (mean of its last {FINAL_EVALUATIONS} evaluations"
                         + (f"; the {FINAL_EVALUATIONS} before them {100 * earlier:.1f}%" if earlier is not None else "")
                         + f"), best {100 * max(point[3] for point in side_points[1:]):.1f}%, from "
                         f"{100 * side_points[0][3]:.1f}% at step 0")
    if "trl" not in points:
        lines.append("no TRL curve: no target accuracy, so no time-to-accuracy ratio")
        return lines, figures
    goals = targets(points["trl"])
    if not goals:
        lines.append("TRL did not gain over the SFT start within its budget: no target accuracy, no ratio")
    for name, target in goals.items():
        line, figures["targets"][name] = target_line(name, target, points, figures["steps"])
        lines.append(line)
    steps, figures["step_ratio"] = figures["steps"], {}
    for arm in (side for side in points if side != "trl"):
        if steps["trl"]["median_step_s"] and steps[arm]["median_step_s"]:
            figures["step_ratio"][arm] = steps["trl"]["median_step_s"] / steps[arm]["median_step_s"]
            lines.append(f"median step: TRL / {arm} = {figures['step_ratio'][arm]:.2f}x (same samples per step)")
    return lines, figures


def spread(values: list[float]) -> dict | None:
    """Median and range of `values` (None when there are none)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)} \
        if values else None


def spread_text(figures: dict, unit: str = "x") -> str:
    """'3.50x (median of 2; 3.40-3.60)', accuracies as percentages (unit '%')."""
    scale, digits = (100, 1) if unit == "%" else (1, 2)
    text = f"{scale * figures['median']:.{digits}f}{unit}"
    if figures["n"] > 1:
        text += f" (median of {figures['n']}; {scale * figures['min']:.{digits}f}-{scale * figures['max']:.{digits}f})"
    return text


def ratio_text(arm: str, figures: dict | None, seeds: int) -> str:
    if figures is None:
        return f"{arm} reached it in none of {seeds} seeds"
    return f"{arm} {spread_text(figures)} faster" + (
        f" (reached it in {figures['n']} of {seeds} seeds)" if figures["n"] < seeds else "")


def across_seeds(per_seed: dict[int, dict]) -> tuple[list[str], dict]:
    """Each ratio and each run's final accuracy over the seeds: median and range, and in how many seeds a target
    was reached (a ratio exists only where both reached it)."""
    seeds = len(per_seed)
    names = [name for figures in per_seed.values() for name in figures["targets"]]
    runs = [side for figures in per_seed.values() for side in figures["final"]]
    lines, result = [], {"targets": {}, "final": {}, "step_ratio": {}}
    for name in dict.fromkeys(names):
        arms = dict.fromkeys(arm for figures in per_seed.values() for arm in figures["final"] if arm != "trl")
        result["targets"][name] = {kind: {arm: spread([figures["targets"][name][kind][arm]
                                                      for figures in per_seed.values()
                                                      if arm in figures["targets"].get(name, {}).get(kind, {})])
                                          for arm in arms} for kind in ("ratio", "ratio_without_first_step")}
        lines.append(f"to {name}: " + "; ".join(ratio_text(arm, result["targets"][name]["ratio"][arm], seeds)
                                                 for arm in arms))
    for side in dict.fromkeys(runs):
        result["final"][side] = spread([figures["final"][side] for figures in per_seed.values()
                                        if figures["final"].get(side) is not None])
        if result["final"][side]:
            lines.append(f"{side}'s final accuracy: {spread_text(result['final'][side], '%')}")
        if side != "trl":
            result["step_ratio"][side] = spread([figures["step_ratio"][side] for figures in per_seed.values()
                                                 if side in figures.get("step_ratio", {})])
            if result["step_ratio"][side]:
                lines.append(f"median step: TRL / {side} = {spread_text(result['step_ratio'][side])}")
    return lines, result


class Run:
    """The run's clock, its progress lines and its JSON report, written after each phase so a cut run keeps what
    finished."""

    def __init__(self, args: argparse.Namespace, out: Path):
        self.start, self.budget = time.time(), args.budget
        self.path = Path(os.environ["OUT"]) / "time_to_accuracy.json" if os.environ.get("OUT") else \
            out / "time_to_accuracy.json"
        self.report = {"args": vars(args), "date": time.strftime("%Y-%m-%d"), "phases": {}}

    def left(self) -> float:
        return self.budget - (time.time() - self.start)

    def say(self, text: str) -> None:
        print(f"[{time.time() - self.start:6.1f} s] {text}", flush=True)

    def save(self, phase: str, value) -> None:
        self.report["phases"][phase] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.report, indent=1))


def prepare(args: argparse.Namespace, out: Path, run: Run) -> tuple[Path, dict[str, Path]]:
    """The task's data and the SFT model both sides start from: built and trained here unless --sft-model gives it."""
    sizes = {"num_train": 64, "num_eval": 16} if args.tiny else {}
    data = write_arithmetic_task(out / "data", **DEMO_TEACHERS["arithmetic"], **sizes)
    if args.sft_model:
        run.say(f"SFT model given: {args.sft_model}")
        return Path(args.sft_model).resolve(), data
    params = build_model(args.body, args.device, out / "init")
    run.say(f"model: {args.body} body, {params / 1e6:.1f}M parameters, random init on {args.device}, saved")
    run.save("model", {"body": args.body, "params": params, "seconds": time.time() - run.start})
    started = time.time()
    shutil.rmtree(out / "sft", ignore_errors=True)  # its metrics file would keep an earlier run's curve
    model, sft_curve = sft(args, data, out / "init", out / "sft")
    run.say(f"SFT: {args.sft_steps} steps in {time.time() - started:.1f} s; held-out accuracy "
            + ", ".join(f"step {p['step']} ({p['seconds']:.0f} s) {100 * p['accuracy']:.1f}% (loss {p['loss']:.3f})"
                        for p in sft_curve))
    run.save("sft", {"seconds": time.time() - started, "curve": sft_curve})
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the workers get the GPU; this process keeps only its context
    return model, data


def run_seeds(args: argparse.Namespace, spec: dict, out: Path, run: Run, has_trl: bool,
              start_caches: Path | None = None) -> dict[int, dict]:
    """Every planned run in order, each given its share of the seconds left and a copy of `start_caches` (run_side);
    a hybridrl arm stops at its seed's TRL final accuracy (when TRL gained) or at its own budget. Returns
    {seed: {run name: result}}."""
    queue, results = plan(args, has_trl), {}
    for index, (seed, name, wanted, overrides) in enumerate(queue):
        later = len(queue) - index - 1
        seconds, left = fitted_seconds([queued[2] for queued in queue[index:]], run.left()), run.left()
        share = f"{left:.0f} s left for {later + 1} run{'s' if later else ''}"
        if seconds < MIN_TRAINING_SECONDS:
            run.say(f"seed {seed} {name}: skipped, {share} (raise --budget)")
            run.save(f"seed{seed}/{name}", {"skipped": share})
            continue
        cut = f" (cut from {wanted:.0f} s: {share})" if seconds < wanted - 0.5 else ""
        seed_results, stop = results.setdefault(seed, {}), {}
        if name != "trl" and "accuracy" in seed_results.get("trl", {}):
            stop = targets(curve(seed_results["trl"], 1))
            stop = {"target_accuracy": stop[f"{round(100 * GAIN_FRACTIONS[-1])}% of TRL's gain"]} if stop else {}
        run.say(f"seed {seed} {name}: up to {seconds:.0f} s of training{cut}" + (
            f", stopping at TRL's final accuracy {100 * stop['target_accuracy']:.1f}% (mean of its last "
            f"{FINAL_EVALUATIONS} evaluations)" if stop else ""))
        run_spec = {**spec, "seed": seed, "max_seconds": seconds, "out_dir": str(out / f"seed{seed}" / f"{name}_run"),
                    "hybridrl_overrides": overrides, **stop}
        started = time.time()
        result = seed_results[name] = run_side("trl" if name == "trl" else "hybridrl", name, run_spec,
                                               out / f"seed{seed}", args.trl_python,
                                               run.left() - 5 - later * LOAD_SECONDS, start_caches)
        result["wall_s"] = time.time() - started  # loading and evaluations included: what the budget pays
        run.save(f"seed{seed}/{name}", result)
        points = curve(result, 1) if "accuracy" in result else []
        final = final_accuracy(points) if points else None
        run.say(f"seed {seed} {name}: " + (f"failed: {result['error']}; " if "error" in result else "")
                + f"{len(result.get('step_seconds', []))} steps, {result.get('train_seconds', 0.0):.1f} s of training "
                  f"in {result['wall_s']:.0f} s"
                + (f", final {100 * final:.1f}%" if final is not None else ""))
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out_dir).resolve() / ("tiny" if args.tiny else args.body)
    run = Run(args, out)
    has_trl = Path(args.trl_python).exists() and subprocess.run(
        [args.trl_python, "-c", "import trl"], capture_output=True).returncode == 0
    if not has_trl:
        run.say(f"TRL skipped: {args.trl_python} cannot import trl (make its environment with: {TRL_VENV_HINT}, or "
                "on the GPU machine install .bench/'s wheels); hybridrl runs for its budget alone")
    torch.set_num_threads(args.threads)
    start_caches = out / "caches_after_sft"  # the kernels this process builds (SFT's) are where every run starts
    shutil.rmtree(start_caches, ignore_errors=True)
    os.environ.update(use_caches(start_caches))
    model, data = prepare(args, out, run)
    spec = {**spec_for(args, 0, model, data), "device": args.device, "eval_steps": DENSE_EVALUATIONS}
    results = run_seeds(args, spec, out, run, has_trl, start_caches)
    samples_per_step = args.prompts_per_step * args.group_size
    per_seed = {seed: summary(seed_results, samples_per_step) for seed, seed_results in results.items()}
    seed_lines, figures = across_seeds({seed: seed_figures for seed, (_, seed_figures) in per_seed.items()})
    prompts = [json.loads(line)["prompt"] for line in data["train"].read_text().splitlines()]
    figures["floor"] = step_floor(model, args, round(statistics.mean(map(len, prompts))))  # a character is a token
    figures["seeds"] = {seed: seed_figures for seed, (_, seed_figures) in per_seed.items()}
    run.save("summary", figures)
    model_name = f"the SFT model {args.sft_model}" if args.sft_model else f"{args.body} body"
    print(f"\ntime to accuracy ({model_name}, demo task, {args.prompts_per_step} prompts x {args.group_size} "
          f"samples per step, lr {args.lr}; training seconds exclude evaluations):")
    for seed, (lines, _) in per_seed.items():
        print(f"-- seed {seed}\n" + "\n".join(lines))
    print(f"-- over {len(per_seed)} seed{'s' if len(per_seed) > 1 else ''}\n" + "\n".join(seed_lines))
    for side, seed_figures in figures["seeds"].get(0, {}).get("steps", {}).items():
        if seed_figures["median_step_s"]:
            print(f"{side}'s median step (seed 0) is {seed_figures['median_step_s'] / figures['floor']['step_s']:.1f}x "
                  f"the floor of one step ({1000 * figures['floor']['step_s']:.1f} ms at the H200's rates)")
    run.say(f"done; JSON in {run.path}")


if __name__ == "__main__":
    main()
