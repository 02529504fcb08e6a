"""Where a built-in engine `generate` call's time goes, decode window by decode window (a window: the decode steps
between two host syncs), without adding a synchronisation.

`traced(engine)` wraps, for the calls made inside it, the engine's host phases (the scheduler's `reserve`, `admit`,
`harvest`, `compaction_moves`; the runner's `preempt`, `write_blocks`, `prefill`, `decode`, `read_progress`,
`read_outputs`, `free`, `move`) in host timers, and brackets each `decode` with two CUDA events. Per window it keeps
the batch bucket, the steps, the live sequences and their summed context (prompt + response tokens, read from the
scheduler when the window is planned), the host milliseconds of each phase and the two events. `summary` then reads
the events (once, after the call) and groups the windows by batch bucket:
- `gpu_ms_per_step`: GPU time from the window's first to its last step (the decode graphs' replays), per step;
- `floor_ms_per_step`: what those steps must cost at the bandwidth (the weights once, each live sequence's KV);
- `gap_ms_per_window`: GPU time from the end of one window to the start of the next, i.e. the GPU idle at the sync
  (the blocking read, the host's scheduling, the next launches) plus any prefill launched in between;
- `warm_ups`: steps whose signature was new, so they ran for real before their capture (`graphs.py`): a
  compilation or a kernel build inside the call, which a warm-up call should have done;
- `host_ms_per_window`: the host phases run between the previous window's launch and this one's (so the blocking
  `read_progress` of a window counts in the next one; it is mostly the host waiting for the GPU).
Each sync's step launched ahead of the host's work (`BuiltinBackend._harvest`) is a `decode` of its own, so it shows
as a window of one step before the rest of its window. So a bucket whose gpu_ms_per_step is far above its floor loses
time in the kernels, and a large gap loses it on the
host. `edges`: the call's head (from its start to the first window: `begin`, admission, the first prefill and the
first capture) and tail (from the last window's end to the call's end: the last harvest, `end`), with the prefills'
GPU time (events around `prefill`), so the GPU busy share's first and last stretches can be read. Used by `benchmarks/long_tail.py --trace`.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from hybridrl.rollout.engine.scheduler import Scheduler

SCHEDULER_PHASES = ("reserve", "admit", "harvest", "compaction_moves", "steps_until_sync")
RUNNER_PHASES = ("preempt", "write_blocks", "prefill", "read_progress", "read_outputs", "free", "move")


class HostEvent:
    """A CUDA event's interface on the host clock: the trace on CPU (where host time is device time)."""

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, other: "HostEvent") -> float:
        return 1e3 * (other.at - self.at)

    def synchronize(self) -> None:
        pass


def event():
    return torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else HostEvent()


class WindowTrace:
    """The records of one traced call (see the module docstring)."""

    def __init__(self, weight_bytes: float, kv_bytes_per_token: float, bandwidth: float) -> None:
        self.bytes = (weight_bytes, kv_bytes_per_token, bandwidth)
        self.windows: list[dict] = []
        self.pending: dict[str, float] = defaultdict(float)
        self.live = (0, 0)
        self.call = (event(), event())
        """Recorded when the trace begins and ends (the caller has synchronized before the end): the call's edges."""
        self.prefills: list[tuple] = []
        """(start, end) events of each prefill wave."""
        self.ended = False
        """Whether both `call` events were recorded (the call's edges are reported only then)."""

    def add_host(self, phase: str, seconds: float) -> None:
        self.pending[phase] += 1e3 * seconds

    def note_scheduler(self, scheduler: Scheduler) -> None:
        self.live = (len(scheduler.live), sum(s.prompt_len + s.context + s.generated for s in scheduler.live.values()))

    def open_window(self, batch: int, steps: int) -> dict:
        window = dict(batch=batch, steps=steps, live=self.live[0], context=self.live[1], host_ms=self.pending,
                      start=event(), end=event())
        self.pending = defaultdict(float)
        self.windows.append(window)
        return window

    def summarize(self) -> dict:
        return summary(self, *self.bytes)


