"""KV cache layouts of the built-in engine: the tensors, what prefill writes, one decode step, slot moves.

- `SlotKVCache` (attention="sdpa"): one tensor `(layers, 2, slots, Hkv, max_len, D)`; every slot holds
  its whole context, so prefill copies a prompt's KV into the slots of all its samples and decode
  attention is SDPA over keys [0, kv_len) with a per-slot mask (`kv_len` is a bucket chosen by the
  engine, so the CUDA graphs are keyed by it).
- `PrefixSharedKVCache` (attention="triton"): a prompt cache `(layers, 2, entries, Hkv, prompt_max_len, D)`
  holds each live prompt's KV once, a response cache `(layers, 2, slots, Hkv, response_max_len, D)` each
  sequence's own; decode attention (`decode_attention.py`) reads both up to each slot's own lengths, so no
  key-length bucket is needed and prompt KV takes 1/n of the memory.

Both expose the same members, so the engine picks a layout once and never branches on it again.
Which sequence sits in which slot and which prompt in which entry is `scheduler.py`'s business; these
classes only own tensors. Buffers are zeros, not empty: SDPA meets masked keys with a 0 weight, and
0 * NaN would be NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hybridrl.rollout.engine.llama_forward import DecodeFunctions, decode_logits, decode_logits_prefix_shared
from hybridrl.rollout.engine.scheduler import SequenceSlot, prompt_entries_needed
from hybridrl.rollout.engine.weights import ModelWeights

LENGTH_ROUNDING = 16


def _round_up(value: int, multiple: int = LENGTH_ROUNDING) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class CacheGeometry:
    """The sizes one `generate` call needs; the byte counts below are what the KV budget is checked against."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_size: int
    longest_prompt: int
    max_new_tokens: int
    num_prompts: int

    @property
    def max_len(self) -> int:
        """Positions per slot in the per-slot layout (also the RoPE table length)."""
        return _round_up(self.longest_prompt + self.max_new_tokens)

    @property
    def token_bytes(self) -> int:
        """Keys and values of one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_size


def max_slots(bytes_for: Callable[[int], int], budget: float, limit: int) -> int:
    """The largest slot count <= limit whose cache fits the budget (bytes_for grows with it); 0 if none."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if bytes_for(middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


class SlotKVCache:
    """Every slot holds its prompt's KV and its response's: `kv` (layers, 2, slots, Hkv, max_len, D)."""

    reads_kv_len = True

    def __init__(self, geometry: CacheGeometry, num_slots: int, device, dtype) -> None:
        g = geometry
        self.kv = torch.zeros(g.num_layers, 2, num_slots, g.num_kv_heads, g.max_len, g.head_dim, dtype=dtype,
                              device=device)

    @staticmethod
    def bytes_for(geometry: CacheGeometry, num_slots: int) -> int:
        return num_slots * geometry.max_len * geometry.token_bytes

    @property
    def prefill_cache(self) -> torch.Tensor:
        return self.kv

    def prefill_writes(self, rows: list[int], sequences: list[SequenceSlot]) -> tuple[list[int], list[int]]:
        """(prompt row, destination) pairs for `prefill`: every admitted sequence gets a copy in its slot."""
        return rows, [sequence.slot for sequence in sequences]

    def decode(self, w: ModelWeights, cos: torch.Tensor, sin: torch.Tensor, tokens: torch.Tensor,
               prompt_len: torch.Tensor, gen_len: torch.Tensor, prompt_entry: torch.Tensor, kv_len: int,
               functions: DecodeFunctions) -> torch.Tensor:
        """Logits (B, V) of one decode step; gen_len (B,) counts response tokens including `tokens`."""
        return decode_logits(w, self.kv, cos, sin, tokens, prompt_len + gen_len - 1, kv_len, functions)

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        self.kv[:, :, destination] = self.kv[:, :, source]

    @property
    def is_cuda(self) -> bool:
        return self.kv.is_cuda


class PrefixSharedKVCache:
    """Prompt KV once per live prompt, response KV per slot (see the module docstring).

    prompt_kv (layers, 2, entries, Hkv, prompt_max_len, D); response_kv (layers, 2, slots, Hkv,
    response_max_len, D). `attention` is `triton_decode_attention` or `reference_decode_attention`.
    """

    reads_kv_len = False  # the attention stops at each slot's own lengths

    def __init__(self, geometry: CacheGeometry, num_slots: int, device, dtype, attention: Callable) -> None:
        g = geometry
        entries = prompt_entries_needed(g.num_prompts, num_slots)
        shape = (g.num_layers, 2)
        self.prompt_kv = torch.zeros(*shape, entries, g.num_kv_heads, _round_up(g.longest_prompt), g.head_dim,
                                     dtype=dtype, device=device)
        self.response_kv = torch.zeros(*shape, num_slots, g.num_kv_heads, _round_up(g.max_new_tokens), g.head_dim,
                                       dtype=dtype, device=device)
        self.attention = attention

    @staticmethod
    def bytes_for(geometry: CacheGeometry, num_slots: int) -> int:
        g = geometry
        entries = prompt_entries_needed(g.num_prompts, num_slots)
        return (entries * _round_up(g.longest_prompt) + num_slots * _round_up(g.max_new_tokens)) * g.token_bytes

    @property
    def prefill_cache(self) -> torch.Tensor:
        return self.prompt_kv

    def prefill_writes(self, rows: list[int], sequences: list[SequenceSlot]) -> tuple[list[int], list[int]]:
        """Only a prompt's newly taken entry is written; a prompt already resident is prefilled for its logits."""
        pairs = [(row, sequence.entry) for row, sequence in zip(rows, sequences) if sequence.fills_entry]
        return [row for row, _ in pairs], [entry for _, entry in pairs]

    def decode(self, w: ModelWeights, cos: torch.Tensor, sin: torch.Tensor, tokens: torch.Tensor,
               prompt_len: torch.Tensor, gen_len: torch.Tensor, prompt_entry: torch.Tensor, kv_len: int,
               functions: DecodeFunctions) -> torch.Tensor:
        """Logits (B, V) of one decode step; `kv_len` is unused (the engine passes 0)."""
        return decode_logits_prefix_shared(w, self.prompt_kv, self.response_kv, cos, sin, tokens, prompt_entry,
                                           prompt_len, gen_len, self.attention, functions)

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Compaction moves response KV only; the slot's prompt entry index moves with the per-slot state."""
        self.response_kv[:, :, destination] = self.response_kv[:, :, source]

    @property
    def is_cuda(self) -> bool:
        return self.response_kv.is_cuda
