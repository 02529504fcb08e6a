"""Packing: no compute spent on padding. Sequences go into rows back to back, and micro-batches are
filled by a token budget instead of a sequence count.

Rollout batches are padded (prompts left to P columns, responses right to R, see `batch.py`). Before
a forward pass the real tokens of each sequence are copied into rows of `capacity` columns, each
sequence starting its position ids at 0. With no attention mask and such position ids, transformers
(>= 4.54) detects the resets and builds a block-diagonal causal mask (sdpa, eager, flex) or calls the
varlen kernel (flash-attention), so no token sees another sequence. Only the tail of a row can be
padding; it comes after every real token, so causal attention keeps it out of their outputs.

Row width: with flash-attention every sequence goes into one row (varlen, no quadratic waste). With
sdpa the mask is dense, so a row costs capacity**2 in attention whatever its blocks; rows are then as
wide as the longest sequence and packing only removes whole-row padding (first-fit decreasing). Packing is
chosen only where it leaves at most 7/8 of the rows (`RowPlan.saves_rows`): many short sequences of similar
lengths fill one row each anyway, and then it would only add host work and a row count that changes every batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridrl.devices import host_to_device


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices whose lengths sum to at most `capacity` (an item longer than it gets its own bin).
    A bin with less room than the shortest item is never scanned again (nothing can fit it any more), so the
    scan stays short when bins fill up, as with many short sequences in rows as wide as the longest."""
    bins: list[list[int]] = []
    room: list[int] = []
    open_bins: list[int] = []  # bins that may still take an item, in order
    shortest = min(lengths, default=0)
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        for position, slot in enumerate(open_bins):
            if length <= room[slot]:
                bins[slot].append(index)
                room[slot] -= length
                if room[slot] < shortest:
                    del open_bins[position]
                break
        else:
            bins.append([index])
            room.append(capacity - length)
            if room[-1] >= shortest:
                open_bins.append(len(bins) - 1)
    return bins


def group_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Micro-batches (lists of indices into `lengths`) of at most `max_tokens` real tokens each."""
    return [sorted(group) for group in first_fit_decreasing(lengths, max_tokens)]


def flash_attention(model) -> bool:
    return "flash" in str(getattr(getattr(model, "config", None), "_attn_implementation", "sdpa"))


@dataclass
class RowPlan:
    """Where each sequence of a padded batch goes when packed, worked out on the host: its real length and prompt
    length, and the bins (rows) of `capacity` columns that first-fit decreasing puts them in."""
    lengths: np.ndarray  # (B,)
    prompt_lengths: np.ndarray  # (B,)
    bins: list[list[int]]
    capacity: int

    def saves_rows(self) -> bool:
        """Whether packing leaves at most 7/8 of the rows: otherwise the padded batch costs about the same on the
        device, and packing adds host work and a row count that changes from batch to batch."""
        return len(self.bins) <= 0.875 * len(self.lengths)


def plan_rows(attention_mask: torch.Tensor, prompt_width: int, capacity: int | None = None,
              one_row: bool = False) -> RowPlan:
    """The packed layout of a padded batch, from its lengths read in one transfer. `capacity` defaults to the
    longest sequence (every row as wide as it: sdpa's dense mask costs a row's width squared), or with `one_row`
    (varlen flash-attention) to all the tokens."""
    mask = attention_mask.bool()
    lengths, prompt_lengths = (np.array(values, dtype=np.int64) for values in
                               torch.stack([mask.sum(1), mask[:, :prompt_width].sum(1)]).tolist())
    if capacity is None:
        capacity = int(lengths.sum() if one_row else lengths.max())
    bins = first_fit_decreasing(lengths.tolist(), capacity)
    return RowPlan(lengths, prompt_lengths, bins, max(capacity, int(lengths.max())))


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # (rows, capacity)
    position_ids: torch.Tensor  # (rows, capacity), restarting at 0 for each sequence
    logit_positions: torch.Tensor  # (N,) flat index into rows * capacity: the position predicting each target
    targets: torch.Tensor  # (N,) the response tokens, sequence by sequence
    response_index: torch.Tensor  # (N,) flat index into the (B, R) response grid

    def unpack(self, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """Per-target values (N,) back into the padded (B, R) grid, zeros elsewhere (differentiable)."""
        return values.new_zeros(shape[0] * shape[1]).scatter(0, self.response_index, values).view(shape)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int, capacity: int | None = None,
              pad_token_id: int = 0, plan: RowPlan | None = None) -> PackedRows:
    """Pack the real tokens of a padded batch (B, P + R) into rows of `capacity` columns (or as `plan` says).

    The layout (which sequence goes where, every index) is computed on the host from the sequences' lengths, read
    in one transfer, and goes to the device as one index tensor: a few launches and no wait beyond that read,
    where doing it on the device took dozens of small launches and a wait per data-dependent size."""
    device = input_ids.device
    num_seqs, width = input_ids.shape
    plan = plan or plan_rows(attention_mask, prompt_width, capacity)
    lengths, prompt_lengths, bins, capacity = plan.lengths, plan.prompt_lengths, plan.bins, plan.capacity
    response_lengths = lengths - prompt_lengths
    order = np.array([seq for members in bins for seq in sorted(members)], dtype=np.int64)  # row by row
    counts = np.array([len(members) for members in bins], dtype=np.int64)
    before = np.cumsum(lengths[order]) - lengths[order]  # tokens ahead of each sequence in `order`
    offset = before - np.repeat(before[np.cumsum(counts) - counts], counts)  # ... within its row
    dest_start = np.empty(num_seqs, dtype=np.int64)  # (B,) flat start of each sequence in the packed rows
    dest_start[order] = np.repeat(np.arange(len(bins)), counts) * capacity + offset

    seq_of_token = np.repeat(np.arange(num_seqs), lengths)  # (T,)
    step = np.arange(len(seq_of_token)) - (np.cumsum(lengths) - lengths)[seq_of_token]  # position in its sequence
    source = seq_of_token * width + (prompt_width - prompt_lengths)[seq_of_token] + step  # prompts are left-padded
    dest = dest_start[seq_of_token] + step
    positions = np.tile(np.arange(capacity), len(bins))  # tail padding continues the row's count
    positions[dest] = step

    seq_of_target = np.repeat(np.arange(num_seqs), response_lengths)  # (N,)
    t = np.arange(len(seq_of_target)) - (np.cumsum(response_lengths) - response_lengths)[seq_of_target]
    logit_positions = dest_start[seq_of_target] + prompt_lengths[seq_of_target] + t - 1
    target_index = seq_of_target * width + prompt_width + t  # flat into input_ids
    response_index = seq_of_target * (width - prompt_width) + t
    parts = [source, dest, positions, logit_positions, target_index, response_index]
    source, dest, positions, logit_positions, target_index, response_index = host_to_device(
        torch.from_numpy(np.concatenate(parts)), device).split([len(part) for part in parts])
    flat_ids = input_ids.flatten()
    packed_ids = torch.full((len(bins) * capacity,), pad_token_id, dtype=input_ids.dtype, device=device)
    packed_ids[dest] = flat_ids[source]
    return PackedRows(
        input_ids=packed_ids.view(len(bins), capacity), position_ids=positions.view(len(bins), capacity),
        logit_positions=logit_positions, targets=flat_ids[target_index], response_index=response_index,
    )
