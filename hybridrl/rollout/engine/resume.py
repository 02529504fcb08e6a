"""Multi-turn resumes on the runner's tensors: a wave of paused slots gets its new ids prefilled onto its own KV
(`llama_forward.extend`) and draws the first token of its next turn. The episode loop (`multiturn.py`) decides who
resumes; this module only turns a wave into device work.

Choices:
- Chunks: a wave is cut into padded chunks of `max_prefill_tokens` (`resume_chunks`), a small last chunk joining the
  one before, since each forward costs the host tens of milliseconds of launches whatever its rows.
- Uniforms: each resumed turn's uniforms are a hash of its key (seed, episode, turn: made by the episode loop) and
  the column, computed on the device for the whole chunk (`resume_uniforms`). The same numbers whatever order the
  environments answer in and whichever resumes share a chunk, on CPU and GPU alike, with no generator per episode
  (seeding and drawing hundreds of host generators per wave was host time at every turn boundary).
- The batch is written into one flat int64 array (no per-row tensors, no boolean-mask fill) and goes to the device in
  one pinned copy (`host_batch`).
- CUDA graphs for small waves: a wave of few tokens is bound by the host, which launches two compiled pieces and
  two indexing ops per layer, not by the GPU, which runs them in less time. A wave of at most `GRAPH_MAX_TOKENS`
  tokens once padded to its bucket (`graph_bucket`: rows to a power of two, ids to a multiple of 8) runs as a
  replay of `extend_hidden` captured for that (rows, ids, key length) bucket; captured the first time the bucket
  comes in a call (after a real run on a side stream the first time its shapes come in the engine's life:
  `graphs.py`), replayed when it comes again in the call (graphs point at the call's KV cache, so they go with it).
  Larger waves run uncaptured: their GPU time exceeds their launches, so a graph saves little there, and padding
  them to a bucket would cost GPU time.
- A graph's padding rows resume the slot of the wave's first row right after that row's new ids, with length 0:
  in the per-slot layout they write past that row's end, where nothing is visible until a later step overwrites it
  (as a real row's own padding does); in the paged layout a length-0 row writes only to the scratch block. Their
  logits are never computed (the LM head runs on the real rows only, outside the graph).
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy
import torch

from hybridrl.devices import host_to_device
from hybridrl.rollout.engine.graphs import DecodeGraphs, step_signature
from hybridrl.rollout.engine import llama_forward
from hybridrl.rollout.engine.llama_forward import extend_hidden
from hybridrl.rollout.engine.sampling import sample
from hybridrl.rollout.engine.scheduler import prefill_chunks

Resume = tuple[int, Sequence[int], int, int]
"""(slot, ids, start, key): feed `ids` (a list, or an int64 `array.array`, which `host_batch` copies whole) at
positions start.. of the slot; `key` seeds the turn's uniforms."""

GRAPH_MAX_TOKENS = 4096
"""Waves of at most this many tokens, padded to their bucket, run as CUDA graphs (GPU only)."""
_MASK32 = 0xFFFFFFFF
_KEY_MASK = 2**63 - 1  # keys are int64 on the device


def resume_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """A wave of resumes (their lengths) in padded chunks of `budget` tokens, as `prefill_chunks` makes them, except
    that the last two chunks are one when together they stay within 9/8 of the budget: an observation prefill costs
    tens of milliseconds of host time whatever its rows (two compiled pieces and two indexing ops per layer to
    launch), so a tail of a few rows costs as much as the hundreds before it (512 resumes of 33 ids: 16,896 tokens,
    496 + 16 rows at the default 16,384)."""
    if max(lengths) * len(lengths) * 8 <= budget * 9:  # one chunk, as below but without the chunking pass
        return [sorted(range(len(lengths)), key=lengths.__getitem__)]
    chunks = prefill_chunks(lengths, list(range(len(lengths))), budget)
    if len(chunks) > 1:
        merged = chunks[-2] + chunks[-1]
        if max(lengths[i] for i in merged) * len(merged) * 8 <= budget * 9:
            chunks[-2:] = [merged]
    return chunks


