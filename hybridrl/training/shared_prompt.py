"""Shared prompts in training: the n responses to one prompt go through the model with that prompt once.

GRPO samples n responses per prompt, and a batch row is prompt + response, so the forward and backward
passes of the update compute every prompt n times, always with the same result: prompt tokens attend only
to earlier prompt tokens. Here the rows of one prompt become one group, the prompt followed by each response,

    [ prompt | response 1 | response 2 | ... | response m | (another prompt's group | ...) padding ]

with an attention mask under which the prompt is causal, each response sees the whole prompt and its own
earlier tokens but no other response, and position ids restart at the prompt's length for every response.
Each response token then gets the hidden state it gets in its own row, so log-probs and gradients are the
same (up to rounding), for (P + n R) tokens instead of n (P + R): 44% fewer for grpo-0.5b (P = R = 256,
n = 8). A response's first token is predicted from the prompt's last position, which its m responses share.
Rows are as wide as the widest group; shorter groups share a row (first fit), and nothing attends across
groups, so variable response lengths cost little padding.

The mask is a block mask (`torch.nn.attention.flex_attention`) when the model runs flex attention, which
skips the blocks it rules out; otherwise a dense (rows, 1, L, L) mask for sdpa or eager attention, which
computes every block (L = P + n R: costlier attention, only worth it while the rows stay short).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridrl.config.schema import ConfigError
from hybridrl.devices import host_to_device
from hybridrl.training.packing import PackedRows

PROMPT, PADDING = 0, -1  # segment ids within a group; response k of a group is segment k (1, 2, ...)
GROUP_STRIDE = 1 << 16  # a row's j-th group has segments j * GROUP_STRIDE + (PROMPT, 1, 2, ...)
FLEX_BLOCK = 128  # FlexAttention's default block size
DENSE_MASK_LIMIT = 1 << 30  # mask elements (rows x L x L) sdpa/eager may get; beyond, flex_attention is the way
TUNED_FLEX_TILES = {  # (GPU compute capability, head dim): FlexAttention kernel_options for the shared rows
    ((9, 0), 64): dict(fwd_BLOCK_M=64, fwd_BLOCK_N=64, fwd_num_warps=4, fwd_num_stages=3,
                       bwd_BLOCK_M1=32, bwd_BLOCK_N1=64, bwd_BLOCK_M2=64, bwd_BLOCK_N2=32, bwd_num_warps=4, bwd_num_stages=3),
}
"""Torch's default forward tile for Hopper and 64-dim heads (128 x 128, 4 warps) runs the shared rows' masked
attention slower than these tiles, forward and backward, in `benchmarks/kernels/flex_layouts.py --sweep` (figures
in docs/benchmarks.md). Other GPUs and head sizes keep torch's defaults (not measured)."""


@dataclass
class SharedPromptRows(PackedRows):
    """`PackedRows` of prompt groups: (rows, L) ids and position ids restarting at the prompt's length for every
    response, plus each position's segment."""

    segments: torch.Tensor  # (rows, L): group place * GROUP_STRIDE + (PROMPT or the response's number), or PADDING


