"""Metric sinks: console (a progress bar on a terminal, plain lines otherwise), JSONL, TensorBoard, W&B.

Metric names use fixed namespaces: `rollout/`, `reward/`, `actor/`, `critic/`, `eval/`, `perf/`,
`timing/`. Every sink receives the same flat dict of floats for a step. TensorBoard and W&B are
imported only when chosen, and a missing package names the extra to install. On resume the logger
is `rewind`-ed to the checkpoint's history, so steps re-run after a crash are not written twice.
Sample prompts/completions/rewards handed to `add_samples` are printed as a small table with the
console line and appended to `samples.jsonl`.

Output to a closed pipe (`hybridrl train ... | head`, or `| tee log` when Ctrl-C ends tee) never stops a run:
the first write that finds the reader gone points standard output at /dev/null for the rest of the process
(`stop_printing`), and the JSONL metrics, checkpoints and the model are written as before.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridrl.config.schema import MissingExtra

CONSOLE_KEYS = [
    ("reward/mean", "reward"), ("eval/accuracy", "eval_exact"), ("actor/kl", "kl"), ("actor/entropy", "entropy"),
    ("actor/clipfrac", "clip"), ("critic/value_loss", "vloss"), ("rollout/response_length_mean", "len"),
    ("perf/tokens_per_s", "tok/s"), ("timing/step_s", "step_s"), ("sft/loss", "loss"),
]
PASS_AT_K_PREFIX = "eval/pass@"
"""`eval/pass@k` (`eval.num_samples` = k > 1): its name carries k, so it is found by this prefix."""


def console_keys(metrics: dict[str, float]) -> list[tuple[str, str]]:
    """(metric, short name) of the console line, in order: CONSOLE_KEYS present, with pass@k after eval_exact."""
    keys = [(key, short) for key, short in CONSOLE_KEYS if key in metrics]
    passes = [(key, key.removeprefix("eval/")) for key in sorted(metrics) if key.startswith(PASS_AT_K_PREFIX)]
    after = next((i + 1 for i, (key, _) in enumerate(keys) if key == "eval/accuracy"), len(keys))
    return keys[:after] + passes + keys[after:]


PROGRESS_KEYS = [("reward/mean", "reward"), ("actor/kl", "kl"), ("perf/tokens_per_s", "tok/s"), ("sft/loss", "loss")]


def stop_printing() -> None:
    """Point standard output at /dev/null: its reader is gone, and every later print (ours, a library's, the
    interpreter's flush at exit) would raise BrokenPipeError out of whatever called it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (captured): replace the object instead
        sys.stdout = open(os.devnull, "w")
    finally:
        os.close(devnull)


def print_unless_closed(text: str) -> None:
    """`print(text, flush=True)`, except that a closed pipe stops printing instead of raising."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        stop_printing()


class ConsoleSink:
    """One line per logged step; on a terminal also a tqdm bar with ETA, reward, KL and tokens/s."""

    def __init__(self, total_steps: int, progress: bool | None = None, start_step: int = 0):
        self.total_steps = total_steps
        self.start, self.start_step = time.time(), start_step
        self.bar = None
        if progress if progress is not None else sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stdout)

    def progress(self, step: int, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix({short: f"{metrics[key]:.4g}" for key, short in PROGRESS_KEYS if key in metrics},
                                 refresh=True)

    def write(self, step: int, metrics: dict[str, float], table: str = "") -> None:
        parts = [f"{short}={metrics[key]:.4g}" for key, short in console_keys(metrics)]
        elapsed = time.time() - self.start
        eta = elapsed / max(step - self.start_step, 1) * (self.total_steps - step)
        line = f"step {step}/{self.total_steps} " + " ".join(parts) + f" eta={eta:.0f}s" + table
        try:
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)
        except BrokenPipeError:
            stop_printing()

    def rewind(self, step: int, history: list[dict[str, float]]) -> None:
        self.start, self.start_step = time.time(), step
        if self.bar is not None:
            self.bar.reset(total=self.total_steps)
            self.bar.update(step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class JsonlSink:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = path.open("a")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()  # a crash loses at most the step in flight

    def rewind(self, step: int, history: list[dict[str, float]]) -> None:
        """Rewrite the file from the checkpoint's history: lines of steps after it were never checkpointed."""
        self.file.close()
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(json.dumps(row) + "\n" for row in history))
        os.replace(temporary, self.path)
        self.file = self.path.open("a")

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Scalars through `torch.utils.tensorboard`; on resume, events of later steps are purged."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise MissingExtra("logging.sinks has 'tensorboard' but the tensorboard package is not installed; "
                              "run `pip install 'hybridrl[tensorboard]'` or drop the sink.") from None
        self.log_dir, self.writer_class = log_dir, SummaryWriter
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def rewind(self, step: int, history: list[dict[str, float]]) -> None:
        self.writer.close()
        self.writer = self.writer_class(log_dir=str(self.log_dir), purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases; `WANDB_MODE=offline` (or no login) writes a local run that `wandb sync` uploads later.

    The run id is kept in `output_dir/wandb_run_id` so a resumed run continues the same W&B run.
    """

    def __init__(self, output_dir: Path, config: dict[str, Any] | None):
        try:
            import wandb
        except ImportError:
            raise MissingExtra("logging.sinks has 'wandb' but the wandb package is not installed; "
                              "run `pip install 'hybridrl[wandb]'` or drop the sink.") from None
        id_file = output_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        output_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id)
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hybridrl"), name=output_dir.name,
                              id=run_id, resume="allow", dir=str(output_dir), config=config,
                              settings=wandb.Settings(silent=True))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def write_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.wandb.Table(columns=["step", "prompt", "completion", "reward"])
        for row in rows:
            table.add_data(step, row["prompt"], row["completion"], row["reward"])
        self.run.log({"samples": table}, step=step)

    def rewind(self, step: int, history: list[dict[str, float]]) -> None:
        pass  # W&B ignores logs for steps it has already seen

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Fans each step's metrics out to the configured sinks and keeps the history (checkpointed)."""

    def __init__(self, output_dir: str | Path, sinks: list[str], total_steps: int, log_every: int = 1,
                 num_samples_to_print: int = 0, config: dict[str, Any] | None = None,
                 progress: bool | None = None, warn: bool = True):
        self.output_dir = Path(output_dir)
        self.log_every = log_every
        self.num_samples_to_print = num_samples_to_print
        self.console: ConsoleSink | None = None
        self.sinks: list[Any] = []
        for name in sinks:
            if name == "console":
                self.console = ConsoleSink(total_steps, progress)
            elif name == "jsonl":
                self.sinks.append(JsonlSink(self.output_dir / "metrics.jsonl"))
            elif name == "tensorboard":
                self.sinks.append(TensorBoardSink(self.output_dir / "tensorboard"))
            elif name == "wandb":
                self.sinks.append(WandbSink(self.output_dir, config))
        self.history: list[dict[str, float]] = []
        self.memory_warned = not warn  # one process of a multi-GPU run warns for all
        self.pending: dict[str, float] = {}
        self.samples: list[dict[str, Any]] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        flat = {key: to_float(value) for key, value in {**metrics, **self.pending}.items()}
        self.pending = {}
        self.history.append({"step": step, **flat})
        warning = None if self.memory_warned else memory_growth_warning(self.history)
        if warning:
            print_unless_closed(warning)
            self.memory_warned = True
        for sink in self.sinks:
            sink.write(step, flat)
        printing = step % self.log_every == 0 or step == 1
        if self.console is not None:
            self.console.progress(step, flat)
            if printing:
                self.console.write(step, flat, format_samples(self.samples) if self.samples else "")
        if printing and self.samples:
            self._write_samples(step)
        self.samples = []

    def add_once(self, metrics: dict[str, float]) -> None:
        """Metrics to attach to the next logged step only (e.g. `perf/resume_s`)."""
        self.pending.update(metrics)

    def add_samples(self, prompts: list[str], completions: list[str], rewards: list[float]) -> None:
        """The step's samples; the first `num_samples_to_print` are shown with the next console line."""
        self.samples = [{"prompt": p, "completion": c, "reward": float(r)}
                        for p, c, r in list(zip(prompts, completions, rewards))[:self.num_samples_to_print]]

    def _write_samples(self, step: int) -> None:
        path = self.output_dir / "samples.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as file:
            for row in self.samples:
                file.write(json.dumps({"step": step, **row}) + "\n")
        for sink in self.sinks:
            if hasattr(sink, "write_samples"):
                sink.write_samples(step, self.samples)

    def rewind(self, step: int, history: list[dict[str, float]]) -> None:
        """Continue from a checkpoint taken after `step`: drop everything logged for later steps."""
        self.history = [dict(row) for row in history]
        for sink in self.sinks + ([self.console] if self.console is not None else []):
            sink.rewind(step, self.history)
        samples = self.output_dir / "samples.jsonl"
        if samples.is_file():
            kept = [line for line in samples.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line)["step"] <= step]
            samples.write_text("".join(kept))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.console is not None:
            self.console.close()


