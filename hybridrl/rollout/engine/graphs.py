"""CUDA graphs of the built-in engine's decode step (and of small observation prefills, `resume.py`), and the
bookkeeping that decides when a step must be warmed up.

A decode step is captured once per (batch bucket, key-length bucket) and replayed after that; a small multi-turn resume
wave once per (rows, ids, key length) bucket, its inputs copied into a static buffer kept here (`inputs`). Capturing
records kernels without running them, so anything that is not ready by then fails inside the capture: a `torch.compile`d
piece that has not compiled for these shapes and settings, a Triton kernel not yet built, cuBLAS choosing a new
algorithm. So the first step of every new *signature* runs for real on a side stream first (the warm-up the CUDA graph
docs ask for), and only then is captured. A signature is everything a compiled or Triton piece specialises on: the
step's sizes, the shapes, strides and dtypes of every tensor it reads, and the sampler (its settings and whether the
Triton sampling kernels run). Two calls with the same tensor shapes but a different sampler (a greedy call after a
sampled one) are different signatures: without that, the new sampler compiled inside the capture.

Graphs point at the tensors of one `generate` call (its KV cache, its per-slot state), so they are dropped when
those are freed, or kept with them for the next call of the same shape (`take`, `restore`; `kept_runs.py`); the set
of warmed signatures lives as long as the engine, so a later call of the same shapes and sampler captures without a
warm-up, and the host can record the graph while the GPU still runs the prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from hybridrl.rollout.engine.graph_rng import begin_capture


def tensor_layouts(values) -> tuple:
    """(shape, stride, dtype) of every tensor in `values` and every number or string (a compiled function
    specialises on those too), looking into tuples, lists and objects' attributes."""
    if isinstance(values, (int, float, str)) or values is None:
        return (values,)
    if isinstance(values, torch.Tensor):
        return ((tuple(values.shape), values.stride(), values.dtype),)
    if isinstance(values, (tuple, list)):
        return tuple(layout for value in values for layout in tensor_layouts(value))
    if hasattr(values, "__dict__") and not callable(values):
        return tensor_layouts(list(vars(values).values()))
    return ()


def step_signature(batch: int, kv_len: int, sampler: Hashable, tensors) -> tuple:
    """What a decode step's compiled pieces and kernels were specialised for: its sizes, the sampler (settings and
    implementation) and the layouts of every tensor it reads."""
    return (batch, kv_len, sampler) + tensor_layouts(tensors)


@dataclass
class CapturedGraphs:
    """One call's graphs, their static inputs and memory pool, set aside to be replayed by a later call (`take`)."""

    graphs: dict
    inputs: dict
    pool: object


@dataclass
class CaptureCounts:
    """What the graphs did during one `generate` call (reported in `last_stats`)."""

    captured: int = 0
    captures_without_warmup: int = 0
    warmup_s: float = 0.0


class DecodeGraphs:
    """The captured steps of the current call, keyed by (batch, kv_len) for decode and ("extend", rows, ids, kv_end)
    for observation prefills, the static inputs of the latter (`inputs`), and the signatures warmed so far."""

    def __init__(self) -> None:
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.inputs: dict[Hashable, object] = {}
        self.tried_ahead: set[Hashable] = set()
        self.pool = None
        self.warmed: set[tuple] = set()
        # One warm-up and one capture stream for the engine's life: cuBLAS keeps a workspace per stream it has run
        # on, so a new stream per rollout would hold a new workspace after every step.
        self._warmup_stream = self._capture_stream = None
        self._generator = None
        """The generator each graph registers instead of the device's default one (`graph_rng.py`)."""

    def drop(self) -> None:
        """Forget the captured graphs and their static inputs (their tensors are freed or replaced); warmed signatures
        stay."""
        self.graphs, self.inputs, self.tried_ahead, self.pool = {}, {}, set(), None

    def take(self) -> CapturedGraphs:
        """This call's graphs, set aside (for a later call on the same tensors); this object starts empty again."""
        captured = CapturedGraphs(self.graphs, self.inputs, self.pool)
        self.drop()
        return captured

    def restore(self, captured: CapturedGraphs) -> None:
        """Replay `captured` (graphs recorded on the tensors this call reuses) instead of capturing them again."""
        self.drop()
        self.graphs, self.inputs, self.pool = captured.graphs, captured.inputs, captured.pool

    def step(self, key: Hashable, signature: Callable[[], tuple], run_step: Callable[[], None],
             counts: CaptureCounts, before_replay: Callable[[], None] = lambda: None) -> None:
        """Run one decode step of shape `key`: replay its graph, or warm up (if `signature()` is new) and capture
        it. A step that warmed up has run for real, so its graph is not replayed this time. `signature` is called
        only when there is no graph yet: it walks every tensor the step reads, far too slow for every step."""
        graph = self.graphs.get(key)
        if graph is None:
            start = time.perf_counter()
            signature = signature()
            warmed = signature in self.warmed
            if not warmed:
                self.warm_up(run_step)
                self.warmed.add(signature)
            counts.captures_without_warmup += warmed
            graph = self.capture(key, run_step, synchronize=not warmed)
            counts.captured += 1
            counts.warmup_s += time.perf_counter() - start
            if not warmed:
                return
        before_replay()
        graph.replay()

    def capture_ahead(self, key: Hashable, signature: Callable[[], tuple], run_step: Callable[[], None],
                      counts: CaptureCounts) -> bool:
        """Capture a step before it is due, while the GPU still runs earlier work (recording launches nothing), so
        that when it is due it replays at once instead of leaving the GPU idle for its recording. Only a signature
        warmed before can be (a warm-up runs the step for real, which a step not due yet must not); each key is tried
        once per call. True when it captured."""
        if key in self.graphs or key in self.tried_ahead:
            return False
        self.tried_ahead.add(key)
        start = time.perf_counter()
        if signature() not in self.warmed:
            return False
        self.capture(key, run_step, synchronize=False)
        counts.captured += 1
        counts.captures_without_warmup += 1
        counts.warmup_s += time.perf_counter() - start
        return True

    def warm_up(self, run_step: Callable[[], None]) -> None:
        """Run the step for real on the side stream (compiling whatever it needs) before it is captured."""
        torch.cuda.synchronize()
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream()
        side = self._warmup_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_step()
        torch.cuda.current_stream().wait_stream(side)

    def capture(self, key: Hashable, run_step: Callable[[], None], synchronize: bool):
        """Record one decode step into a new graph on the engine's capture stream. Not `torch.cuda.graph`: it
        synchronizes, runs gc.collect and empties the allocator's cache on entry, which leaves an idle GPU every
        rollout. A signature warmed before (an earlier rollout) is captured without synchronizing: recording
        launches nothing, so the host records while the GPU still runs the prefill, and the replay follows it in
        stream order."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
            self._generator = torch.Generator(device=torch.device("cuda", torch.cuda.current_device()))
        if synchronize:
            torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._capture_stream):
            begin_capture(graph, self.pool, self._generator)  # thread-local, the default generator left to others
            try:
                run_step()
            finally:
                graph.capture_end()
        self.pool = graph.pool()
        self.graphs[key] = graph
        return graph
