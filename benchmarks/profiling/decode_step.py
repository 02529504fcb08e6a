"""One decode step, kernel by kernel, at small and middle batches: where the time goes that does not shrink with the
batch (the long-tail rollout's tail runs 2.2-3.1 ms per step at 1-32 sequences of the 1.5B shape against a floor of
0.8-1.6 ms).

For each case the engine (its defaults on CUDA: compiled per-layer pieces, CUDA graphs, Triton attention and sampler)
runs one warm-up call, one timed call and one call under torch.profiler (GPU activity only: tracing the host stretches
the gaps). Each decode window (the steps between two host syncs) is bracketed by a `spin_kernel` (`torch.cuda._sleep`)
on each side, so the trace's kernels are split into windows without any host synchronisation; the first window of a
call is left out (it records the call's CUDA graphs). Per case it prints the unprofiled GPU ms per step (CUDA events
around each window), and from the trace the busy and idle µs per step and the kernels by (name, grid): calls per step,
µs per call, µs per step, largest first: the LM head's GEMM and the sampler's kernels are those called once per step.

    python -m benchmarks.profiling.decode_step [--batches 1,8,32,128] [--context 4096] [--layouts paged] [--no-tta]
        [--compare] [--out DIR]

Cases: the long-tail model (Qwen2.5-1.5B shape, random init) at each batch, n = min(batch, 8) samples of
batch / n prompts of `--context` tokens (so the attention reads long contexts), with the long-tail's response capacity
(`--capacity`, so the attention splits its keys as there: balanced splits up to 16 sequences, capacity-sized ones
above, where split 0 then holds the whole prompt) and each response forced to the profiled windows' length; then, unless `--no-tta`, the
time-to-accuracy run's rollout (0.5B body, 64-token vocabulary, 32 prompts x 8 = 256 rows, the light options: SDPA,
PyTorch sampler, uncompiled). `--compare`: each 1.5B case of at most `decode_linear.MAX_ROWS` sequences runs
twice in turn, without and with the narrow-batch pieces (`engine/small_batch.py`), as `<case>` and `<case>-small`.
`--out`: each case's trace (`trace_<case>.json.gz`) and all tables (`decode_step.json`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import os
import shutil
import time

import torch

from benchmarks.long_tail import QWEN25_15B, read_bytes
from benchmarks.profiling.engine_ab import TTA_OPTIONS, tta_rollout
from benchmarks.rollout import build_model, sync
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine import small_batch
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.kernels.decode_linear import MAX_ROWS

MARKER = "spin_kernel"
"""The kernel `torch.cuda._sleep` launches: it brackets each decode window in the trace."""
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
BANDWIDTH = 4.8e12
"""H200 HBM bytes/s, for the floor column."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,16,128", help="sequences per decode step, comma-separated")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens of each 1.5B-shape sequence")
    parser.add_argument("--layouts", default="paged", help="KV cache layouts of the 1.5B cases, comma-separated")
    parser.add_argument("--windows", type=int, default=5, help="decode windows per call (16 steps each)")
    parser.add_argument("--capacity", type=int, default=8192,
                        help="max_new_tokens of the 1.5B cases (each response forced to the windows' length)")
    parser.add_argument("--no-tta", action="store_true", help="skip the time-to-accuracy rollout's case")
    parser.add_argument("--compare", action="store_true",
                        help="each 1.5B case of a narrow batch also with the narrow-batch pieces (small_batch.py)")
    parser.add_argument("--top", type=int, default=24, help="kernel rows printed per case")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="where traces and tables go (default $OUT)")
    return parser.parse_args(argv)


@contextlib.contextmanager
def marked_windows(engine: BuiltinBackend):
    """For the calls made inside: each `runner.decode` (one window) between two marker kernels and two CUDA events.
    Yields the list of (steps, start event, end event), one per window."""
    runner, windows = engine.runner, []
    original = runner.decode

    def decode(batch: int, kv_len: int, steps: int) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(100)
        start.record()
        original(batch, kv_len, steps)
        end.record()
        torch.cuda._sleep(100)
        windows.append((steps, start, end))

    runner.decode = decode
    try:
        yield windows
    finally:
        del runner.decode


def window_activities(activities: list[dict]) -> list[list[dict]]:
    """GPU activities (trace events with ts, dur, name) -> the activities of each window, in order: those between
    the first and second marker, the third and fourth, and so on."""
    windows, current = [], None
    for event in sorted(activities, key=lambda e: e["ts"]):
        if MARKER in event["name"]:
            if current is None:
                current = []
            else:
                windows.append(current)
                current = None
        elif current is not None:
            current.append(event)
    return windows


def kernel_rows(windows: list[list[dict]], steps: int) -> list[dict]:
    """Activities grouped by (name, grid), per decode step: calls, µs per call, µs per step; largest first."""
    totals, counts = collections.Counter(), collections.Counter()
    for window in windows:
        for event in window:
            key = (event["name"][:90], str(event.get("args", {}).get("grid", "")))
            totals[key] += event["dur"]
            counts[key] += 1
    return [dict(name=name, grid=grid, calls_per_step=counts[key] / steps, us_per_call=total / counts[key],
                 us_per_step=total / steps) for key, total in totals.most_common() for name, grid in [key]]


def step_figures(windows: list[list[dict]], steps: int) -> dict:
    """Busy (summed durations) and idle (window span minus busy) µs per step, activities per step."""
    busy = sum(event["dur"] for window in windows for event in window)
    span = sum(max(e["ts"] + e["dur"] for e in window) - min(e["ts"] for e in window) for window in windows if window)
    return dict(busy_us_per_step=busy / steps, idle_us_per_step=(span - busy) / steps,
                activities_per_step=sum(len(window) for window in windows) / steps)


