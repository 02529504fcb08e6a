"""Where the host's time goes in a warm `generate` call on the grpo-0.5b shape (64 prompts x n=8, prompt 256,
response 256 forced; the default engine): before the first decode step the GPU waits for the host (preamble,
queueing the prefill, recording the decode graph), so host time there is rollout time.

Prints, for the last of `--calls` warm calls: the host milliseconds inside each engine phase (wrapped methods, no
profiler running) and the timeline; then one more call under cProfile, its top functions by own time and by
cumulative time (cProfile slows Python-heavy code, so read those as shares, not as milliseconds).

    python -m benchmarks.profiling.host_profile [--calls 3] [--top 30]
    python -m benchmarks.profiling.host_profile --tta    # the time-to-accuracy run's rollout (engine_ab.py --tta)

With `--tta` each call is followed by `release_memory()`, as in the trainer, so a kept run (`kept_runs.py`) is what
the later calls reuse.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import time
from collections import defaultdict

import torch

from benchmarks.profiling.engine_ab import TTA_OPTIONS, tta_rollout
from benchmarks.rollout import build_model, timeline_line
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine import runner as engine_runner
from hybridrl.rollout.engine.backend import BuiltinBackend

ENGINE_PHASES = ("_harvest", "release_memory")
"""`BuiltinBackend` methods timed: the scheduler's harvest of finished sequences and the release after a call."""
RUNNER_PHASES = ("begin", "_weights", "_allocate", "prefill", "_prefill_chunk", "decode", "read_progress",
                 "read_outputs", "move", "end")
"""`ModelRunner` methods timed (engine/runner.py)."""
GRAPH_PHASES = ("warm_up", "capture")
"""`DecodeGraphs` methods timed (engine/graphs.py)."""
MODULE_FUNCTIONS = ("rope_table", "auto_fuses_gate_up", "DecodeState", "weight_addresses")
"""Functions the runner calls by module name (engine/runner.py's imports)."""


def timed(function, totals: dict, name: str):
    @functools.wraps(function)
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--tta", action="store_true", help="the time-to-accuracy run's rollout (above)")
    args = parser.parse_args()
    if args.tta:
        model, prompts, params = tta_rollout()
        engine = BuiltinBackend(model, **TTA_OPTIONS)
    else:
        model = build_model("cuda")
        generator = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, model.config.vocab_size, (64, 256), generator=generator).tolist()
        params = SamplingParams(max_new_tokens=256, temperature=1.0, n=8, seed=0, ignore_eos=True)
        engine = BuiltinBackend(model)
    totals: dict[str, float] = defaultdict(float)
    for owner, names in ((engine, ENGINE_PHASES), (engine.runner, RUNNER_PHASES), (engine.runner.graphs, GRAPH_PHASES),
                         (engine_runner, MODULE_FUNCTIONS)):
        missing = [name for name in names if not hasattr(owner, name)]
        if missing:  # the engine changed: say so rather than print a table without them
            print(f"not timed (no longer on {type(owner).__name__}): {', '.join(missing)}", flush=True)
        for name in names:
            if hasattr(owner, name):
                setattr(owner, name, timed(getattr(owner, name), totals, name))
    for call in range(args.calls):
        totals.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, params)
        if args.tta:
            engine.release_memory()
        torch.cuda.synchronize()
        print(f"call {call + 1}: {time.perf_counter() - start:.4f} s", flush=True)
    print("host ms per phase, last call (nested phases count in their parents too):")
    for name, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {name:>20} {1e3 * seconds:8.2f}")
    print(timeline_line(engine.last_stats))
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    engine.generate(prompts, params)
    if args.tta:
        engine.release_memory()
    torch.cuda.synchronize()
    profiler.disable()
    for order in ("tottime", "cumulative"):
        print(f"\ncProfile of one more call, top {args.top} by {order}:")
        pstats.Stats(profiler).strip_dirs().sort_stats(order).print_stats(args.top)


if __name__ == "__main__":
    main()
