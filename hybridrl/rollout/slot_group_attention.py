"""Prefix-shared decode attention with several slots per program (opt-in experiment, not yet timed).

`decode_attention.triton_decode_attention` runs one program per (slot, KV head): the n samples of a prompt
each read the prompt's keys and values, n reads of the same bytes per layer and step (through L2). Here a
program takes `slots` adjacent slots (the engine keeps a prompt's samples next to each other) and stacks
their query rows: Qwen2-0.5B's 7 query heads per KV head give 14 rows for two slots, which fit the 16-row
tile the one-slot kernel pads 7 rows to, so the shared prompt costs one pass of the same matrix products
for both slots: half the prompt reads with 2 slots, a quarter with 4. Each slot's own response keys are
then attended with the other slots' rows masked out. When the slots of a program do not share a prompt
entry (after continuous batching moved them), each slot's prompt is attended the same masked way.

Same contract and reference as `triton_decode_attention` (with `new_kv`, `rope` and `qkv_bias`); checked
against the reference in the interpreter (`tests/test_decode_attention.py`). `benchmarks/decode_attention.py
--slots-per-program 1,2,4` times it against the one-slot kernel.
"""

from __future__ import annotations

import math

import torch

from hybridrl.rollout.decode_attention import BLOCK_N, MIN_DOT_ROWS, NUM_WARPS, _next_power_of_two, launch_arguments

