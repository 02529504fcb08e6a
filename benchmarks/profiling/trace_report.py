"""Read a saved step trace without a GPU: `grpo_step.py --profile` with $OUT set brings back each mode's
profiled step as `trace_<mode>.json.gz`. Prints, per phase of the step (the trainer's `phase:*` ranges),
its span, the time some GPU activity ran and the top kernels; the idle gaps longer than `--gap-ms`; and every
host call that waited for the GPU longer than `--wait-ms` (stream or device synchronize, blocking copies), with
the operators around it (a hidden synchronization, such as `tensor[index] = 1` with a host index, shows here).
Times are in ms from the first GPU activity. Where the trace holds operator shapes (`grpo_step.py --profile`
records them), each phase also gets its matrix
products by shape with their achieved TFLOP/s: which ones keep the update's MFU down. `--host FROM-TO` (ms) lists
what the host's main thread did in that window: its outermost operations, longer than `--host-ms`, and the
stretches in which it ran no traced operation at all (Python: tokenizing, building lists, pickling), with the
share of the window the GPU was busy: whether a stretch is host-bound.

    python -m benchmarks.profiling.trace_report TRACE.json.gz [--phases rollout,update] [--gap-ms 0.3] [--wait-ms 1]
    python -m benchmarks.profiling.trace_report TRACE.json.gz --host 540-640 [--host-ms 1]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cudaMemcpyAsync")
MATMULS = {"aten::mm": 0, "aten::addmm": 1, "aten::bmm": 0, "aten::baddbmm": 1}
"""Matrix-product operators and the position of their first matrix among the recorded input shapes."""


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as file:
        return json.load(file)["traceEvents"]


def gpu_activities(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, name) of every kernel, copy and memset, in µs, sorted by start."""
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                  if e.get("cat") in GPU_CATEGORIES and "dur" in e)


def phases(events: list[dict]) -> dict[str, tuple[float, float]]:
    """The GPU-side range of each `phase:<name>` annotation (the longest, where the profiler split one)."""
    ranges: dict[str, tuple[float, float]] = {}
    for e in events:
        if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("phase:") and "dur" in e:
            name = e["name"][len("phase:"):]
            if name not in ranges or e["dur"] > ranges[name][1] - ranges[name][0]:
                ranges[name] = (e["ts"], e["ts"] + e["dur"])
    return ranges


def idle_gaps(activities: list[tuple[float, float, str]], begin: float, end: float,
              min_us: float) -> list[tuple[float, float, str]]:
    """(gap start, length, the activity after it) for gaps of at least `min_us` within [begin, end)."""
    gaps, reach = [], None
    for start, stop, name in activities:
        if not begin <= start < end:
            continue
        if reach is not None and start - reach >= min_us:
            gaps.append((reach, start - reach, name))
        reach = stop if reach is None else max(reach, stop)
    return gaps


def host_waits(events: list[dict], min_us: float) -> list[tuple[float, float, str, list[str]]]:
    """(start, duration, runtime call, enclosing operators innermost first) of host calls that blocked."""
    operators = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    waits = []
    for e in events:
        if e.get("cat") != "cuda_runtime" or e.get("name") not in WAITING_CALLS or e.get("dur", 0) < min_us:
            continue
        around = sorted((o for o in operators if o.get("tid") == e.get("tid")
                         and o["ts"] <= e["ts"] and o["ts"] + o["dur"] >= e["ts"] + e["dur"]),
                        key=lambda o: o["dur"])
        waits.append((e["ts"], e["dur"], e["name"], [o["name"] for o in around]))
    return sorted(waits)


HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime")


def host_timeline(events: list[dict], begin: float, end: float, min_us: float) -> list[tuple[float, float, str]]:
    """(start, duration, name) of the main thread's outermost operations in [begin, end) lasting at least `min_us`,
    and, named "(no traced operation)", the stretches of at least `min_us` between them. The main thread is the
    one with the most operations."""
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES and "dur" in e
            and not e.get("name", "").startswith(("phase:", "ProfilerStep"))]  # ranges, not work: look inside
    if not host:
        return []
    main_thread = collections.Counter(e.get("tid") for e in host).most_common(1)[0][0]
    rows, reach = [], None
    for e in sorted((e for e in host if e.get("tid") == main_thread and begin <= e["ts"] < end),
                    key=lambda e: (e["ts"], -e["dur"])):
        if reach is not None and e["ts"] < reach:
            continue  # inside an operation already listed
        if reach is not None and e["ts"] - reach >= min_us:
            rows.append((reach, e["ts"] - reach, "(no traced operation)"))
        if e["dur"] >= min_us:
            rows.append((e["ts"], e["dur"], e["name"]))
        reach = e["ts"] + e["dur"]
    return rows


def busy_fraction(activities: list[tuple[float, float, str]], begin: float, end: float) -> float:
    """Share of [begin, end) in which some GPU activity ran (overlapping ones counted once)."""
    busy, reach = 0.0, begin
    for start, stop, _ in activities:
        start, stop = max(start, reach), min(stop, end)
        if stop > start:
            busy += stop - start
            reach = stop
    return busy / max(end - begin, 1e-9)


