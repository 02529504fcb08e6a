"""`hybridrl plot RUN_DIR`: PNG curves of a run from its `metrics.jsonl` (matplotlib, imported lazily).

One figure, a panel per quantity that the run logged (reward, KL, entropy, response length,
tokens/s, held-out exact-match accuracy and pass@k; for an SFT run its loss and gradient norm), each with the raw values faint and a moving average on top, so a noisy
RL curve still shows its trend.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hybridrl.config.schema import MissingExtra
from hybridrl.metrics.sinks import PASS_AT_K_PREFIX

PANELS = [
    ("reward/mean", "reward (mean)"), ("actor/kl", "KL to reference"), ("actor/entropy", "entropy"),
    ("rollout/response_length_mean", "response length (tokens)"), ("perf/tokens_per_s", "generated tokens/s"),
    ("eval/accuracy", "held-out exact-match accuracy"), ("sft/loss", "SFT loss"), ("sft/grad_norm", "SFT gradient norm"),
]


def panels_of(rows: list[dict[str, float]]) -> list[tuple[str, str]]:
    """(metric, title) of each panel the run has data for: PANELS, with `eval/pass@k` (its name carries k,
    `eval.num_samples`) after the exact-match accuracy."""
    logged = {key for row in rows for key in row}
    passes = [(key, f"held-out {key.removeprefix('eval/')} (exact match)") for key in sorted(logged)
              if key.startswith(PASS_AT_K_PREFIX)]
    panels = []
    for key, title in PANELS:
        if key in logged:
            panels.append((key, title))
        if key == "eval/accuracy":
            panels += passes
    return panels


class PlotError(ValueError):
    """The run directory cannot be plotted; the message says why and what to pass instead."""


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """The rows of RUN_DIR/metrics.jsonl. A last line cut off by a run still writing it is skipped."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir} is not a directory; give a run's trainer.output_dir (e.g. runs/demo/grpo).")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir} has no metrics.jsonl; give the trainer.output_dir of a run that logged to jsonl.")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise PlotError(f"{path} line {number} is not valid JSON; the file is damaged.") from None
    return rows


def moving_average(values: list[float], window: int) -> list[float]:
    out, total, queue = [], 0.0, []
    for value in values:
        queue.append(value)
        total += value
        if len(queue) > window:
            total -= queue.pop(0)
        out.append(total / len(queue))
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write `out` (default RUN_DIR/curves.png) and return its path."""
    rows = read_metrics(run_dir)  # a wrong directory is reported before asking for matplotlib
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtra("hybridrl plot draws with matplotlib, which the base install leaves out; add it with "
                           "pip install 'hybridrl[plot]' (hybridrl watch RUN_DIR --once shows the curves in the "
                           "terminal with the [watch] extra).") from None
    panels = panels_of(rows)
    if not panels:
        raise PlotError(f"{run_dir}/metrics.jsonl has none of {', '.join(k for k, _ in PANELS)} yet; "
                        "plot it once the run has logged a step.")
    columns = min(3, len(panels))
    lines = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(lines, columns, figsize=(4.6 * columns, 3.3 * lines), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        points = [(row["step"], row[key]) for row in rows if key in row and math.isfinite(row[key])]
        steps, values = [p[0] for p in points], [p[1] for p in points]
        window = max(1, len(values) // 20)
        if window > 1:
            ax.plot(steps, values, color="tab:blue", alpha=0.3, linewidth=1)
            ax.plot(steps, moving_average(values, window), color="tab:blue", linewidth=2,
                    label=f"moving average ({window})")
            ax.legend(fontsize=8, loc="best")
        else:
            ax.plot(steps, values, color="tab:blue", linewidth=2, marker="o" if len(values) < 30 else None)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    figure.suptitle(str(Path(run_dir)), fontsize=10)
    figure.tight_layout()
    out = Path(out) if out is not None else Path(run_dir) / "curves.png"
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
