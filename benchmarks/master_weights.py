"""The lean default (bf16 weights, float32 moments, stochastic rounding) against conventional mixed precision
(`actor.master_weights=float32`) on the demo task, several seeds: does the default learn as well?

    python -m benchmarks.master_weights [--seeds 0,1,2] [--device cuda] [--parallel-seeds] [--out DIR] [--tiny]

Per seed: one SFT run (the demo's config, `trainer.seed` = the seed), then GRPO from that checkpoint with each
setting, in alternating order, each in its own `hybridrl train` process (the same CLI a user runs). Prints the
held-out exact-match accuracy before and after RL and the wall-clock of each run, then the mean difference; both
sides evaluate with the same compute dtype, so the SFT start is the same number for both. `--tiny`: a few steps on
CPU, for the test that the script runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"default": "actor.master_weights=none", "float32 master": "actor.master_weights=float32"}


def hybridrl(*args: str) -> float:
    """Run one `hybridrl` command in its own process; returns its wall-clock seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hybridrl.cli", *args], cwd=ROOT, check=True)
    return time.perf_counter() - start


def accuracies(metrics_path: Path) -> list[float]:
    """`eval/accuracy` at every evaluation of a run, in step order (the first is before any update)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]


def run_seed(seed: int, args: argparse.Namespace, data: Path) -> dict:
    out = args.out / f"seed{seed}"
    common = [f"trainer.device={args.device}", f"trainer.seed={seed}", "logging.sinks=[jsonl]"]
    hybridrl("sft", "examples/arithmetic_sft.yaml", f"data.train_path={data}/train.jsonl",
             f"trainer.output_dir={out}/sft", f"sft.max_steps={args.sft_steps}", *common)
    results = {}
    order = list(SETTINGS) if seed % 2 == 0 else list(reversed(SETTINGS))
    for name in order:
        run_dir = out / name.replace(" ", "_")
        wall = hybridrl("train", "examples/arithmetic_grpo.yaml", f"model.path={out}/sft/model",
                        f"data.train_path={data}/train.jsonl", f"data.eval_path={data}/eval.jsonl",
                        f"trainer.output_dir={run_dir}", f"trainer.total_steps={args.steps}",
                        f"trainer.eval_every={max(1, args.steps // 3)}", "trainer.save_model=false",
                        SETTINGS[name], *common, *args.overrides)
        evals = accuracies(run_dir / "metrics.jsonl")
        results[name] = {"before": evals[0], "after": evals[-1], "wall_s": wall}
    return results


def table(per_seed: dict[int, dict]) -> str:
    lines = ["seed  SFT start  " + "  ".join(f"{name:>22}" for name in SETTINGS)]
    for seed, results in per_seed.items():
        cells = [f"{100 * r['after']:6.1f}% ({100 * (r['after'] - r['before']):+5.1f}) {r['wall_s']:5.0f} s"
                 for r in (results[name] for name in SETTINGS)]
        start = results["default"]["before"]
        lines.append(f"{seed:>4}  {100 * start:8.1f}%  " + "  ".join(f"{c:>22}" for c in cells))
    means = {name: statistics.mean(r[name]["after"] for r in per_seed.values()) for name in SETTINGS}
    lines.append("mean final held-out accuracy: " + ", ".join(f"{n} {100 * m:.1f}%" for n, m in means.items())
                 + f"; default - float32 master = {100 * (means['default'] - means['float32 master']):+.1f} points")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path("runs/master_weights"))
    parser.add_argument("--sft-steps", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps")
    parser.add_argument("--parallel-seeds", action="store_true",
                        help="run the seeds at once, one process each (a large GPU holds them all; wall-clock then "
                             "compares the settings within a seed, not with a run alone)")
    parser.add_argument("--tiny", action="store_true", help="a few steps on CPU (the script's test)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for both GRPO settings")
    args = parser.parse_args(argv)
    if args.tiny:
        args.sft_steps, args.steps, args.device = 4, 2, "cpu"
        args.overrides = [*args.overrides, "trainer.prompts_per_step=4", "data.max_eval_samples=8"]
    args.out = args.out.resolve()
    data = args.out / "data"
    hybridrl("make-data", str(data))
    seeds = [int(s) for s in args.seeds.split(",")]
    with ThreadPoolExecutor(len(seeds) if args.parallel_seeds else 1) as pool:
        per_seed = dict(zip(seeds, pool.map(lambda seed: run_seed(seed, args, data), seeds)))
    for seed, results in per_seed.items():
        print(f"seed {seed}: {json.dumps(results)}", flush=True)
    print(table(per_seed))


if __name__ == "__main__":
    main()