def prompt_groups(prompt_ids: list[int]) -> list[list[int]]:
    """Row indices grouped by prompt, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for row, prompt in enumerate(prompt_ids):
        groups.setdefault(prompt, []).append(row)
    return list(groups.values())


@dataclass
class PromptLayout:
    """Which prompt each row of a padded batch answers, and its rows' prompt and response lengths, on the host
    (so packing needs no device sync while earlier micro-batches still run)."""

    prompt_ids: list[int]
    prompt_lengths: list[int]
    response_lengths: list[int]

    @classmethod
    def of(cls, attention_mask: torch.Tensor, prompt_width: int, prompt_ids: list[int]) -> "PromptLayout":
        """From the attention mask (one device sync)."""
        lengths = torch.stack((attention_mask[:, :prompt_width].sum(1), attention_mask[:, prompt_width:].sum(1)))
        prompt_lengths, response_lengths = lengths.tolist()
        return cls(list(prompt_ids), prompt_lengths, response_lengths)

    def select(self, rows: list[int]) -> "PromptLayout":
        return PromptLayout(*([values[r] for r in rows] for values in
                              (self.prompt_ids, self.prompt_lengths, self.response_lengths)))


def pack_shared_prompts(input_ids: torch.Tensor, prompt_width: int, layout: PromptLayout, pad_token_id: int = 0,
                        multiple: int = 1) -> SharedPromptRows:
    """Rows of prompt groups from a padded batch (B, P + R) (prompts left-padded, responses right-padded);
    rows with equal prompt ids must hold the same prompt tokens (the first one's are used). Rows are as wide
    as the widest group, rounded up to a multiple of `multiple` tokens (FlexAttention's block: fewer shapes to
    compile for), and a group goes into the first row with room for it, so short groups share rows instead of
    being padded. Index arrays are built on the host with numpy and the tokens gathered on the device."""
    device, batch_width = input_ids.device, input_ids.shape[1]
    p_len, r_len = layout.prompt_lengths, layout.response_lengths
    groups = prompt_groups(layout.prompt_ids)
    widths = [p_len[rows[0]] + sum(r_len[r] for r in rows) for rows in groups]
    width = -(-max(widths) // multiple) * multiple
    # One piece per prompt and per response: (source offset in the flat batch, destination offset in the
    # flat rows, length, first position id, segment, where its group starts); then every token's indices at
    # once. Segment: the group's place in its row * GROUP_STRIDE + 0 for the prompt, k for response k.
    pieces, room, placed = [], [], []  # per row: tokens still free, groups in it
    for rows, group_width in zip(groups, widths):
        row = next((i for i, free in enumerate(room) if free >= group_width), len(room))
        if row == len(room):
            room.append(width)
            placed.append(0)
        p, start, place = p_len[rows[0]], row * width + width - room[row], placed[row]
        group_start, room[row], placed[row] = start, room[row] - group_width, place + 1
        pieces.append((rows[0] * batch_width + prompt_width - p, start, p, 0, place * GROUP_STRIDE, group_start))
        start += p
        for k, r in enumerate(rows, 1):
            pieces.append((r * batch_width + prompt_width, start, r_len[r], p, place * GROUP_STRIDE + k, group_start))
            start += r_len[r]
    source, destination, length, first_position, segment, group_start = (
        np.array(pieces, dtype=np.int64).reshape(-1, 6).T)
    piece = np.repeat(np.arange(len(pieces)), length)
    step = np.arange(piece.size) - np.repeat(np.cumsum(length) - length, length)  # index within the piece
    source, destination = source[piece] + step, destination[piece] + step
    num_rows = len(room)
    positions = np.tile(np.arange(width), num_rows)  # padding continues the count
    segments = np.full(num_rows * width, PADDING, dtype=np.int64)
    positions[destination], segments[destination] = first_position[piece] + step, segment[piece]
    response = segment[piece] % GROUP_STRIDE != PROMPT
    # token t of a response is predicted at the position before it, its first token at the prompt's last
    predicted_at = destination[response] - 1
    first = step[response] == 0
    predicted_at[first] = (group_start[piece[response]] + first_position[piece[response]] - 1)[first]
    target_source = source[response]  # flat index of the response token in the padded batch

    def to_device(values: np.ndarray) -> torch.Tensor:
        return host_to_device(torch.from_numpy(values), device)

    ids = torch.full((num_rows * width,), pad_token_id, dtype=input_ids.dtype, device=device)
    ids[to_device(destination)] = input_ids.flatten()[to_device(source)]
    target_rows, target_columns = target_source // batch_width, target_source % batch_width
    return SharedPromptRows(
        input_ids=ids.view(num_rows, width), position_ids=to_device(positions).view(num_rows, width),
        segments=to_device(segments).view(num_rows, width), logit_positions=to_device(predicted_at),
        targets=input_ids.flatten()[to_device(target_source)],
        response_index=to_device(target_rows * (batch_width - prompt_width) + target_columns - prompt_width),
    )


def visible(segments_q: torch.Tensor, segments_kv: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """May query position q see key position kv (same row)? Causal, and a prompt sees its own earlier tokens,
    a response its group's prompt and its own earlier tokens; padding sees itself only (never nothing, so no
    row of the softmax is empty, and no block of padding against padding is computed)."""
    own_prompt = segments_q - segments_q % GROUP_STRIDE  # padding: -GROUP_STRIDE, which no key has
    is_response = segments_q % GROUP_STRIDE != PROMPT
    return (kv <= q) & (((segments_q == segments_kv) & (segments_q != PADDING)) | (kv == q)
                        | ((segments_kv == own_prompt) & is_response))


def uses_flex_attention(model: torch.nn.Module) -> bool:
    return "flex" in str(getattr(getattr(model, "config", None), "_attn_implementation", "sdpa"))


def head_dim_of(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", 0) or 1
    return getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads


def flex_kernel_options(model: torch.nn.Module, device: torch.device) -> dict:
    """Keyword arguments for the model's forward over shared rows: FlexAttention tiles where measured
    (`TUNED_FLEX_TILES`; transformers hands `kernel_options` to `flex_attention`), else none."""
    if device.type != "cuda" or not uses_flex_attention(model):
        return {}
    tiles = TUNED_FLEX_TILES.get((torch.cuda.get_device_capability(device), head_dim_of(model)))
    return {"kernel_options": dict(tiles)} if tiles else {}


def attention_problem(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why this actor's attention cannot run shared prompts on `device` (one sentence), or None."""
    implementation = str(getattr(getattr(model, "config", None), "_attn_implementation", ""))
    if "flash" in implementation:  # e.g. model.attn_implementation=auto picked it
        return (f"actor.share_prompt_tokens needs an attention that takes a mask, and the actor runs {implementation!r}, "
                "which takes none; set model.attn_implementation=flex_attention (or sdpa).")
    head_dim = head_dim_of(model)
    if "flex" in implementation and device.type == "cuda" and head_dim < 16:
        return (f"FlexAttention on CUDA needs attention heads of at least 16 dimensions and this model's have {head_dim}; "
                "set model.attn_implementation=sdpa for actor.share_prompt_tokens with this model.")
    return None


