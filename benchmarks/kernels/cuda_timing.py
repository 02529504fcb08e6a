"""Timing GPU work as the engine runs it: captured in one CUDA graph and replayed, so the host's launch overhead
is not what is measured (`decode_attention.py`, `attention_configs.py`, `sampling_kernels.py`)."""

from __future__ import annotations

import torch


def graph_time_us(fn, calls: int = 20, replays: int = 20, per_call: int = 1) -> float:
    """Microseconds per unit of work: `fn` is warmed up on a side stream, captured `calls` times in one CUDA
    graph and the graph replayed `replays` times; `per_call` units of work (e.g. layers) per `fn()`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays * per_call)
