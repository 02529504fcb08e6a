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
wide as the longest sequence and packing only removes whole-row padding (first-fit decreasing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.devices import host_to_device


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices whose lengths sum to at most `capacity` (an item longer than it gets its own bin)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for slot, free in enumerate(room):
            if lengths[index] <= free:
                bins[slot].append(index)
                room[slot] -= lengths[index]
                break
        else:
            bins.append([index])
            room.append(capacity - lengths[index])
    return bins


def group_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Micro-batches (lists of indices into `lengths`) of at most `max_tokens` real tokens each."""
    return [sorted(group) for group in first_fit_decreasing(lengths, max_tokens)]


def row_capacity_for(model, attention_mask: torch.Tensor) -> int:
    """One row for varlen flash-attention; otherwise the longest sequence (see the module docstring)."""
    implementation = str(getattr(getattr(model, "config", None), "_attn_implementation", "sdpa"))
    lengths = attention_mask.sum(1)
    return int(lengths.sum() if "flash" in implementation else lengths.max())


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


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int, capacity: int,
              pad_token_id: int = 0) -> PackedRows:
    """Pack the real tokens of a padded batch (B, P + R) into rows of `capacity` columns."""
    device = input_ids.device
    num_seqs, width = input_ids.shape
    mask = attention_mask.bool()
    lengths = mask.sum(1)  # (B,)
    prompt_lengths = mask[:, :prompt_width].sum(1)
    response_lengths = lengths - prompt_lengths
    starts = prompt_width - prompt_lengths  # first real column: prompts are left-padded
    bins = first_fit_decreasing(lengths.tolist(), capacity)
    capacity = max(capacity, int(lengths.max()))
    row_of = torch.empty(num_seqs, dtype=torch.long)
    offset_of = torch.empty(num_seqs, dtype=torch.long)
    host_lengths = lengths.tolist()
    for row, members in enumerate(bins):
        offset = 0
        for seq in sorted(members):
            row_of[seq], offset_of[seq] = row, offset
            offset += host_lengths[seq]
    row_of, offset_of = host_to_device(row_of, device), host_to_device(offset_of, device)
    dest_start = row_of * capacity + offset_of  # (B,) flat start of each sequence in the packed rows

    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), lengths)  # (T,)
    first_token = torch.cumsum(lengths, 0) - lengths
    step = torch.arange(int(lengths.sum()), device=device) - first_token[seq_of_token]  # position in its sequence
    source = seq_of_token * width + starts[seq_of_token] + step
    dest = dest_start[seq_of_token] + step
    packed_ids = torch.full((len(bins) * capacity,), pad_token_id, dtype=input_ids.dtype, device=device)
    packed_ids[dest] = input_ids.flatten()[source]
    positions = torch.arange(capacity, device=device).repeat(len(bins))  # tail padding continues the row's count
    positions[dest] = step

    response_width = width - prompt_width
    seq_of_target = torch.repeat_interleave(torch.arange(num_seqs, device=device), response_lengths)
    first_target = torch.cumsum(response_lengths, 0) - response_lengths
    t = torch.arange(int(response_lengths.sum()), device=device) - first_target[seq_of_target]
    return PackedRows(
        input_ids=packed_ids.view(len(bins), capacity), position_ids=positions.view(len(bins), capacity),
        logit_positions=dest_start[seq_of_target] + prompt_lengths[seq_of_target] + t - 1,
        targets=input_ids[seq_of_target, prompt_width + t],
        response_index=seq_of_target * response_width + t,
    )
