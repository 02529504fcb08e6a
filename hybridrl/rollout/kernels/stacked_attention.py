"""Stacked decode attention over the prefix-shared KV cache: a prompt kernel per entry, a response kernel per slot.

Same inputs and answer as `decode_attention.reference_decode_attention` (the oracle), plus one table:
    entry_slots (entries, width) int32   the live slots whose prompt sits in each entry, -1 padded
where width is the most samples that can share an entry at once (min(n, slots)). It is built on the
host by `entry_slot_table` at every sync point and copied into a tensor whose address never changes,
so a captured CUDA graph replays with the current table.

Why two kernels: the one-kernel version (`decode_attention.py`) runs one program per (slot, KV head),
so the n samples of a prompt each read its prompt KV (hoping for L2 hits) and each program has only
`group` query rows (7 at Qwen2-0.5B, padded to 16 for `tl.dot`). Here
1. the prompt kernel runs one program per (entry, KV head): it stacks the query rows of every slot in
   the entry's row of `entry_slots` (width x group rows, 8 x 7 = 56 padded to 64 at n = 8) and runs
   one online softmax over the entry's prompt keys, so the prompt is read from HBM once by
   construction. It writes each row's unnormalised float32 accumulator, running max (log2 units) and
   sum to scratch indexed by (slot, KV head, row);
2. the response kernel runs one program per (slot, KV head): it starts from that slot's partials and
   continues the same online softmax over the slot's response keys, which is exactly the log-sum-exp
   merge of the two parts (the rescale by exp2(m_old - m_new) is the merge), then normalises.
Both reuse `decode_attention._attend` (the block loop), so the arithmetic is the one-kernel kernel's.

Contract (the engine keeps it): every slot < B with prompt_len > 0 appears in the row of its
`prompt_index`, and all slots of an entry have the same prompt_len (the entry's length is read from
them). A slot with prompt_len 0 (idle, or a free slot parked at position 0) skips the partials and
starts from an empty softmax, so stale scratch is never read; an entry with no live slot has no rows
and reads no keys. Grids depend only on (entries, B), block sizes are fixed, nothing is autotuned,
float32 statistics, IEEE matmuls for float32 inputs: graph-safe, as `decode_attention.py` explains.

`stacked_reference_attention` is the same two-phase computation in PyTorch (float32), reading the
table as the kernels do. It is the engine's attention for `attention="triton-stacked"` on CPU, so
the CPU engine tests check the table bookkeeping too (the plain reference ignores it).
"""

from __future__ import annotations

import math

import torch

from hybridrl.rollout.kernels import decode_attention
from hybridrl.rollout.kernels.decode_attention import MIN_DOT_ROWS, _next_power_of_two

BLOCK_N = 64
"""Keys per loop iteration for 2-byte dtypes (float32 uses half), as measured in its one H200 run."""

MAX_STACKED_ROWS = 256
"""Most query rows one prompt program stacks (n x group, padded to a power of two). Compiled for sm_90, 256
float32 rows of head_dim 128 take 225 KiB of shared memory, just under the H200's 227 KiB per block."""

triton = decode_attention.triton
if triton is not None:
    import triton.language as tl


def entry_slot_table(slot_entries: dict[int, int], num_entries: int, width: int) -> torch.Tensor:
    """(num_entries, width) int32 on the host: row e lists the slots whose prompt is in entry e, ascending, -1 padded.

    slot_entries maps each live slot to its entry. More than `width` slots on one entry is a bookkeeping
    error (an entry serves the samples of one prompt), hence an assert."""
    table = torch.full((num_entries, width), -1, dtype=torch.int32)
    filled = [0] * num_entries
    for slot in sorted(slot_entries):
        entry = slot_entries[slot]
        assert filled[entry] < width, f"entry {entry} has more than {width} live slots"
        table[entry, filled[entry]] = slot
        filled[entry] += 1
    return table


