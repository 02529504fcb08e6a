"""What the built-in engine keeps between `generate` calls of one shape: the KV cache, the per-slot state, the RoPE
table and the CUDA graphs captured on them, so that a trainer's short rollouts do not rebuild them every step.

A trainer calls `generate` every step with the same batch shape and sampling settings. With short responses the
call's fixed cost (allocating and zeroing the cache and state, recording the decode graph: tens of milliseconds of
host time while the GPU idles) is most of the rollout. So a finished call's run is kept under a key that names
everything its tensors and graphs were made for (`run_key`); the next call of that key takes it back, resets the
state in place and replays the graphs. The KV cache is reused as it is: a slot's stale keys lie past its length,
where attention gives them a weight of zero (they are finite: a forward wrote them), as when a slot is reused within
one call.

A CUDA graph replays the addresses it recorded. Weights updated in place (the optimizer's step; the stacked q/k/v and
gate/up copies, which `resolve_weights(into=...)` rewrites in place) keep their addresses, so a kept graph reads
today's values; a tensor the trainer replaced (a module swapped, an adapter switched, FSDP's gathered copies) has a
new address, and then the kept graphs are dropped and captured again (`weight_addresses`). Sampler settings and stop
ids are constants inside the graphs: they are part of the key.

Only small runs are kept: their KV cache and state, with the stacked weight copies they share, at most
`KEEP_MAX_SHARE` of the device's memory (the graphs' own memory pools not counted), and none while the device is
short of memory (`ModelRunner.release`): a large rollout's cache belongs to the update once the rollout is over.
The paged layout is never kept (its block bookkeeping is made per call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch

from hybridrl.rollout.engine.decode_state import DecodeState
from hybridrl.rollout.engine.graphs import CapturedGraphs
from hybridrl.rollout.engine.weights import ModelWeights

KEEP_MAX_SHARE = 0.01
"""Kept runs (KV caches and state) and the stacked weight copies they read take at most this share of the device's
memory (on CPU, of `CPU_REFERENCE_BYTES`)."""
CPU_REFERENCE_BYTES = 4 * 1024**3
MAX_KEPT_RUNS = 2
"""Runs kept at once: a trainer's training rollouts and its evaluation rollouts, whose shapes and settings differ."""


def run_key(attention: str, cache_lengths: tuple[int, ...], num_prompts: int, num_sequences: int, max_new_tokens: int,
            stop_ids: list[int], settings: Hashable, dtype: torch.dtype, device: torch.device) -> tuple:
    """What a run's tensors and graphs are made for: the attention path, the cache's lengths, the prompt and sequence
    counts (slots, prompt entries), the response length and stop ids (the state's, constants in the graphs), the
    sampler's settings (constants in the graphs) and the dtype and device."""
    return (attention, cache_lengths, num_prompts, num_sequences, max_new_tokens, tuple(stop_ids), settings, dtype,
            str(device))


def weight_addresses(weights: ModelWeights) -> tuple:
    """Address, shape, stride and dtype of every tensor the forward reads, and the numbers it bakes in (LoRA
    scalings): two calls with equal results let a graph captured in the first replay in the second."""
    def describe(value):
        if isinstance(value, torch.Tensor):
            return value.data_ptr(), value.shape, value.stride(), value.dtype
        return tuple(map(describe, value)) if isinstance(value, tuple) else value

    return tuple(describe(value) for layer in weights.layers for value in vars(layer).values()) + tuple(
        describe(value) for value in (weights.embed, weights.lm_head, weights.final_norm))


def tensor_bytes(values) -> int:
    """Bytes of the tensors among an object's attributes (a cache, a state)."""
    return sum(value.numel() * value.element_size() for value in vars(values).values()
               if isinstance(value, torch.Tensor))


def stacked_bytes(weights: ModelWeights) -> int:
    """Bytes of the stacked q/k/v and gate/up copies (the weights' only tensors the engine made itself, besides
    dequantized 4-bit layers, which are never kept)."""
    return sum(tensor.numel() * tensor.element_size() for layer in weights.layers
               for tensor in (layer.qkv_weight, layer.qkv_bias, layer.gate_up_weight) if tensor is not None)


@dataclass
class KeptRun:
    """One finished call's tensors and graphs, and the weight addresses its graphs read."""

    key: tuple
    num_slots: int
    cache: object
    state: DecodeState
    uniforms: torch.Tensor
    """Each sequence's uniforms, drawn anew into this tensor every call (the prefill graph reads it)."""
    cos: torch.Tensor
    sin: torch.Tensor
    graphs: CapturedGraphs
    addresses: tuple


class KeptRuns:
    """The runs kept, newest last, at most `MAX_KEPT_RUNS`, and the weights whose stacked copies they read."""

    def __init__(self) -> None:
        self.runs: dict[tuple, KeptRun] = {}
        self.weights: ModelWeights | None = None
        """The weights of the last kept call: the next call rewrites its stacked copies in place."""

    def take(self, key: tuple) -> KeptRun | None:
        return self.runs.pop(key, None)

    def fits(self, cache, state: DecodeState, weights: ModelWeights, device: torch.device) -> bool:
        """Whether keeping this run (besides the others) stays within `KEEP_MAX_SHARE` of the device's memory."""
        total = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                 else CPU_REFERENCE_BYTES)
        kept = sum(tensor_bytes(run.cache) + tensor_bytes(run.state) for run in self.runs.values())
        return kept + tensor_bytes(cache) + tensor_bytes(state) + stacked_bytes(weights) <= KEEP_MAX_SHARE * total

    def put(self, run: KeptRun, weights: ModelWeights) -> None:
        self.runs[run.key] = run
        while len(self.runs) > MAX_KEPT_RUNS:
            self.runs.pop(next(iter(self.runs)))
        self.weights = weights

    def clear(self) -> None:
        self.runs, self.weights = {}, None
