"""The prompt prefill of a kept run (`kept_runs.py`) as a CUDA graph, one per (prompts, padded length, index counts).

A short rollout's prefill is small (the time-to-accuracy run's: 32 prompts of ~6 tokens) and launched layer by layer
from the host: tens of milliseconds of launches for a millisecond of GPU work, every rollout. A run that is kept for
the next call of its shape replays the same prefill shapes call after call, so its small prefills are captured once
and replayed after that: the host copies the chunk's ids and index lists into the graph's static buffer (one copy)
and replays. The graph covers the prefill, the first token's draw (from the run's uniforms, drawn into a kept tensor)
and the per-slot state it writes, so it has no output of its own. Calls that are not kept would capture as often as
they run, so they launch the prefill as before.

The graph reads the run's weights, KV cache and RoPE table: kept with them, and dropped with them when the weights'
addresses change (`kept_runs.weight_addresses`).
"""

from __future__ import annotations

import torch

from hybridrl.rollout.engine.graphs import DecodeGraphs

PREFILL_GRAPH_MAX_TOKENS = 4096
"""Prefills of at most this many padded tokens are captured: larger ones keep the GPU busy while the host launches."""


def graphs_prefill(use_graphs: bool, kept: bool, num_prompts: int, length: int) -> bool:
    """Whether a prefill chunk of `num_prompts` x `length` padded tokens runs as a CUDA graph: only in a run that
    uses graphs and is to be kept, and only while it is small."""
    return use_graphs and kept and num_prompts * length <= PREFILL_GRAPH_MAX_TOKENS


def static_inputs(graphs: DecodeGraphs, key: tuple, host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The static input buffer of the graph `key`, made on first use, with `host` (a 1-D CPU tensor: the ids and
    index lists) copied into it in one non-blocking copy from pinned memory."""
    static = graphs.inputs.get(key)
    if static is None:
        static = graphs.inputs[key] = torch.empty(host.shape, dtype=host.dtype, device=device)
    static.copy_(host.pin_memory() if device.type == "cuda" else host, non_blocking=True)
    return static
