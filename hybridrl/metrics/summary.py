"""The few lines a run prints when it ends: what it changed and what it cost, from its metric history.

Every held-out metric (`eval/...`) is shown first -> last, so a user sees whether the run helped without
opening a plot; then the steps done, wall time, generated tokens per second, the peak memory, and where
the model and metrics went.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _first_and_last(history: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    values = [row[key] for row in history if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])]
    return (values[0], values[-1]) if values else None


def is_share(key: str) -> bool:
    """Held-out metrics that are shares of prompts (exact-match accuracy, pass@k): shown in percent."""
    return key == "eval/accuracy" or key.startswith("eval/pass@")


def run_summary(history: list[dict[str, Any]], wall_s: float, output_dir: str | Path,
                model_dir: str | Path | None = None, title: str = "run") -> str:
    """Lines of text: held-out metrics before -> after, steps, time, throughput, memory, output paths."""
    lines = [f"== {title} summary"]
    eval_keys = sorted({key for row in history for key in row if key.startswith("eval/")},
                       key=lambda key: (not is_share(key), key))
    for key in eval_keys:
        first_last = _first_and_last(history, key)
        if first_last:
            first, last = first_last
            if is_share(key):
                lines.append(f"  {key}: {first:.1%} -> {last:.1%} ({(last - first) * 100:+.1f} points)")
            else:
                lines.append(f"  {key}: {first:.4g} -> {last:.4g}")
    steps = max((row.get("step", 0) for row in history), default=0)
    throughput = [row["perf/tokens_per_s"] for row in history if "perf/tokens_per_s" in row]
    peak = max((row["perf/peak_memory_gib"] for row in history if "perf/peak_memory_gib" in row), default=None)
    cost = f"  {steps} steps in {wall_s:.0f} s"
    if throughput:
        cost += f", {sum(throughput) / len(throughput):,.0f} generated tokens/s on average"
    if peak is not None:
        cost += f", peak memory {peak:.2f} GiB"
    lines.append(cost)
    output_dir = Path(output_dir)
    if model_dir is not None:
        lines.append(f"  model: {model_dir}")
    if (output_dir / "metrics.jsonl").is_file():
        lines.append(f"  metrics: {output_dir / 'metrics.jsonl'} (hybridrl plot / hybridrl watch {output_dir})")
    return "\n".join(lines)