def matmul_flops(name: str, dims: list) -> float | None:
    """2 * M * K * N (times the batch for bmm) from an operator's recorded input shapes, None if they are missing."""
    first = MATMULS[name]
    if len(dims) < first + 2 or not dims[first] or not dims[first + 1]:
        return None
    a, b = dims[first], dims[first + 1]
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def matmul_table(events: list[dict], begin: float, end: float) -> list[tuple[str, tuple, int, float, float]]:
    """(operator, input shapes, calls, kernel µs, FLOPs) per distinct matrix product whose kernels ran in
    [begin, end): kernels are matched to the operator that launched them by the profiler's External id."""
    launched_by = {e["args"]["External id"]: e for e in events if e.get("cat") == "cpu_op"
                   and e.get("name") in MATMULS and "External id" in e.get("args", {})}
    rows: dict[tuple, list] = {}
    seen = set()
    for e in events:
        op = launched_by.get(e.get("args", {}).get("External id")) if e.get("cat") == "kernel" else None
        if op is None or not begin <= e["ts"] < end:
            continue
        dims = op["args"].get("Input Dims", [])
        flops = matmul_flops(op["name"], dims)
        if flops is None:
            continue
        key = (op["name"], tuple(tuple(d) for d in dims[MATMULS[op["name"]]:MATMULS[op["name"]] + 2]))
        row = rows.setdefault(key, [0, 0.0, 0.0])
        row[1] += e["dur"]
        if id(op) not in seen:  # an operator may launch several kernels (split-K): count its work once
            seen.add(id(op))
            row[0] += 1
            row[2] += flops
    return sorted(((name, shapes, calls, us, flops) for (name, shapes), (calls, us, flops) in rows.items()),
                  key=lambda row: -row[3])


def report_host(events: list[dict], window: str, min_ms: float) -> None:
    activities = gpu_activities(events)
    if not activities:
        print("no GPU activity in this trace")
        return
    origin = activities[0][0]
    first, last = (origin + float(value) * 1e3 for value in window.split("-"))
    print(f"== host, {window} ms: GPU busy {100 * busy_fraction(activities, first, last):.0f}% of the window; the main "
          f"thread's outermost operations and untraced stretches of {min_ms} ms or more:")
    for start, length, name in host_timeline(events, first, last, min_ms * 1e3):
        print(f"  {(start - origin) / 1e3:8.2f} ms  {length / 1e3:7.2f} ms  {name[:90]}")


def report(events: list[dict], wanted: list[str] | None, gap_ms: float, wait_ms: float, top: int = 12) -> None:
    activities = gpu_activities(events)
    if not activities:
        print("no GPU activity in this trace")
        return
    origin = activities[0][0]
    ranges = phases(events) or {"whole trace": (origin, max(stop for _, stop, _ in activities))}
    for name, (begin, end) in sorted(ranges.items(), key=lambda item: item[1][0]):
        if wanted and name not in wanted:
            continue
        inside = [a for a in activities if begin <= a[0] < end]
        totals, counts = collections.Counter(), collections.Counter()
        for start, stop, kernel in inside:
            totals[kernel[:70]] += stop - start
            counts[kernel[:70]] += 1
        print(f"== {name}: {(begin - origin) / 1e3:.1f}-{(end - origin) / 1e3:.1f} ms, span {(end - begin) / 1e3:.1f} ms, "
              f"GPU activity {sum(totals.values()) / 1e3:.1f} ms in {len(inside)} kernels and copies")
        for kernel, total in totals.most_common(top):
            print(f"  {total / 1e3:8.2f} ms {counts[kernel]:6d} x {total / counts[kernel]:8.1f} us  {kernel}")
        for start, length, after in idle_gaps(activities, begin, end, gap_ms * 1e3):
            print(f"  idle {length / 1e3:6.2f} ms from {(start - origin) / 1e3:8.2f} ms, then {after[:60]}")
        products = matmul_table(events, begin, end)
        if products:
            total_us, total_flops = sum(p[3] for p in products), sum(p[4] for p in products)
            print(f"  matrix products: {total_us / 1e3:.1f} ms of kernels, {total_flops / total_us / 1e6:.0f} TFLOP/s "
                  f"on average; by shape (calls, ms, TFLOP/s):")
            for name, shapes, calls, us, flops in products[:top]:
                shape_text = " x ".join("(" + ", ".join(map(str, d)) + ")" for d in shapes)
                print(f"    {name:<12} {shape_text:<32} {calls:5d} {us / 1e3:8.2f} {flops / us / 1e6:6.0f}")
    print(f"host calls that waited {wait_ms} ms or more (operators around them, innermost first):")
    for start, length, call, around in host_waits(events, wait_ms * 1e3):
        print(f"  {(start - origin) / 1e3:8.2f} ms  {length / 1e3:7.2f} ms  {call}  in  {' < '.join(around[:4]) or '-'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--phases", default="", help="comma-separated phase names (default: all)")
    parser.add_argument("--gap-ms", type=float, default=0.3, help="list idle gaps at least this long")
    parser.add_argument("--wait-ms", type=float, default=1.0, help="list host waits at least this long")
    parser.add_argument("--host", default="", metavar="FROM-TO",
                        help="instead of the phase report: the host's main thread in this window (ms, as printed)")
    parser.add_argument("--host-ms", type=float, default=1.0, help="with --host: list what lasted at least this long")
    args = parser.parse_args(argv)
    if args.host and not (args.host.count("-") == 1 and all(v.replace(".", "", 1).isdigit() for v in args.host.split("-"))):
        parser.error(f"--host takes a window in ms like 540-640; got {args.host!r}")
    if args.host:
        report_host(load(args.trace), args.host, args.host_ms)
    else:
        report(load(args.trace), [p for p in args.phases.split(",") if p], args.gap_ms, args.wait_ms)


if __name__ == "__main__":
    main()