DIAGONAL = False
"""Default of `diagonal`: which of the two ways to attend the slots' own keys the engine uses (not yet timed)."""

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def slot_group_decode_attention(
    q: torch.Tensor,
    prompt_k: torch.Tensor,
    prompt_v: torch.Tensor,
    response_k: torch.Tensor,
    response_v: torch.Tensor,
    prompt_index: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    scale: float,
    new_kv: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    qkv_bias: torch.Tensor | None = None,
    slots: int = 2,
    diagonal: bool | None = None,
    block_n: int | None = None,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """`triton_decode_attention` over a (B / slots, Hkv) grid, `slots` (1, 2 or 4) adjacent slots per program.
    `diagonal`: attend all the slots' response keys (and prompts they do not share) in one loop whose tiles
    hold a block of keys of every slot, masked block-diagonally, instead of one loop per slot (default
    `DIAGONAL`)."""
    if triton is None:
        raise ImportError("slot_group_decode_attention needs the triton package (pip install triton).")
    if slots not in (1, 2, 4):
        raise ValueError(f"slots must be 1, 2 or 4; got {slots}.")
    batch, num_kv_heads, group, head_dim = q.shape
    q, out, fused, cos, sin, bias, strides = launch_arguments(q, prompt_k, prompt_v, response_k, response_v,
                                                              new_kv, rope, qkv_bias)
    _slot_group_kernel[(triton.cdiv(batch, slots), num_kv_heads)](
        q, prompt_k, prompt_v, response_k, response_v, prompt_index, prompt_len, response_len, out, fused,
        cos, sin, bias, scale * math.log2(math.e), batch, *strides,
        GROUP=group, HEAD_DIM=head_dim, SLOTS=slots,
        ROWS_PAD=max(MIN_DOT_ROWS, _next_power_of_two(slots * group)),
        BLOCK_D=max(MIN_DOT_ROWS, _next_power_of_two(head_dim)),
        BLOCK_N=block_n or BLOCK_N, IEEE=q.dtype == torch.float32, WRITE_NEW=new_kv is not None,
        ROPE=rope is not None, HAS_BIAS=rope is not None and qkv_bias is not None,
        DIAGONAL=DIAGONAL if diagonal is None else diagonal,
        num_warps=num_warps,
    )
    return out


slot_group_decode_attention.writes_new_kv = True
slot_group_decode_attention.applies_rope = True


if triton is not None:

    @triton.jit
    def _attend_rows(q, k_base, v_base, length, stride_l, m_i, l_i, acc, qk_scale, rows_on,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Online-softmax update over keys [0, length) for the rows where `rows_on` (ROWS_PAD,) holds; the
        other rows keep their state. m_i in log2 units; a row with no key yet has m_i = -inf."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        for start in range(0, length, BLOCK_N):
            cols = start + offs_n
            kv_mask = (cols[:, None] < length) & (offs_d[None, :] < HEAD_DIM)
            offsets = cols[:, None] * stride_l + offs_d[None, :]
            k = tl.load(k_base + offsets, mask=kv_mask, other=0.0)
            v = tl.load(v_base + offsets, mask=kv_mask, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            visible = rows_on[:, None] & (cols[None, :] < length)
            m_i, l_i, acc = _online_softmax_step(tl.where(visible, scores * qk_scale, float("-inf")), v,
                                                 m_i, l_i, acc, IEEE)
        return m_i, l_i, acc

    @triton.jit
    def _online_softmax_step(scores, v, m_i, l_i, acc, IEEE: tl.constexpr):
        """Fold one tile of masked scores (rows, keys; -inf where hidden) and its values into (m_i, l_i, acc);
        rows with nothing visible yet (m = -inf) stay empty instead of turning NaN."""
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(scores - m_safe[:, None])
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _attend_slots(q, k_base, v_base, key_rows, key_lengths, same_slot, max_length, stride_l,
                      m_i, l_i, acc, qk_scale, KEYS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """`_attend_rows` over all the program's slots at once: a tile holds BLOCK_N keys of each slot (key
        row i: slot i // BLOCK_N, at offset key_rows[i] with length key_lengths[i]) and `same_slot` (rows,
        keys) lets a row see only its own slot's keys: one loop of wider tiles instead of one loop per slot."""
        offs_k = tl.arange(0, KEYS)
        offs_d = tl.arange(0, BLOCK_D)
        for start in range(0, max_length, BLOCK_N):
            pos = start + offs_k % BLOCK_N
            valid = pos < key_lengths
            kv_mask = valid[:, None] & (offs_d[None, :] < HEAD_DIM)
            offsets = key_rows[:, None] + pos[:, None] * stride_l + offs_d[None, :]
            k = tl.load(k_base + offsets, mask=kv_mask, other=0.0)
            v = tl.load(v_base + offsets, mask=kv_mask, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            m_i, l_i, acc = _online_softmax_step(tl.where(same_slot & valid[None, :], scores * qk_scale, float("-inf")),
                                                 v, m_i, l_i, acc, IEEE)
        return m_i, l_i, acc

    @triton.jit
    def _fold_new_key(q, k_new, v_new, m_i, l_i, acc, qk_scale, rows_on):
        """This step's key/value (BLOCK_D,), already stored, folded into the rows where `rows_on` holds."""
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale
        m_new = tl.where(rows_on, tl.maximum(m_i, score), m_i)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(rows_on, tl.math.exp2(m_i - m_safe), 1.0)
        p = tl.where(rows_on, tl.math.exp2(score - m_safe), 0.0)
        return m_new, l_i * alpha + p, acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]

    @triton.jit
    def _rope_rows(x, x_rolled, bias_base, bias_rows, bias_rolled_cols, cos, sin, mask,
                   HAS_BIAS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """x * cos + roll(x) * signed sin in float32 with the bias rows added first; cos/sin broadcast to x."""
        offs_d = tl.arange(0, BLOCK_D)
        x = x.to(tl.float32)
        x_rolled = x_rolled.to(tl.float32)
        if HAS_BIAS:
            x += tl.load(bias_base + bias_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            x_rolled += tl.load(bias_base + bias_rows[:, None] * HEAD_DIM + bias_rolled_cols[None, :], mask=mask,
                                other=0.0).to(tl.float32)
        return x * cos + x_rolled * sin

    @triton.jit
    def _slot_group_kernel(
        Q, PK, PV, RK, RV, PROMPT_INDEX, PROMPT_LEN, RESPONSE_LEN, OUT, NEW_KV, COS, SIN, BIAS, qk_scale, batch,
        stride_qb, stride_qh, stride_qg,
        stride_pe, stride_ph, stride_pl,
        stride_rb, stride_rh, stride_rl,
        stride_ob, stride_oh, stride_og,
        stride_nb, stride_nkv, stride_nh, stride_cb,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SLOTS: tl.constexpr, ROWS_PAD: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WRITE_NEW: tl.constexpr,
        ROPE: tl.constexpr, HAS_BIAS: tl.constexpr, DIAGONAL: tl.constexpr,
    ):
        """SLOTS adjacent slots x one KV head. Row r holds query head r % GROUP of slot first + r // GROUP."""
        first = tl.program_id(0) * SLOTS
        head = tl.program_id(1).to(tl.int64)
        offs_r = tl.arange(0, ROWS_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        local = offs_r // GROUP  # the row's slot within the program (>= SLOTS: padding)
        row_g = offs_r % GROUP
        row_slot = (first + local).to(tl.int64)
        row_live = (local < SLOTS) & (row_slot < batch)
        d_mask = offs_d < HEAD_DIM
        mask = row_live[:, None] & d_mask[None, :]
        rolled = (offs_d + HEAD_DIM // 2) % HEAD_DIM
        q_rows = Q + row_slot * stride_qb + head * stride_qh + row_g * stride_qg
        q = tl.load(q_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
        if ROPE:
            cos = tl.load(COS + row_slot[:, None] * stride_cb + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            sin = tl.load(SIN + row_slot[:, None] * stride_cb + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            q_rolled = tl.load(q_rows[:, None] + rolled[None, :], mask=mask, other=0.0)
            q = _rope_rows(q, q_rolled, BIAS, head * GROUP + row_g, rolled, cos, sin, mask,
                           HAS_BIAS, HEAD_DIM, BLOCK_D).to(Q.dtype.element_ty)  # rounded once
        m_i = tl.full([ROWS_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS_PAD], tl.float32)
        acc = tl.zeros([ROWS_PAD, BLOCK_D], tl.float32)

        # The prompt: one pass for all rows when the program's slots share an entry, else one per slot.
        # (A freed slot keeps its entry but has prompt length 0, so the lengths must match as well.)
        slot_ids = first + tl.arange(0, SLOTS)
        in_batch = slot_ids < batch
        entries = tl.load(PROMPT_INDEX + slot_ids, mask=in_batch, other=-1)
        lengths = tl.load(PROMPT_LEN + slot_ids, mask=in_batch, other=-1)
        entry0 = tl.load(PROMPT_INDEX + first)
        length0 = tl.load(PROMPT_LEN + first).to(tl.int32)
        differ = in_batch & ((entries != entry0) | (lengths != length0))
        if tl.sum(differ.to(tl.int32), 0) == 0:
            base = entry0.to(tl.int64) * stride_pe + head * stride_ph
            m_i, l_i, acc = _attend_rows(q, PK + base, PV + base, length0, stride_pl, m_i, l_i, acc, qk_scale,
                                         row_live, HEAD_DIM, BLOCK_D, BLOCK_N, IEEE)
        elif DIAGONAL:
            key_slot = first + tl.arange(0, SLOTS * BLOCK_N) // BLOCK_N
            key_in = key_slot < batch
            key_entry = tl.load(PROMPT_INDEX + key_slot, mask=key_in, other=0).to(tl.int64)
            key_len = tl.load(PROMPT_LEN + key_slot, mask=key_in, other=0).to(tl.int32)
            same = (row_slot[:, None] == key_slot[None, :]) & row_live[:, None]
            base = head * stride_ph
            m_i, l_i, acc = _attend_slots(q, PK + base, PV + base, key_entry * stride_pe, key_len, same,
                                          tl.max(key_len, 0), stride_pl, m_i, l_i, acc, qk_scale,
                                          SLOTS * BLOCK_N, HEAD_DIM, BLOCK_D, BLOCK_N, IEEE)
        else:
            for s in tl.static_range(SLOTS):
                if first + s < batch:
                    base = tl.load(PROMPT_INDEX + first + s).to(tl.int64) * stride_pe + head * stride_ph
                    m_i, l_i, acc = _attend_rows(q, PK + base, PV + base,
                                                 tl.load(PROMPT_LEN + first + s).to(tl.int32), stride_pl,
                                                 m_i, l_i, acc, qk_scale, row_live & (local == s),
                                                 HEAD_DIM, BLOCK_D, BLOCK_N, IEEE)

        # Each slot's response keys (DIAGONAL: all slots in one loop), then (WRITE_NEW) the key/value of this
        # step, for that slot's rows only.
        if DIAGONAL:
            key_slot = first + tl.arange(0, SLOTS * BLOCK_N) // BLOCK_N
            key_in = key_slot < batch
            key_len = tl.load(RESPONSE_LEN + key_slot, mask=key_in, other=0).to(tl.int32) - (1 if WRITE_NEW else 0)
            same = (row_slot[:, None] == key_slot[None, :]) & row_live[:, None]
            base = head * stride_rh
            m_i, l_i, acc = _attend_slots(q, RK + base, RV + base, key_slot.to(tl.int64) * stride_rb, key_len,
                                          same, tl.max(key_len, 0), stride_rl, m_i, l_i, acc, qk_scale,
                                          SLOTS * BLOCK_N, HEAD_DIM, BLOCK_D, BLOCK_N, IEEE)
        for s in tl.static_range(SLOTS):
            slot = (first + s).to(tl.int64)
            if slot < batch:
                rows_on = row_live & (local == s)
                response = slot * stride_rb + head * stride_rh
                response_len = tl.load(RESPONSE_LEN + slot).to(tl.int32)
                cached = response_len - 1 if WRITE_NEW else response_len
                if not DIAGONAL:
                    m_i, l_i, acc = _attend_rows(q, RK + response, RV + response, cached, stride_rl,
                                                 m_i, l_i, acc, qk_scale, rows_on, HEAD_DIM, BLOCK_D, BLOCK_N, IEEE)
                if WRITE_NEW:
                    new = NEW_KV + slot * stride_nb + head * stride_nh
                    write = cached >= 0
                    new_mask = d_mask & write
                    k_new = tl.load(new + offs_d, mask=new_mask, other=0.0)
                    v_new = tl.load(new + stride_nkv + offs_d, mask=new_mask, other=0.0)
                    if ROPE:
                        num_heads = tl.num_programs(1) * GROUP
                        one = tl.arange(0, 1)
                        one_mask = (one[:, None] < 1) & new_mask[None, :]
                        k_cos = tl.load(COS + slot * stride_cb + offs_d, mask=d_mask, other=0.0).to(tl.float32)
                        k_sin = tl.load(SIN + slot * stride_cb + offs_d, mask=d_mask, other=0.0).to(tl.float32)
                        k_rolled = tl.load(new + rolled, mask=new_mask, other=0.0)
                        k_new = tl.sum(_rope_rows(k_new[None, :], k_rolled[None, :], BIAS, num_heads + head + one * 0,
                                                  rolled, k_cos[None, :], k_sin[None, :], one_mask,
                                                  HAS_BIAS, HEAD_DIM, BLOCK_D), 0).to(RK.dtype.element_ty)
                        if HAS_BIAS:
                            v_bias = BIAS + (num_heads + tl.num_programs(1) + head) * HEAD_DIM
                            v_new = (v_new.to(tl.float32) + tl.load(v_bias + offs_d, mask=d_mask, other=0.0)
                                     .to(tl.float32)).to(RV.dtype.element_ty)
                    at = cached.to(tl.int64) * stride_rl
                    tl.store(RK + response + at + offs_d, k_new, mask=new_mask)
                    tl.store(RV + response + at + offs_d, v_new, mask=new_mask)
                    m_i, l_i, acc = _fold_new_key(q, k_new, v_new, m_i, l_i, acc, qk_scale, rows_on & write)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + row_slot[:, None] * stride_ob + head * stride_oh + row_g[:, None] * stride_og
                 + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=mask)