def timed(trace: WindowTrace, phase: str, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            trace.add_host(phase, time.perf_counter() - start)
    return wrapper


@contextlib.contextmanager
def traced(engine, weight_bytes: float, kv_bytes_per_token: float, bandwidth: float):
    """Trace the engine's calls made inside (on CPU, with host clocks for the events); yields the `WindowTrace`
    (the bytes and bandwidth: its floor)."""
    trace, runner = WindowTrace(weight_bytes, kv_bytes_per_token, bandwidth), engine.runner
    saved_scheduler = {name: getattr(Scheduler, name) for name in SCHEDULER_PHASES}
    for name, method in saved_scheduler.items():
        setattr(Scheduler, name, timed(trace, name, method))
    original_steps = Scheduler.steps_until_sync

    def steps_until_sync(self, *args, **kwargs):
        trace.note_scheduler(self)
        return original_steps(self, *args, **kwargs)

    Scheduler.steps_until_sync = steps_until_sync
    for name in RUNNER_PHASES:
        setattr(runner, name, timed(trace, name, getattr(runner, name)))
    original_decode = type(runner).decode.__get__(runner)

    def decode(batch: int, kv_len: int, steps: int) -> None:
        start = time.perf_counter()
        window = trace.open_window(batch, steps)
        counts = runner.run.counts
        warmed_before = counts.captured - counts.captures_without_warmup
        window["start"].record()
        original_decode(batch, kv_len, steps)
        window["end"].record()
        window["host_ms"]["decode_launch"] = 1e3 * (time.perf_counter() - start)
        window["warm_ups"] = counts.captured - counts.captures_without_warmup - warmed_before

    runner.decode = decode
    original_prefill = runner.prefill  # the host timer above, bracketed by GPU events too

    def prefill(*args, **kwargs) -> None:
        events = (event(), event())
        events[0].record()
        original_prefill(*args, **kwargs)
        events[1].record()
        trace.prefills.append(events)

    runner.prefill = prefill
    trace.call[0].record()
    try:
        yield trace
        trace.call[1].record()
        trace.ended = True
    finally:
        for name, method in saved_scheduler.items():
            setattr(Scheduler, name, method)
        for name in (*RUNNER_PHASES, "decode"):
            vars(runner).pop(name, None)


def summary(trace: WindowTrace, weight_bytes: float, kv_bytes_per_token: float, bandwidth: float) -> dict:
    """Per batch bucket: windows, steps, GPU and floor ms per step, GPU gap and host phases per window; and the
    call's totals (see the module docstring). Waits for the GPU."""
    windows = trace.windows
    if not windows:
        return {}
    windows[-1]["end"].synchronize()
    buckets: dict[int, dict] = {}
    for index, window in enumerate(windows):
        gpu_ms = window["start"].elapsed_time(window["end"])
        gap_ms = windows[index + 1]["start"].elapsed_time(window["end"]) * -1 if index + 1 < len(windows) else 0.0
        # the floor of the window's steps: the context grows by one per live sequence per step
        context = window["context"] * window["steps"] + window["live"] * window["steps"] * (window["steps"] - 1) / 2
        floor_ms = 1e3 * (weight_bytes * window["steps"] + kv_bytes_per_token * context) / bandwidth
        bucket = buckets.setdefault(window["batch"], dict(windows=0, steps=0, gpu_ms=0.0, floor_ms=0.0, gap_ms=0.0,
                                                          live=0, warm_ups=0, host_ms=defaultdict(float)))
        bucket["windows"] += 1
        bucket["warm_ups"] += window.get("warm_ups", 0)
        bucket["steps"] += window["steps"]
        bucket["gpu_ms"] += gpu_ms
        bucket["floor_ms"] += floor_ms
        bucket["gap_ms"] += gap_ms
        bucket["live"] += window["live"]
        for phase, ms in window["host_ms"].items():
            bucket["host_ms"][phase] += ms
    rows = []
    for batch, bucket in sorted(buckets.items(), reverse=True):
        count = bucket["windows"]
        rows.append(dict(batch=batch, windows=count, steps=bucket["steps"], mean_live=bucket["live"] / count,
                         gpu_s=bucket["gpu_ms"] / 1e3, floor_s=bucket["floor_ms"] / 1e3, gap_s=bucket["gap_ms"] / 1e3,
                         gpu_ms_per_step=bucket["gpu_ms"] / bucket["steps"],
                         floor_ms_per_step=bucket["floor_ms"] / bucket["steps"],
                         gap_ms_per_window=bucket["gap_ms"] / count, warm_ups=bucket["warm_ups"],
                         host_ms_per_window={phase: ms / count for phase, ms in sorted(bucket["host_ms"].items())}))
    totals = {key: sum(row[key] for row in rows)
              for key in ("windows", "steps", "gpu_s", "floor_s", "gap_s", "warm_ups")}
    if not trace.ended:
        return dict(buckets=rows, totals=totals)
    first_prefill = trace.prefills[0] if trace.prefills else (windows[0]["start"], windows[0]["start"])
    edges = dict(head_ms=trace.call[0].elapsed_time(windows[0]["start"]),
                 first_prefill_gpu_ms=first_prefill[0].elapsed_time(first_prefill[1]),
                 before_first_prefill_ms=trace.call[0].elapsed_time(first_prefill[0]),
                 tail_ms=windows[-1]["end"].elapsed_time(trace.call[1]),
                 prefill_gpu_ms=sum(start.elapsed_time(end) for start, end in trace.prefills))
    return dict(buckets=rows, totals=totals, edges=edges)


def print_summary(layout: str, result: dict) -> None:
    """One line per batch bucket, then the host phases per window of the busiest buckets."""
    if not result:
        return
    totals = result["totals"]
    print(f"\n{layout}: {totals['windows']} windows, {totals['steps']} steps; decode GPU {totals['gpu_s']:.2f} s "
          f"(floor {totals['floor_s']:.2f} s), GPU gaps between windows {totals['gap_s']:.2f} s, "
          f"{totals['warm_ups']} steps warmed up (compiled or built) inside the call")
    if "edges" in result:
        edges = result["edges"]
        print(f"call's edges: {edges['head_ms']:.1f} ms from the call's start to the first window (before the first "
              f"prefill {edges['before_first_prefill_ms']:.1f}, its GPU {edges['first_prefill_gpu_ms']:.1f}); "
              f"{edges['tail_ms']:.1f} ms from the last window's end to the call's end; prefills' GPU in all "
              f"{edges['prefill_gpu_ms']:.1f} ms")
    print(f"{'batch':>6} {'windows':>8} {'steps':>6} {'live':>6} {'GPU s':>7} {'floor s':>8} {'ms/step':>8} "
          f"{'floor ms':>9} {'gap s':>6} {'gap ms/win':>11} {'warm-ups':>9}  host ms per window (phase: ms)")
    for row in result["buckets"]:
        host = " ".join(f"{phase}:{ms:.2f}" for phase, ms in row["host_ms_per_window"].items() if ms >= 0.05)
        print(f"{row['batch']:>6} {row['windows']:>8} {row['steps']:>6} {row['mean_live']:>6.0f} {row['gpu_s']:>7.2f} "
              f"{row['floor_s']:>8.2f} {row['gpu_ms_per_step']:>8.3f} {row['floor_ms_per_step']:>9.3f} "
              f"{row['gap_s']:>6.2f} {row['gap_ms_per_window']:>11.2f} {row['warm_ups']:>9}  {host}")