def stacked_constants(group: int, head_dim: int, width: int, element_size: int) -> tuple[dict, dict]:
    """Compile-time constants of (prompt kernel, response kernel); shared with the ahead-of-time compile test.

    Warps grow with the stacked rows so the (rows, head_dim) float32 accumulator stays at <= 64 registers a thread
    up to head_dim 128 (a guess at a sane split, not tuned on a GPU)."""
    block_d = max(MIN_DOT_ROWS, _next_power_of_two(head_dim))
    block_n = BLOCK_N if element_size <= 2 else BLOCK_N // 2
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, IEEE=element_size == 4)
    rows_pad = stacked_rows(width, group)
    if rows_pad > MAX_STACKED_ROWS:
        raise ValueError(f"attention='triton-stacked' stacks n x group query rows per prompt program: {width} x "
                         f"{group} = {width * group} rows exceed {MAX_STACKED_ROWS}; use attention='triton' "
                         f"(rollout.attention=triton) or fewer samples per prompt.")
    prompt = dict(common, WIDTH=width, ROWS_PAD=rows_pad, num_warps=4 if rows_pad <= 64 else 8)
    response = dict(common, GROUP_PAD=max(MIN_DOT_ROWS, _next_power_of_two(group)), num_warps=4)
    return prompt, response


def stacked_rows(width: int, group: int) -> int:
    """Query rows one prompt program stacks for `width` samples of a prompt, padded for `tl.dot`."""
    return max(MIN_DOT_ROWS, _next_power_of_two(width * group))


def stacked_decode_attention(
    q: torch.Tensor,
    prompt_k: torch.Tensor,
    prompt_v: torch.Tensor,
    response_k: torch.Tensor,
    response_v: torch.Tensor,
    prompt_index: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    scale: float,
    entry_slots: torch.Tensor,
    new_kv: torch.Tensor | None = None,
    block_n: int | None = None,
    prompt_warps: int | None = None,
    response_warps: int | None = None,
) -> torch.Tensor:
    """Launch the prompt kernel over (entries, Hkv), then the response kernel over (B, Hkv); returns (B, Hkv, group, D).
    `new_kv` (B, 2, Hkv, D): stored and attended by the response kernel, as in `triton_decode_attention`.
    `block_n`, `prompt_warps`, `response_warps` override the launch configuration of `stacked_constants`
    (what `benchmarks/decode_attention.py --stacked` sweeps)."""
    if triton is None:
        raise ImportError("stacked_decode_attention needs the triton package (pip install triton); "
                          "use attention='sdpa' or the reference on machines without it.")
    batch, num_kv_heads, group, head_dim = q.shape
    assert prompt_k.stride() == prompt_v.stride() and response_k.stride() == response_v.stride()
    assert prompt_k.stride(-1) == 1 and response_k.stride(-1) == 1, "head_dim must be contiguous"
    assert entry_slots.dtype == torch.int32 and entry_slots.is_contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    partial_acc = torch.empty(batch, num_kv_heads, group, head_dim, dtype=torch.float32, device=q.device)
    partial_max = torch.empty(batch, num_kv_heads, group, dtype=torch.float32, device=q.device)  # log2 units
    partial_sum = torch.empty_like(partial_max)
    out = torch.empty_like(q)  # (B, Hkv, group, D)
    if new_kv is not None:
        assert new_kv.shape == (batch, 2, num_kv_heads, head_dim) and new_kv.stride(-1) == 1
    fused = new_kv if new_kv is not None else out  # a placeholder pointer when nothing is written
    qk_scale = scale * math.log2(math.e)
    prompt_constants, response_constants = stacked_constants(group, head_dim, entry_slots.shape[1], q.element_size())
    for constants, warps in ((prompt_constants, prompt_warps), (response_constants, response_warps)):
        constants.update({key: value for key, value in (("BLOCK_N", block_n), ("num_warps", warps)) if value})
    _stacked_prompt_kernel[(entry_slots.shape[0], num_kv_heads)](
        q, prompt_k, prompt_v, entry_slots, prompt_len, partial_acc, partial_max, partial_sum, qk_scale, batch,
        q.stride(0), q.stride(1), q.stride(2),
        prompt_k.stride(0), prompt_k.stride(1), prompt_k.stride(2),
        **prompt_constants,
    )
    _stacked_response_kernel[(batch, num_kv_heads)](
        q, response_k, response_v, prompt_len, response_len, partial_acc, partial_max, partial_sum, out, fused,
        qk_scale,
        q.stride(0), q.stride(1), q.stride(2),
        response_k.stride(0), response_k.stride(1), response_k.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        fused.stride(0), fused.stride(1), fused.stride(2),
        WRITE_NEW=new_kv is not None, **response_constants,
    )
    return out