def shared_block_mask(segments: torch.Tensor):
    """FlexAttention's block mask for shared rows (`visible` between the tokens of each row)."""
    from torch.nn.attention.flex_attention import create_block_mask

    num_rows, length = segments.shape

    def mask_mod(b, h, q, kv):
        return visible(segments[b, q], segments[b, kv], q, kv)

    return create_block_mask(mask_mod, B=num_rows, H=None, Q_LEN=length, KV_LEN=length, device=segments.device)


_COMPILED_BLOCK_MASK = None


def block_mask_builder(device: torch.device):
    """`shared_block_mask`, compiled on CUDA (dynamic shapes, so micro-batches of other sizes reuse it): built
    eagerly, the mask evaluates `visible` through vmap on the host, with the GPU idle, for every micro-batch and
    pass; compiled, it is a few small kernels (`benchmarks/kernels/flex_layouts.py` times both)."""
    global _COMPILED_BLOCK_MASK
    if device.type != "cuda":
        return shared_block_mask
    if _COMPILED_BLOCK_MASK is None:
        _COMPILED_BLOCK_MASK = torch.compile(shared_block_mask, dynamic=True)
    return _COMPILED_BLOCK_MASK


def attention_mask_for(model: torch.nn.Module, rows: SharedPromptRows):
    """The mask the model's attention implementation takes for these rows (transformers passes a 4-D mask,
    dense or block, through unchanged)."""
    implementation = str(getattr(getattr(model, "config", None), "_attn_implementation", "sdpa"))
    segments = rows.segments
    num_rows, length = segments.shape
    if uses_flex_attention(model):
        return block_mask_builder(segments.device)(segments)
    if "flash" in implementation:
        raise ConfigError(f"actor.share_prompt_tokens needs a masked attention; attn_implementation={implementation!r} "
                         "takes none. Use model.attn_implementation=flex_attention (or sdpa).")
    if num_rows * length * length > DENSE_MASK_LIMIT:
        raise ConfigError(f"actor.share_prompt_tokens: {num_rows} rows of {length} tokens need a dense "
                         f"{num_rows}x{length}x{length} attention mask under {implementation!r}; set "
                         "model.attn_implementation=flex_attention (a block mask) or lower actor.max_tokens_per_micro_batch.")
    index = torch.arange(length, device=segments.device)
    dense = visible(segments[:, :, None], segments[:, None, :], index[:, None], index[None, :])[:, None]
    if implementation == "eager":  # eager adds the mask to the scores
        dtype = next(model.parameters()).dtype
        return torch.zeros(dense.shape, dtype=dtype, device=dense.device).masked_fill(~dense, torch.finfo(dtype).min)
    return dense