def timed_call(engine: BuiltinBackend, prompts, params, lengths) -> tuple[float, list]:
    """GPU ms per decode step over the windows after the first, and the windows' step counts."""
    with marked_windows(engine) as windows:
        engine.generate(prompts, params, lengths)
        sync()
    later = windows[1:]
    steps = sum(window[0] for window in later)
    return sum(start.elapsed_time(end) for _, start, end in later) / max(steps, 1), [w[0] for w in windows]


def profiled_call(engine: BuiltinBackend, prompts, params, lengths, trace_path: str | None) -> tuple[list, int]:
    """The windows' GPU activities (the first window left out) and their decode steps, from a profiled call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof, marked_windows(engine) as windows:
        engine.generate(prompts, params, lengths)
        sync()
    path = trace_path or "/tmp/decode_step_trace.json"
    prof.export_chrome_trace(path)
    with open(path) as file:
        events = json.load(file)["traceEvents"]
    if trace_path:
        with open(path, "rb") as source, gzip.open(path + ".gz", "wb") as target:
            shutil.copyfileobj(source, target)
    os.remove(path)
    activities = [e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e]
    return window_activities(activities)[1:], sum(window[0] for window in windows[1:])


def run_case(name: str, engine: BuiltinBackend, prompts, params, floor_ms: float, args, lengths=None) -> dict:
    start = time.perf_counter()
    engine.generate(prompts, params, lengths)  # compiles, builds kernels, warms the step signature up
    sync()
    warm_s = time.perf_counter() - start
    ms_per_step, window_steps = timed_call(engine, prompts, params, lengths)
    trace_path = os.path.join(args.out, f"trace_{name}.json") if args.out else None
    windows, steps = profiled_call(engine, prompts, params, lengths, trace_path)
    result = dict(case=name, warm_call_s=warm_s, ms_per_step=ms_per_step, floor_ms=floor_ms,
                  window_steps=window_steps, attention=engine.last_stats.get("attention"),
                  sampler=engine.last_stats.get("sampler"), **step_figures(windows, steps),
                  kernels=kernel_rows(windows, steps))
    print_case(result, args.top)
    return result


def print_case(result: dict, top: int) -> None:
    print(f"\n== {result['case']}: {result['ms_per_step']:.3f} ms per step unprofiled (floor {result['floor_ms']:.3f});"
          f" profiled busy {result['busy_us_per_step']:.1f} us + idle {result['idle_us_per_step']:.1f} us per step,"
          f" {result['activities_per_step']:.0f} activities per step; attention {result['attention']}, sampler"
          f" {result['sampler']}; warm-up call {result['warm_call_s']:.1f} s; windows {result['window_steps']}",
          flush=True)
    print(f"  {'us/step':>8} {'calls':>6} {'us/call':>8}  {'grid':<16} kernel")
    for row in result["kernels"][:top]:
        print(f"  {row['us_per_step']:8.1f} {row['calls_per_step']:6.1f} {row['us_per_call']:8.2f}  {row['grid']:<16} "
              f"{row['name']}", flush=True)


@contextlib.contextmanager
def small_batch_pieces(engine: BuiltinBackend, enabled: bool):
    """The calls inside with the narrow-batch decode pieces on or off. Warmed signatures are forgotten on both sides:
    they do not tell the two apart, and a step captured without its warm-up would compile inside the capture."""
    before = small_batch.ENABLED
    small_batch.ENABLED = enabled
    engine.runner.graphs.warmed.clear()
    try:
        yield
    finally:
        small_batch.ENABLED = before
        engine.runner.graphs.warmed.clear()


def long_tail_cases(args) -> list[dict]:
    model = build_model("cuda", QWEN25_15B)
    weight_bytes, kv_per_token = read_bytes(model)
    generator = torch.Generator().manual_seed(0)
    results = []
    for layout in filter(None, args.layouts.split(",")):
        engine = BuiltinBackend(model, kv_cache=layout)
        for batch in (int(value) for value in args.batches.split(",")):
            n = min(batch, 8)
            prompts = torch.randint(1, model.config.vocab_size, (batch // n, args.context), generator=generator)
            params = SamplingParams(max_new_tokens=args.capacity, n=n, temperature=1.0, ignore_eos=True, seed=0)
            lengths = [1 + 16 * args.windows] * batch
            context = args.context + 8 * args.windows  # the mean context of the timed windows, roughly
            floor_ms = 1e3 * (weight_bytes + batch * context * kv_per_token) / BANDWIDTH
            for small in (False, True) if args.compare and batch <= MAX_ROWS else (small_batch.ENABLED,):
                with small_batch_pieces(engine, small):
                    name = f"1.5b-{layout}-b{batch}" + ("-small" if small else "")
                    results.append(run_case(name, engine, prompts.tolist(), params, floor_ms, args, lengths))
        del engine
    return results


def tta_case(args) -> dict:
    model, prompts, params = tta_rollout()
    params = SamplingParams(max_new_tokens=1 + 16 * args.windows, temperature=params.temperature, n=params.n, seed=0,
                            ignore_eos=True)
    engine = BuiltinBackend(model, **TTA_OPTIONS)
    weight_bytes, kv_per_token = read_bytes(model)
    floor_ms = 1e3 * (weight_bytes + 256 * 40 * kv_per_token) / BANDWIDTH
    return run_case("tta-0.5b-256", engine, prompts, params, floor_ms, args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    results = long_tail_cases(args)
    torch.cuda.empty_cache()
    if not args.no_tta:
        results.append(tta_case(args))
    if args.out:
        with open(os.path.join(args.out, "decode_step.json"), "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