def _rescale(running_max: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """exp(running_max - new_max), and 0 where the running part is empty (-inf), never NaN."""
    return torch.where(running_max == float("-inf"), 0.0, torch.exp(running_max - new_max.clamp(min=-1e30)))


def _softmax_partials(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised softmax partials of float32 q (N, H, R, D) over keys (N, H, L, D) [0, lengths) (N,):
    accumulator (N, H, R, D), max (N, H, R) (-inf where no key), sum (N, H, R)."""
    scores = (q @ keys.transpose(-1, -2)) * scale  # (N, H, R, L)
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] < lengths[:, None]  # (N, L)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    running_max = scores.amax(-1)
    weights = _rescale(scores, running_max[..., None])
    return weights @ values, running_max, weights.sum(-1)


def stacked_reference_attention(
    q: torch.Tensor,
    prompt_k: torch.Tensor,
    prompt_v: torch.Tensor,
    response_k: torch.Tensor,
    response_v: torch.Tensor,
    prompt_index: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    scale: float,
    entry_slots: torch.Tensor,
    new_kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """The two kernels' computation in PyTorch (float32): prompt partials per entry from `entry_slots`, merged per
    slot; `new_kv` is written to the response cache first (`decode_attention.write_new_kv`), then visible."""
    batch, num_kv_heads, group, head_dim = q.shape
    if new_kv is not None:
        decode_attention.write_new_kv(response_k, response_v, response_len, new_kv)
    num_entries, width = entry_slots.shape
    slots = entry_slots.long()  # (E, W)
    member = (slots >= 0) & (slots < batch)
    gathered = torch.where(member, slots, 0)
    stacked = q.float()[gathered].transpose(1, 2).reshape(num_entries, num_kv_heads, width * group, head_dim)
    entry_len = torch.where(member, prompt_len[gathered], 0).amax(1)  # (E,)
    acc, running_max, total = _softmax_partials(stacked, prompt_k.float(), prompt_v.float(), entry_len, scale)
    # Scatter the stacked rows back to (slot, KV head, row); slots outside the table keep an empty softmax.
    slot_acc = q.new_zeros(batch, num_kv_heads, group, head_dim, dtype=torch.float32)
    slot_max = q.new_full((batch, num_kv_heads, group), float("-inf"), dtype=torch.float32)
    slot_sum = q.new_zeros(batch, num_kv_heads, group, dtype=torch.float32)
    entry_ids, columns = member.nonzero(as_tuple=True)
    member_slots = slots[entry_ids, columns]

    def rows(stacked_rows: torch.Tensor) -> torch.Tensor:  # (E, H, W * group, ...) -> (members, H, group, ...)
        return stacked_rows.unflatten(2, (width, group))[entry_ids, :, columns]

    slot_acc[member_slots], slot_max[member_slots], slot_sum[member_slots] = rows(acc), rows(running_max), rows(total)
    has_prompt = (prompt_len[:batch] > 0)[:, None, None]  # as the response kernel: idle slots skip the partials
    slot_max = torch.where(has_prompt, slot_max, float("-inf"))
    slot_acc, slot_sum = slot_acc * has_prompt[..., None], slot_sum * has_prompt
    # Response part and the log-sum-exp merge.
    r_acc, r_max, r_sum = _softmax_partials(q.float(), response_k[:batch].float(), response_v[:batch].float(),
                                            response_len[:batch], scale)
    new_max = torch.maximum(slot_max, r_max)
    old, new = _rescale(slot_max, new_max), _rescale(r_max, new_max)
    total = slot_sum * old + r_sum * new
    acc = slot_acc * old[..., None] + r_acc * new[..., None]
    return (acc / torch.where(total > 0, total, 1.0)[..., None]).to(q.dtype)


stacked_decode_attention.writes_new_kv = True  # both take `new_kv`: the engine leaves the cache write to them
stacked_reference_attention.writes_new_kv = True

if triton is not None:
    _attend, _attend_new, _load_new = decode_attention._attend, decode_attention._attend_new, decode_attention._load_new

    @triton.jit
    def _stacked_prompt_kernel(
        Q, PK, PV, ENTRY_SLOTS, PROMPT_LEN, PART_ACC, PART_MAX, PART_SUM, qk_scale, batch,
        stride_qb, stride_qh, stride_qg,
        stride_pe, stride_ph, stride_pl,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr, WIDTH: tl.constexpr, ROWS_PAD: tl.constexpr,
    ):
        """One (entry, KV head): the stacked query rows of the entry's slots over its prompt keys, once.

        Row r is query head r % GROUP of the slot in column r // GROUP of the entry's table row."""
        entry = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        offs_r = tl.arange(0, ROWS_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        column, g = offs_r // GROUP, offs_r % GROUP
        slot = tl.load(ENTRY_SLOTS + entry * WIDTH + column, mask=column < WIDTH, other=-1)  # (ROWS_PAD,)
        live = (slot >= 0) & (slot < batch)
        slot = tl.where(live, slot, 0).to(tl.int64)
        length = tl.max(tl.where(live, tl.load(PROMPT_LEN + slot, mask=live, other=0), 0), 0).to(tl.int32)
        row_mask = live[:, None] & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + slot[:, None] * stride_qb + head * stride_qh + g[:, None] * stride_qg + offs_d[None, :],
                    mask=row_mask, other=0.0)  # (ROWS_PAD, BLOCK_D); rows of absent slots are zeros
        m_i = tl.full([ROWS_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS_PAD], tl.float32)
        acc = tl.zeros([ROWS_PAD, BLOCK_D], tl.float32)
        prompt = entry * stride_pe + head * stride_ph
        m_i, l_i, acc = _attend(q, PK + prompt, PV + prompt, length, stride_pl, m_i, l_i, acc, qk_scale,
                                HEAD_DIM, BLOCK_D, BLOCK_N, IEEE)
        partial = (slot * tl.num_programs(1) + head) * GROUP + g  # (ROWS_PAD,) index into (B, Hkv, GROUP)
        tl.store(PART_MAX + partial, m_i, mask=live)
        tl.store(PART_SUM + partial, l_i, mask=live)
        tl.store(PART_ACC + partial[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask)

    @triton.jit
    def _stacked_response_kernel(
        Q, RK, RV, PROMPT_LEN, RESPONSE_LEN, PART_ACC, PART_MAX, PART_SUM, OUT, NEW_KV, qk_scale,
        stride_qb, stride_qh, stride_qg,
        stride_rb, stride_rh, stride_rl,
        stride_ob, stride_oh, stride_og,
        stride_nb, stride_nkv, stride_nh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr, GROUP_PAD: tl.constexpr, WRITE_NEW: tl.constexpr,
    ):
        """One (slot, KV head): continue from the prompt partials over the response keys, then normalise.
        With WRITE_NEW the last response key comes from NEW_KV (stored and attended from registers)."""
        slot = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        row_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + slot * stride_qb + head * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :],
                    mask=row_mask, other=0.0)  # (GROUP_PAD, BLOCK_D)
        has_prompt = tl.load(PROMPT_LEN + slot) > 0  # else the partials were not written this step: stale
        rows = offs_g < GROUP
        partial = (slot * tl.num_programs(1) + head) * GROUP + offs_g  # (GROUP_PAD,)
        m_i = tl.load(PART_MAX + partial, mask=rows & has_prompt, other=float("-inf"))
        l_i = tl.load(PART_SUM + partial, mask=rows & has_prompt, other=0.0)
        acc = tl.load(PART_ACC + partial[:, None] * HEAD_DIM + offs_d[None, :], mask=row_mask & has_prompt, other=0.0)
        response = slot * stride_rb + head * stride_rh
        response_len = tl.load(RESPONSE_LEN + slot).to(tl.int32)
        cached = response_len - 1 if WRITE_NEW else response_len
        m_i, l_i, acc = _attend(q, RK + response, RV + response, cached,
                                stride_rl, m_i, l_i, acc, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, IEEE)
        if WRITE_NEW:
            k_new, v_new = _load_new(NEW_KV + slot * stride_nb + head * stride_nh, stride_nkv, cached >= 0,
                                     HEAD_DIM, BLOCK_D)
            m_i, l_i, acc = _attend_new(q, RK + response, RV + response, k_new, v_new, stride_rl, cached,
                                        m_i, l_i, acc, qk_scale, HEAD_DIM, BLOCK_D)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i == 0 only when the slot sees no key: zeros
        tl.store(OUT + slot * stride_ob + head * stride_oh + offs_g[:, None] * stride_og + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_mask)