def memory_growth_warning(history: list[dict[str, float]], threshold_gib: float = 1.0, settle_steps: int = 2) -> str | None:
    """One sentence when the GPU memory a step leaves allocated (`perf/memory_held_gib`) has risen more
    than `threshold_gib` above its lowest value since the first `settle_steps` steps (which fill
    caches): a leak that would end the run out of memory, named while there is time to stop it."""
    held = [(row["step"], row["perf/memory_held_gib"]) for row in history
            if "perf/memory_held_gib" in row and row["step"] > settle_steps]
    if len(held) < 2:
        return None
    low_step, low = min(held, key=lambda item: item[1])
    step, now = held[-1]
    if now - low <= threshold_gib:
        return None
    return (f"warning: GPU memory held between steps grew from {low:.2f} GiB (step {low_step:.0f}) to {now:.2f} GiB "
            f"(step {step:.0f}); something keeps GPU tensors from every step alive (a reward function or callback "
            f"storing them?), and the run will end out of memory; docs/observability.md says how to find what "
            f"holds them.")


def format_samples(rows: list[dict[str, Any]], width: int = 60) -> str:
    """A small fixed-width table (prompt | completion | reward), one row per sample, newlines shown as ⏎."""
    def cell(text: str) -> str:
        text = text.replace("\n", "⏎")
        return (text[:width - 1] + "…") if len(text) > width else text.ljust(width)

    lines = [f"  {'prompt'.ljust(width)} | {'completion'.ljust(width)} | reward"]
    lines += [f"  {cell(r['prompt'])} | {cell(r['completion'])} | {r['reward']:.3g}" for r in rows]
    return "\n" + "\n".join(lines)


def to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        value = value.detach().float().item()
    value = float(value)
    return value if math.isfinite(value) else float("nan")
