"""`hybridrl watch RUN_DIR`: a live terminal view of a run while it trains (rich, imported lazily).

It only reads what the run writes (`metrics.jsonl`, `samples.jsonl`), so it can watch a run on the same
machine from another terminal, or one on a shared disk, and never slows the run down. Each panel of
`hybridrl plot` gets a row: its latest value, range, and a sparkline of its recent history; below, the
latest step's sample table.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from hybridrl.config.schema import MissingExtra
from hybridrl.metrics.plot import panels_of, read_metrics

SPARK = "▁▂▃▄▅▆▇█"
HISTORY = 60
"""Points in each sparkline: the most recent steps that logged the quantity."""


def sparkline(values: list[float], width: int = HISTORY) -> str:
    """The last `width` values as block characters, lowest to highest of that window."""
    values = [v for v in values if math.isfinite(v)][-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low
    top = len(SPARK) - 1
    return "".join(SPARK[0 if span == 0 else int((v - low) / span * top + 0.5)] for v in values)


def latest_samples(run_dir: Path, limit: int = 8) -> tuple[int | None, list[dict[str, Any]]]:
    """(step, rows) of the last step in samples.jsonl; a half-written last line is skipped."""
    path = run_dir / "samples.jsonl"
    if not path.is_file():
        return None, []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not rows:
        return None, []
    step = rows[-1]["step"]
    return step, [row for row in rows if row["step"] == step][:limit]


def render(run_dir: str | Path) -> Any:
    """One frame: the run's curves as a table of sparklines, then its latest samples."""
    _, table_class, group_class = _rich()
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    curves = table_class(title=f"{run_dir}  ·  step {rows[-1]['step'] if rows else 0}", expand=False)
    for header, justify in (("quantity", "left"), ("latest", "right"), ("min", "right"), ("max", "right"),
                            (f"last {HISTORY} points", "left")):
        curves.add_column(header, justify=justify)
    for key, title in panels_of(rows):
        values = [row[key] for row in rows if key in row and isinstance(row[key], (int, float))]
        if values:
            curves.add_row(title, f"{values[-1]:.4g}", f"{min(values):.4g}", f"{max(values):.4g}", sparkline(values))
    step, samples = latest_samples(run_dir)
    parts = [curves]
    if samples:
        table = table_class(title=f"samples at step {step}", expand=False)
        for header in ("prompt", "completion", "reward"):
            table.add_column(header, overflow="fold", max_width=60)
        for sample in samples:
            table.add_row(str(sample["prompt"])[-120:], str(sample["completion"])[:240], f"{sample['reward']:.3g}")
        parts.append(table)
    return group_class(*parts)


def watch(run_dir: str | Path, interval_s: float = 2.0, once: bool = False) -> None:
    """Redraw `render(run_dir)` every `interval_s` seconds until Ctrl-C; `once` prints a single frame."""
    console_class, _, _ = _rich()
    from rich.live import Live

    console = console_class()
    read_metrics(run_dir)  # a wrong directory is one sentence before the screen is taken over
    if once:
        console.print(render(run_dir))
        return
    with Live(render(run_dir), console=console, refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                live.update(render(run_dir))
        except KeyboardInterrupt:
            pass


def _rich() -> tuple[Any, Any, Any]:
    try:
        from rich.console import Console, Group
        from rich.table import Table
    except ImportError:
        raise MissingExtra("hybridrl watch needs rich: pip install 'hybridrl[watch]'.") from None
    return Console, Table, Group
