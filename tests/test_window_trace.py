"""benchmarks/profiling/window_trace.py: the per-window arithmetic by hand, on host-clock events."""

from __future__ import annotations

from benchmarks.profiling.window_trace import HostEvent, WindowTrace, summary


def window(trace: WindowTrace, batch: int, steps: int, live: int, context: int, start: float, end: float,
           host: dict) -> None:
    trace.live, trace.pending = (live, context), dict(host)
    record = trace.open_window(batch, steps)
    record["start"], record["end"] = HostEvent(), HostEvent()
    record["start"].at, record["end"].at = start, end


def test_windows_are_grouped_by_bucket_with_their_floor_and_the_gaps_between_them():
    """Weights 100 bytes, 10 bytes per token of context, 1,000 bytes/s. Window 1 (bucket 4): 2 steps, 3 live with 30
    tokens in all: it reads 2 * 100 + 10 * (30 * 2 + 3 * 2 * 1 / 2) = 830 bytes, 830 ms; its GPU time 1.0 s, then
    0.5 s idle before window 2. Window 2 (bucket 4): 1 step, 2 live, 20 tokens: 100 + 200 = 300 ms; GPU 0.25 s, then
    0.25 s idle. Window 3 (bucket 2): 2 steps, 1 live, 50 tokens: 200 + 10 * (100 + 1) = 1,210 ms; GPU 0.5 s; no gap
    after the last one."""
    trace = WindowTrace(100, 10, 1000)
    window(trace, 4, 2, 3, 30, 0.0, 1.0, {"reserve": 2.0})
    window(trace, 4, 1, 2, 20, 1.5, 1.75, {"reserve": 4.0, "read_progress": 6.0})
    window(trace, 2, 2, 1, 50, 2.0, 2.5, {})
    result = summary(trace, *trace.bytes)
    four, two = result["buckets"]
    assert (four["batch"], four["windows"], four["steps"], two["batch"], two["steps"]) == (4, 2, 3, 2, 2)
    assert abs(four["floor_s"] - 1.13) < 1e-9 and abs(two["floor_s"] - 1.21) < 1e-9
    assert abs(four["gpu_ms_per_step"] - 1250 / 3) < 1e-6 and abs(two["gpu_ms_per_step"] - 250) < 1e-6
    assert abs(four["gap_s"] - 0.75) < 1e-9 and two["gap_s"] == 0
    assert four["host_ms_per_window"] == {"reserve": 3.0, "read_progress": 3.0} and four["mean_live"] == 2.5
    assert result["totals"]["steps"] == 5 and abs(result["totals"]["gpu_s"] - 1.75) < 1e-9


def test_the_calls_edges_are_its_head_and_tail_around_the_windows():
    """The call starts at 0.0, its prefill runs on the GPU 0.1-0.4, the first window starts at 0.5 and the last ends at
    2.5, the call at 2.6: a head of 500 ms (100 before the prefill, 300 of prefill) and a tail of 100 ms."""
    trace = WindowTrace(100, 10, 1000)
    trace.call = (HostEvent(), HostEvent())
    trace.call[0].at, trace.call[1].at, trace.ended = 0.0, 2.6, True
    trace.prefills = [(HostEvent(), HostEvent())]
    trace.prefills[0][0].at, trace.prefills[0][1].at = 0.1, 0.4
    window(trace, 4, 2, 3, 30, 0.5, 1.0, {})
    window(trace, 2, 2, 1, 50, 2.0, 2.5, {})
    edges = summary(trace, *trace.bytes)["edges"]
    expected = dict(head_ms=500, before_first_prefill_ms=100, first_prefill_gpu_ms=300, tail_ms=100, prefill_gpu_ms=300)
    assert all(abs(edges[key] - value) < 1e-6 for key, value in expected.items()), edges
