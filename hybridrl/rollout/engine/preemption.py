"""Recompute preemption, the tensor side (the bookkeeping is `Scheduler._preempt`): when the paged pool runs dry, a
preempted sequence gives back its slot and blocks but keeps what it sampled; re-admitted, its context is prefilled
again and decoding continues after its kept tokens, as vLLM's "recompute" mode does.

Choices:
- The kept tokens and log-probs go to the host at the preemption, keyed by sequence index (one small copy at a sync
  point, where the host has just waited for the device anyway): the slot is handed to another sequence at once, and
  the refill builds its input ids on the host, as a prefill does.
- The refill feeds the context through `llama_forward.extend` and the block table, and does not sample: it writes the
  KV of the prompt (only when the re-admission took the prompt's blocks anew, `fills_entry`; otherwise another
  sample still holds them) and of every kept token but the last, whose KV the next decode step writes, as it would
  have without the preemption. The per-slot state is then put back as it was at the preemption (tokens, log-probs,
  length, the sequence's own uniforms), so the next token is drawn by a decode step from the same uniform: the
  same tokens as without preemption, and none sampled twice.
- Rows that write their prompt's blocks run before rows that read them (one forward writes each layer before it
  reads it, but the chunks of a wave may split the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hybridrl.devices import host_to_device
from hybridrl.rollout.engine.decode_state import DecodeState
from hybridrl.rollout.engine.llama_forward import extend
from hybridrl.rollout.engine.scheduler import SequenceSlot, prefill_chunks


@dataclass(frozen=True)
class KeptResponse:
    """What a preempted sequence had sampled, on the host."""

    tokens: torch.Tensor  # (kept,) int64
    logprobs: torch.Tensor  # (kept,) float32


def keep_sampled(state: DecodeState, sequences: list[SequenceSlot]) -> dict[int, KeptResponse]:
    """Read the `kept` tokens and log-probs of each preempted sequence from the slot it held (`sequence.slot`), before
    another sequence takes that slot; one copy to the host. Sequence index -> its `KeptResponse`."""
    slots = host_to_device(torch.tensor([sequence.slot for sequence in sequences]), state.done.device)
    width = max(sequence.kept for sequence in sequences)
    tokens, logprobs = state.out_tokens[slots, :width].cpu(), state.out_logprobs[slots, :width].cpu()
    return {sequence.index: KeptResponse(tokens[row, : sequence.kept], logprobs[row, : sequence.kept])
            for row, sequence in enumerate(sequences)}


def refill_rows(sequences: list[SequenceSlot], prompts: list[list[int]],
                kept: dict[int, KeptResponse]) -> list[list[tuple[int, list[int], int]]]:
    """The contexts re-admitted `sequences` prefill again, as (slot, ids, start) rows for `extend`, in two groups to
    run in order: those that write their prompt (start 0: their admission took its blocks anew), then those that
    read it (start at the prompt's end). Each feeds every kept token but the last; a row with nothing to feed (one
    kept token, prompt held by another sample) is left out."""
    writers, readers = [], []
    for sequence in sequences:
        prompt = prompts[sequence.prompt_index]
        start = 0 if sequence.fills_entry else len(prompt)
        ids = (prompt + kept[sequence.index].tokens[: sequence.kept - 1].tolist())[start:]
        if ids:
            (writers if start == 0 else readers).append((sequence.slot, ids, start))
    return [group for group in (writers, readers) if group]


def restore_sampled(state: DecodeState, slots: torch.Tensor, sequences: list[SequenceSlot],
                    kept: dict[int, KeptResponse], uniforms: torch.Tensor, prompt_lens: torch.Tensor) -> None:
    """Put each re-admitted sequence's per-slot state back as it was when it was preempted: its kept tokens and
    log-probs, its length, its last token (the next decode step feeds it) and its own uniforms (`uniforms`, (P,
    max_new_tokens), so the step after draws from the column it would have). `slots`, `prompt_lens` (P,) on the
    device."""
    width = max(sequence.kept for sequence in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    logprobs = torch.zeros(len(sequences), width, dtype=torch.float32)
    for row, sequence in enumerate(sequences):
        tokens[row, : sequence.kept] = kept[sequence.index].tokens
        logprobs[row, : sequence.kept] = kept[sequence.index].logprobs
    device = state.done.device
    tokens, logprobs = host_to_device(tokens, device), host_to_device(logprobs, device)
    lengths = host_to_device(torch.tensor([sequence.kept for sequence in sequences]), device)
    last = tokens.gather(1, (lengths - 1)[:, None])[:, 0]
    state.uniform_table[slots] = uniforms
    state.out_tokens[slots, :width] = tokens  # columns past a row's kept ones are rewritten before they are read
    state.out_logprobs[slots, :width] = logprobs
    state.last_token[slots] = last
    state.prompt_len[slots] = prompt_lens
    state.gen_len[slots] = lengths
    state.done[slots] = state.is_stop(last) | (lengths >= state.max_new_tokens)


def refill(run, prompts: list[list[int]], sequences: list[SequenceSlot], chunk_tokens: int,
           key_bucket: Callable[[int], int]) -> None:
    """Re-admitted preempted `sequences` (already given their slots and blocks): prefill their context again through
    the block table, writers of a prompt first (`refill_rows`), in padded chunks of `chunk_tokens`, then put back
    their per-slot state, so decoding continues after their kept tokens. `run`: the runner's `RunState` (its kept
    responses are taken out of `run.kept`); `key_bucket(furthest)`: the key length `extend` reads up to."""
    device = run.state.done.device
    kept = {sequence.index: run.kept.pop(sequence.index) for sequence in sequences}
    slots, prompt_lens, indices = host_to_device(torch.tensor(
        [[s.slot for s in sequences], [len(prompts[s.prompt_index]) for s in sequences], [s.index for s in sequences]],
        dtype=torch.long), device)
    run.cache.begin_sequences(slots, prompt_lens)  # where each row's prompt columns end, which the writes follow
    for group in refill_rows(sequences, prompts, kept):
        lengths = [len(ids) for _, ids, _ in group]
        for chunk in prefill_chunks(lengths, list(range(len(group))), chunk_tokens):
            _refill_chunk(run, [group[i] for i in chunk], key_bucket)
        run.stats.prefill_tokens += sum(lengths)
    run.stats.refilled_tokens += sum(sequence.kept - 1 for sequence in sequences)
    restore_sampled(run.state, slots, sequences, kept, run.uniforms[indices], prompt_lens)


def _refill_chunk(run, rows: list[tuple[int, list[int], int]], key_bucket: Callable[[int], int]) -> None:
    """One padded `extend` forward over (slot, ids, start) rows, writing their KV through the block table; its logits
    are left unused (the next token is drawn by a decode step)."""
    device = run.state.done.device
    width = max(len(ids) for _, ids, _ in rows)
    input_ids = torch.tensor([ids + [0] * (width - len(ids)) for _, ids, _ in rows], dtype=torch.long)
    slots, lengths, starts = host_to_device(torch.tensor(
        [[slot for slot, _, _ in rows], [len(ids) for _, ids, _ in rows], [start for _, _, start in rows]],
        dtype=torch.long), device)
    kv_end = key_bucket(max(start + len(ids) for _, ids, start in rows))
    extend(run.weights, None, run.cos, run.sin, host_to_device(input_ids, device), lengths, starts, slots, kv_end,
           run.functions, access=run.cache.extend_access(slots, kv_end))
