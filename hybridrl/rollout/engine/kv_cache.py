"""KV cache layouts of the built-in engine: the tensors, what prefill writes, one decode step, slot moves.

- `SlotKVCache` (attention="sdpa"): one tensor `(layers, 2, slots, Hkv, max_len, D)`; every slot holds
  its whole context, so prefill copies a prompt's KV into the slots of all its samples and decode
  attention is SDPA over keys [0, kv_len) with a per-slot mask (`kv_len` is a bucket chosen by the
  engine, so the CUDA graphs are keyed by it).
- `PrefixSharedKVCache` (attention="triton"): a prompt cache `(layers, 2, entries, Hkv, prompt_max_len, D)`
  holds each live prompt's KV once, a response cache `(layers, 2, slots, Hkv, response_max_len, D)` each
  sequence's own; decode attention (`decode_attention.py`) reads both up to each slot's own lengths, so no
  key-length bucket is needed and prompt KV takes 1/n of the memory.
- `PagedKVCache` (kv_cache="paged"): a pool of fixed-size blocks `(layers, 2, blocks, Hkv, block_size, D)` and a
  block table `(slots, prompt_columns + response_columns)`; sequences hold only the blocks they have filled (the
  prompt's shared by its samples), so the pool is sized by tokens in flight rather than slots x longest length.
  Which block goes where is `blocks.py`'s business; decode attention reads through the table
  (`kernels/paged_attention.py`).

All expose the same members, so the engine picks a layout once and never branches on it again.
Which sequence sits in which slot and which prompt in which entry is `scheduler.py`'s business; these
classes only own tensors. Buffers are zeros, not empty: SDPA meets masked keys with a 0 weight, and
0 * NaN would be NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import functools

import torch

from hybridrl.devices import host_to_device
from hybridrl.rollout.engine.blocks import BlockAllocator, blocks_for
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


def contiguous_store(cache: torch.Tensor, rows: torch.Tensor, destinations: torch.Tensor, length: int):
    """`prefill`'s KV write for a layout of one row per slot or entry: destination j gets prompt row rows[j]."""
    def store(layer_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        cache[layer_index, 0, destinations, :, :length] = k[rows]
        cache[layer_index, 1, destinations, :, :length] = v[rows]
    return store


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

    def prompt_store(self, rows: torch.Tensor, destinations: torch.Tensor, lengths: torch.Tensor, length: int):
        return contiguous_store(self.prefill_cache, rows, destinations, length)

    def free(self, slots: torch.Tensor) -> None:
        """Nothing to do: a slot's KV is simply overwritten by its next sequence."""

    def begin_sequences(self, slots: torch.Tensor, prompt_lens: torch.Tensor) -> None:
        """Nothing to record: the per-slot state's `prompt_len` says where each slot's prompt ends."""

    def extend_access(self, slots: torch.Tensor, kv_end: int) -> None:
        """None: `extend` writes and reads a per-slot cache itself."""
        return None

    def allocator(self) -> None:
        """No blocks to allocate: slots are the unit."""
        return None

    def write_blocks(self, writes: list[tuple[int, int, int]]) -> None:
        assert not writes, "a contiguous layout has no block table"

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

    prompt_store, free, allocator, write_blocks = (SlotKVCache.prompt_store, SlotKVCache.free, SlotKVCache.allocator,
                                                   SlotKVCache.write_blocks)
    begin_sequences, extend_access = SlotKVCache.begin_sequences, SlotKVCache.extend_access

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


class PagedKVCache:
    """A block pool and a block table (see the module docstring); block 0 is scratch, free slots' rows point at it.

    pool (layers, 2, blocks, Hkv, block_size, D); block_table (slots, prompt_columns + response_columns) int64.
    `attention` is `triton_paged_decode_attention` or `reference_paged_decode_attention`.
    """

    reads_kv_len = False

    def __init__(self, geometry: CacheGeometry, num_slots: int, num_blocks: int, block_size: int, device, dtype,
                 attention: Callable) -> None:
        g = geometry
        self.block_size, self.num_blocks = block_size, num_blocks
        self.prompt_columns = blocks_for(g.longest_prompt, block_size)
        self.pool = torch.zeros(g.num_layers, 2, num_blocks, g.num_kv_heads, block_size, g.head_dim, dtype=dtype,
                                device=device)
        self.block_table = torch.zeros(num_slots, self.prompt_columns + blocks_for(g.max_new_tokens, block_size),
                                       dtype=torch.long, device=device)
        # Each slot's own prompt length: the per-slot state's `prompt_len` counts every token before the current
        # turn (multi-turn), but the table's prompt columns hold the prompt only and the rest sits in response ones.
        self.prompt_lens = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.attention = functools.partial(attention, prompt_columns=self.prompt_columns)

    @staticmethod
    def blocks_within(geometry: CacheGeometry, block_size: int, budget: float) -> int:
        return int(budget // (block_size * geometry.token_bytes))

    @staticmethod
    def blocks_needed(geometry: CacheGeometry, block_size: int) -> int:
        """The pool one sequence of the longest prompt and `max_new_tokens` needs, the scratch block included."""
        return 1 + blocks_for(geometry.longest_prompt, block_size) + blocks_for(geometry.max_new_tokens, block_size)

    def allocator(self) -> BlockAllocator:
        return BlockAllocator(self.num_blocks, self.block_size, self.prompt_columns)

    def prefill_writes(self, rows: list[int], sequences: list[SequenceSlot]) -> tuple[list[int], list[int]]:
        """(prompt row, slot) for each prompt whose blocks were just taken: its KV goes where that slot's row
        points (the other samples' rows point at the same blocks)."""
        pairs = [(row, sequence.slot) for row, sequence in zip(rows, sequences) if sequence.fills_entry]
        return [row for row, _ in pairs], [slot for _, slot in pairs]

    def prompt_store(self, rows: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, length: int):
        """`prefill`'s KV write through the block table: position p of prompt row rows[j] goes to block
        table[slots[j], p // block_size], row p % block_size; padding past a prompt's length goes to scratch."""
        positions = torch.arange(length, device=rows.device)
        blocks = self.block_table[slots][:, positions // self.block_size]  # (Q, L)
        blocks = torch.where(positions[None, :] < lengths[rows][:, None], blocks, 0)
        offsets = positions % self.block_size

        def store(layer_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
            # Advanced indices on dims 0 and 2 of (blocks, Hkv, block_size, D) put (Q, L) first: (Q, L, Hkv, D).
            self.pool[layer_index, 0][blocks, :, offsets] = k[rows].transpose(1, 2)
            self.pool[layer_index, 1][blocks, :, offsets] = v[rows].transpose(1, 2)
        return store

    def write_blocks(self, writes: list[tuple[int, int, int]]) -> None:
        """Apply the allocator's (slot, column, block) writes in one copy."""
        if writes:
            slot, column, block = host_to_device(torch.tensor(writes, dtype=torch.long).T.contiguous(),
                                                 self.block_table.device)
            self.block_table[slot, column] = block

    def begin_sequences(self, slots: torch.Tensor, prompt_lens: torch.Tensor) -> None:
        """Record where the prompt of each newly prefilled slot ends (see `decode`)."""
        self.prompt_lens[slots] = prompt_lens

    def decode(self, w: ModelWeights, cos: torch.Tensor, sin: torch.Tensor, tokens: torch.Tensor,
               prompt_len: torch.Tensor, gen_len: torch.Tensor, prompt_entry: torch.Tensor, kv_len: int,
               functions: DecodeFunctions) -> torch.Tensor:
        """Logits (B, V) of one decode step, attention through the block table (`kv_len`, `prompt_entry` unused).
        The attention reads [0, prompt) from the prompt columns and the rest (earlier turns and observations, then
        this turn's tokens) from the response columns: prompt + response = prompt_len + gen_len, as decode's."""
        batch = tokens.shape[0]
        prompt = self.prompt_lens[:batch]
        return decode_logits_prefix_shared(w, self.pool, self.pool, cos, sin, tokens, self.block_table[:batch],
                                           prompt, prompt_len + gen_len - prompt, self.attention, functions)

    def extend_access(self, slots: torch.Tensor, kv_end: int) -> Callable:
        """`extend`'s KV write and read through the block table (multi-turn resumes; see `llama_forward.extend`):
        given positions (P, L) and lengths (P,), write(layer, kv (2, P, L, Hkv, D)) stores each row's new K/V in the
        response blocks the scheduler grew for it (padding past a row's length goes to scratch) and read(layer)
        returns (2, P, Hkv, kv_end, D), the keys of positions [0, kv_end) of each row's slot in order (those past a
        slot's blocks come from scratch, masked by `extend`). Both index a flat view of the layer's pool."""
        block_size, width = self.block_size, self.block_table.shape[1]
        table, prompt = self.block_table[slots], self.prompt_lens[slots][:, None]  # (P, columns), (P, 1)
        heads = torch.arange(self.pool.shape[3], device=slots.device)

        def flat_index(blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            return (blocks[..., None] * heads.numel() + heads) * block_size + offsets[..., None]  # (..., Hkv)

        def place(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Block and row of each position (P, N) of the rows' slots: prompt columns, then response ones."""
            response = positions - prompt
            in_prompt = response < 0
            columns = torch.where(in_prompt, positions // block_size, self.prompt_columns + response // block_size)
            offsets = torch.where(in_prompt, positions, response) % block_size
            return table.gather(1, columns.clamp(0, width - 1)), offsets

        keys = torch.arange(kv_end, device=slots.device).expand(len(slots), kv_end)
        key_blocks, key_offsets = place(keys)
        source = flat_index(key_blocks, key_offsets).transpose(1, 2)  # (P, Hkv, K)

        def access(positions: torch.Tensor, lengths: torch.Tensor):
            blocks, offsets = place(positions)
            padding = torch.arange(positions.shape[1], device=slots.device) >= lengths[:, None]
            destination = flat_index(blocks.masked_fill(padding, 0), offsets)  # (P, L, Hkv)
            head_dim = self.pool.shape[-1]

            def write(layer_index: int, kv: torch.Tensor) -> None:
                self.pool[layer_index].view(2, -1, head_dim)[:, destination] = kv

            def read(layer_index: int) -> torch.Tensor:
                return self.pool[layer_index].view(2, -1, head_dim)[:, source]
            return write, read
        return access

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Compaction moves table rows (and prompt lengths) only: the blocks stay where they are (`free` then resets
        the sources)."""
        self.block_table[destination] = self.block_table[source]
        self.prompt_lens[destination] = self.prompt_lens[source]

    def clear_rows(self, slots: torch.Tensor) -> None:
        """Point evicted slots' rows at scratch, keeping their prompt lengths (their blocks went to others; a decode
        step still writes the paused slot's KV at its last position)."""
        self.block_table.index_fill_(0, slots, 0)

    def free(self, slots: torch.Tensor) -> None:
        """Point freed slots' rows at the scratch block: a decode step still writes their (stale) KV (at response
        row 0: the per-slot state parks them at position 0, and their prompt length is 0 too)."""
        self.block_table.index_fill_(0, slots, 0)
        self.prompt_lens.index_fill_(0, slots, 0)

    @property
    def is_cuda(self) -> bool:
        return self.pool.is_cuda