def graph_bucket(rows: int, length: int) -> tuple[int, int] | None:
    """The (rows, ids) a wave of `rows` x `length` is padded to for a CUDA graph: rows to the next power of two, ids to
    the next multiple of 8; None when that is more than `GRAPH_MAX_TOKENS` (the wave runs uncaptured)."""
    padded_rows, padded_length = 1 << (rows - 1).bit_length(), -(-length // 8) * 8
    return (padded_rows, padded_length) if padded_rows * padded_length <= GRAPH_MAX_TOKENS else None


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mix (the "lowbias32" constants) on int64 tensors holding values in [0, 2**32). The
    32-bit products are taken in two halves of the multiplier, so no int64 product overflows."""
    def times(x: torch.Tensor, multiplier: int) -> torch.Tensor:
        low = x * (multiplier & 0xFFFF)
        high = ((x * (multiplier >> 16)) & 0xFFFF) << 16
        return (low + high) & _MASK32

    x = x ^ (x >> 16)
    x = times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = times(x, 0x846CA68B)
    return x ^ (x >> 16)


def resume_uniforms(keys: torch.Tensor, columns: int) -> torch.Tensor:
    """keys (R,) int64 -> (R, columns) float32 uniforms in [0, 1), column c of row r a hash of (keys[r], c): a pure
    function of the key, so the draws of a resumed turn do not depend on which other resumes share its batch."""
    column = _mix32((torch.arange(columns, device=keys.device) * 0x9E3779B9) & _MASK32)  # (columns,)
    row = _mix32(_mix32(keys & _MASK32) ^ ((keys >> 32) & _MASK32))  # (R,): one 32-bit seed per key
    x = _mix32(row[:, None] ^ column[None, :])  # the only (R, columns) pass
    return (x >> 8).to(torch.float32) * 2.0**-24


@dataclass
class HostBatch:
    """One chunk's inputs on the device, views of one buffer (`packed`): ids (rows, width) right-padded with 0; slots,
    lengths, starts and keys (rows,)."""

    packed: torch.Tensor
    input_ids: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    keys: torch.Tensor

    @classmethod
    def of(cls, packed: torch.Tensor, rows: int, width: int) -> "HostBatch":
        ids, lengths, slots, starts, keys = packed.split([rows * width, rows, rows, rows, rows])
        return cls(packed, ids.view(rows, width), slots, lengths, starts, keys)


def host_batch(resumes: list[Resume], rows: int, width: int, device) -> HostBatch:
    """The chunk padded to `rows` x `width` (rows past the resumes: see the module docstring), written into one flat
    int64 array (ids row by row, each right-padded with 0, then lengths, slots, starts and keys) and sent over in one
    pinned copy. Python lists into an `array` and one numpy view: at 512 rows x 33 ids a tensor built from lists and
    filled through a boolean mask took several milliseconds of host time at every turn boundary, with the GPU idle."""
    padding = rows - len(resumes)
    first_slot, first_ids, first_start, _ = resumes[0]
    zeros = bytes(8 * width)
    parts: list = []  # int64 buffers, joined in one call
    for _, ids, _, _ in resumes:
        parts.append(ids if isinstance(ids, array.array) and ids.typecode == "q" else array.array("q", ids))
        if len(ids) < width:
            parts.append(zeros[:8 * (width - len(ids))])
    parts.append(zeros * padding)
    tail = array.array("q", [len(ids) for _, ids, _, _ in resumes] + [0] * padding)
    tail.extend([slot for slot, _, _, _ in resumes] + [first_slot] * padding)
    tail.extend([start for _, _, start, _ in resumes] + [first_start + len(first_ids)] * padding)
    tail.extend([key & _KEY_MASK for _, _, _, key in resumes] + [0] * padding)
    parts.append(tail)
    values = torch.from_numpy(numpy.frombuffer(bytearray(b"".join(parts)), dtype=numpy.int64))
    return HostBatch.of(host_to_device(values, device), rows, width)


def extend_resumes(run, resumes: list[Resume], budget: int, graphs: DecodeGraphs,
                   key_bucket: Callable[[int], int]) -> None:
    """Prefill a wave of resumes onto their slots and draw each one's next first token into the per-slot state.
    `run`: the runner's `RunState`; `budget`: tokens per chunk; `graphs`: where small waves' graphs live (used when
    `run.use_graphs`); `key_bucket(furthest)`: the key length the attention reads up to."""
    lengths = [len(ids) for _, ids, _, _ in resumes]
    for chunk in resume_chunks(lengths, budget):
        _extend_chunk(run, [resumes[i] for i in chunk], graphs, key_bucket)
        run.stats.prefill_tokens += sum(lengths[i] for i in chunk)
    run.stats.observation_prefills += len(resumes)


def _extend_chunk(run, resumes: list[Resume], graphs: DecodeGraphs, key_bucket: Callable[[int], int]) -> None:
    state, count = run.state, len(resumes)
    width = max(len(ids) for _, ids, _, _ in resumes)
    # Bucketed like decode's key length: keys past a row's own positions are masked anyway, and compiled pieces (and
    # graphs) then meet a handful of key lengths over a run.
    kv_end = key_bucket(max(start + len(ids) for _, ids, start, _ in resumes))
    bucket = graph_bucket(count, width) if run.use_graphs else None
    batch = host_batch(resumes, *(bucket or (count, width)), state.done.device)
    logits = forward(run, batch, kv_end, count) if bucket is None else replay(run, batch, kv_end, count, graphs)
    slots, lengths, starts = batch.slots[:count], batch.lengths[:count], batch.starts[:count]
    uniforms = resume_uniforms(batch.keys[:count], state.max_new_tokens)
    tokens, logprobs = sample(logits, run.settings, uniforms[:, 0])
    state.uniform_table[slots] = uniforms
    state.last_token[slots] = tokens
    state.prompt_len[slots] = starts + lengths
    state.gen_len.index_fill_(0, slots, 1)
    state.out_tokens[slots, 0] = tokens
    state.out_logprobs[slots, 0] = logprobs
    state.done[slots] = state.is_stop(tokens) | (state.max_new_tokens <= 1)


def forward(run, batch: HostBatch, kv_end: int, count: int) -> torch.Tensor:
    """`extend_hidden` over the batch, uncaptured, then the LM head on its first `count` rows: float32 logits (count,
    vocabulary) at each row's last new id."""
    return _logits(run, _hidden(run, batch, kv_end), count)


def _logits(run, hidden: torch.Tensor, count: int) -> torch.Tensor:
    return run.functions.final_logits(run.weights, hidden[:count], ()).float()


def _hidden(run, batch: HostBatch, kv_end: int) -> torch.Tensor:
    return extend_hidden(run.weights, getattr(run.cache, "kv", None), run.cos, run.sin, batch.input_ids,
                         batch.lengths, batch.starts, batch.slots, kv_end, run.functions,
                         access=run.cache.extend_access(batch.slots, kv_end))


def replay(run, batch: HostBatch, kv_end: int, count: int, graphs: DecodeGraphs) -> torch.Tensor:
    """`forward` with `extend_hidden` through the CUDA graph of the batch's bucket: its inputs copied into the graph's
    static buffer (one copy), then replayed; captured first when the call has none for the bucket
    (`DecodeGraphs.step`). The LM head runs on the real rows only, outside the graph."""
    rows, width = batch.input_ids.shape
    key = ("extend", rows, width, kv_end)
    static = graphs.inputs.get(key)
    if static is None:
        hidden = run.weights.embed.shape[1]
        static = (HostBatch.of(torch.zeros_like(batch.packed), rows, width),
                  torch.empty(rows, hidden, dtype=run.weights.embed.dtype, device=batch.packed.device))
        graphs.inputs[key] = static
    inputs, out = static
    inputs.packed.copy_(batch.packed)
    # The attention's name too: a benchmark that switches `llama_forward.extend_attention` must warm the new form
    # (compiling it) before a capture, which cannot compile.
    graphs.step(key, lambda: step_signature(rows, kv_end, ("extend", width, llama_forward.extend_attention),
                                            (run.weights, run.cache, run.cos, run.sin, inputs.packed)),
                lambda: out.copy_(_hidden(run, inputs, kv_end)), run.counts)
    return _logits(run, out, count)
