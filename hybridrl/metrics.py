"""Metric sinks: a console line per step and a JSONL file per run (TensorBoard/W&B are optional sinks).

Metric names use fixed namespaces: `rollout/`, `reward/`, `actor/`, `critic/`, `eval/`, `perf/`,
`timing/`. Every sink receives the same flat dict of floats for a step.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

CONSOLE_KEYS = [
    ("reward/mean", "reward"), ("eval/accuracy", "eval_acc"), ("actor/kl", "kl"), ("actor/entropy", "entropy"),
    ("actor/clipfrac", "clip"), ("critic/value_loss", "vloss"), ("rollout/response_length_mean", "len"),
    ("perf/tokens_per_s", "tok/s"), ("timing/step_s", "step_s"), ("sft/loss", "loss"),
]


class ConsoleSink:
    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self.start = time.time()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"{short}={metrics[key]:.4g}" for key, short in CONSOLE_KEYS if key in metrics]
        elapsed = time.time() - self.start
        eta = elapsed / max(step, 1) * (self.total_steps - step)
        print(f"step {step}/{self.total_steps} " + " ".join(parts) + f" eta={eta:.0f}s", flush=True)

    def close(self) -> None:
        pass


class JsonlSink:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()  # a crash loses at most the step in flight

    def close(self) -> None:
        self.file.close()


class MetricsLogger:
    """Fans each step's metrics out to the configured sinks."""

    def __init__(self, output_dir: str | Path, sinks: list[str], total_steps: int, log_every: int = 1):
        self.output_dir = Path(output_dir)
        self.log_every = log_every
        self.sinks: list[Any] = []
        for name in sinks:
            if name == "console":
                self.console = ConsoleSink(total_steps)
            elif name == "jsonl":
                self.sinks.append(JsonlSink(self.output_dir / "metrics.jsonl"))
        self.history: list[dict[str, float]] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        flat = {key: to_float(value) for key, value in metrics.items()}
        self.history.append({"step": step, **flat})
        for sink in self.sinks:
            sink.write(step, flat)
        if hasattr(self, "console") and (step % self.log_every == 0 or step == 1):
            self.console.write(step, flat)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        value = value.detach().float().item()
    value = float(value)
    return value if math.isfinite(value) else float("nan")
