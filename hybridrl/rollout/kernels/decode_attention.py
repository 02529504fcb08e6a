"""Decode attention over a prefix-shared KV cache: a Triton kernel and the PyTorch reference it must equal.

Layout, per layer (what `kv_cache.PrefixSharedKVCache` holds):
    prompt_k, prompt_v      (entries, Hkv, prompt_max_len, D)    each distinct live prompt's KV, once
    response_k, response_v  (slots, Hkv, response_max_len, D)   each sequence's own response KV
A decode query of slot b attends to `prompt_k[prompt_index[b], :, :prompt_len[b]]` followed by
`response_k[b, :, :response_len[b]]`. Those are exactly the keys the per-slot layout holds at
positions [0, prompt_len + response_len), so the result is the same attention; what changes is that
the n samples of a prompt no longer each carry (and each read from HBM) a copy of its KV.

Both implementations take the same arguments: q (B, Hkv, group, D) with the `group` query heads of
one KV head folded together (GQA, no repeated keys); prompt_index, prompt_len, response_len (B,)
integer device tensors; `scale` the softmax scale. They return (B, Hkv, group, D) in q's dtype.
Optional `new_kv` (B, 2, Hkv, D): this step's keys and values, which both store at response index
`response_len - 1` before that key counts as visible (a slot with `response_len` 0 stores nothing), so
the engine needs no cache-write kernel of its own.
Optional `rope` (cos, signed sin), each (B, D), with `new_kv`: q and new_kv are the raw projections
(plus `qkv_bias` (H*D + 2*Hkv*D,) when the model has one), and the attention adds the bias and applies
RoPE to q and the new key itself (`rotate_projections`), in float32, rounding once to q's dtype. With
q/k/v fused into one matmul, the decode step then needs no RoPE kernel: q and new_kv are views of that
matmul's output.

- `reference_decode_attention`: gather + concatenate + masked float32 softmax in plain PyTorch. It is
  the oracle of the tests and the engine's attention on CPU (or wherever Triton cannot run).
- `triton_decode_attention`: one program per (slot, KV head), online softmax (float32 running max,
  sum and accumulator; exp2 with the scale folded into log2 units) over the prompt part, then the
  response part, each looping only to that slot's own length, read on the device. Responses longer
  than `decode_launch.SPLIT_KEYS` are split over several programs per (slot, KV head) whose partial
  states a second kernel combines (split-KV), in both layouts by one rule. The grid depends only on
  shapes (B and the response capacity; `decode_launch.py` makes the plan), so a launch has no host
  sync and can be captured in a CUDA graph. Query rows are padded to at least 16 (`tl.dot`'s minimum); padded rows
  are zeros, so their scores are 0, never NaN, and are not stored. Every block the loops visit holds
  at least one visible key (a block starts below the length), so the running max is always finite
  and no fully masked block is ever reduced. A slot with no visible key at all gets zeros.
  Float32 inputs use `input_precision="ieee"` for both matmuls (TF32 would break the float32
  tests on GPU); bf16/fp16 inputs multiply P (cast to the value dtype) by V as flash attention does.

Why this grid: slots of one prompt are adjacent (admission is prompt-major, lowest free slot first)
and the slot is the fastest-varying grid axis, so the n programs that read one prompt entry (for one
KV head) are launched back to back and their repeated reads of it can hit L2 instead of HBM. After
continuous batching has refilled freed slots, samples of one prompt can be scattered; the result is
still right, only that reuse is lost.

Sliding windows are not applied here: the engine refuses prompt + max_new_tokens longer than the
model's window (in both layouts), so inside the engine a window never hides a key.

Triton is optional: without it `triton` is None here, the reference still works and
`triton_decode_attention` raises ImportError. `TRITON_INTERPRET=1` must be set before this module is
first imported for the kernel to run on CPU tensors (the kernel is built at import time).
"""

from __future__ import annotations

import math

import torch

from hybridrl.rollout.kernels.decode_launch import combine_chunk, launch_arguments, launch_plan, partial_state

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below is all there is
    triton = None

def reference_decode_attention(
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
) -> torch.Tensor:
    """Plain-PyTorch prefix-shared decode attention, computed in float32 (see the module docstring)."""
    batch = q.shape[0]
    if rope is not None:
        q, new_kv = rotate_projections(q, new_kv, *rope, qkv_bias)
    if new_kv is not None:
        write_new_kv(response_k, response_v, response_len, new_kv)
    prompt_max = prompt_k.shape[2]
    keys = torch.cat((prompt_k[prompt_index], response_k[:batch]), dim=2).float()  # (B, Hkv, Lp + Lr, D)
    values = torch.cat((prompt_v[prompt_index], response_v[:batch]), dim=2).float()
    position = torch.arange(keys.shape[2], device=q.device)[None, :]  # (1, Lp + Lr)
    visible = torch.where(position < prompt_max, position < prompt_len[:, None],
                          position - prompt_max < response_len[:, None])  # (B, Lp + Lr)
    scores = (q.float() @ keys.transpose(-1, -2)) * scale  # (B, Hkv, group, Lp + Lr)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # no visible key: zeros, as the kernel gives
    return (weights @ values).to(q.dtype)


def write_new_kv(response_k: torch.Tensor, response_v: torch.Tensor, response_len: torch.Tensor,
                 new_kv: torch.Tensor) -> None:
    """The references' cache write: this step's keys/values (B, 2, Hkv, D) at response index
    response_len - 1 of slots 0..B-1, which then count as visible; a slot without response tokens writes
    nothing (as the kernels)."""
    batch = new_kv.shape[0]
    slots, write_at = torch.arange(batch, device=new_kv.device), (response_len[:batch] - 1).clamp(min=0)
    live = (response_len[:batch] > 0)[:, None, None]
    response_k[slots, :, write_at] = torch.where(live, new_kv[:, 0], response_k[slots, :, write_at])
    response_v[slots, :, write_at] = torch.where(live, new_kv[:, 1], response_v[slots, :, write_at])


def rotate_projections(q: torch.Tensor, new_kv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                       qkv_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw projections -> what attention reads: bias added, RoPE on q (B, Hkv, group, D) and the new key of
    new_kv (B, 2, Hkv, D), as x * cos + roll(x, D/2) * signed sin (cos, sin (B, D)); float32, rounded once."""
    _, num_kv_heads, group, head_dim = q.shape
    q32, kv32 = q.float(), new_kv.float()
    if qkv_bias is not None:
        bias = qkv_bias.float().view(-1, head_dim)  # rows: the q heads, then the k heads, then the v heads
        q32 = q32 + bias[: num_kv_heads * group].view(num_kv_heads, group, head_dim)
        kv32 = kv32 + bias[num_kv_heads * group:].view(2, num_kv_heads, head_dim)
    cos, sin = cos.float()[:, None, None, :], sin_signed.float()[:, None, None, :]

    def rotated(x: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(head_dim // 2, dims=-1) * sin

    return rotated(q32).to(q.dtype), torch.cat((rotated(kv32[:, :1]), kv32[:, 1:]), dim=1).to(new_kv.dtype)


def triton_decode_attention(
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
    paged: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Launch the Triton kernel over a (B, Hkv, splits) grid (`decode_launch.launch_plan`); same contract as
    `reference_decode_attention`.

    paged = (block_size, prompt_columns): the paged layout (`paged_attention.py`), where prompt_k is response_k is
    the block pool (blocks, Hkv, block_size, D) and `prompt_index` is the block table (B, columns): a slot's
    prompt key p lies in block table[b, p // block_size], its response key r in table[b, prompt_columns +
    r // block_size], at offset (p or r) % block_size.

    Long responses (capacity over `decode_launch.SPLIT_KEYS`: response_max_len here, the table's response columns
    times block_size when paged) run split-KV: program (b, h, s) attends to response keys [s * split_len,
    (s + 1) * split_len) (split 0 also to the prompt and the new key; in a narrow batch,
    `decode_launch.balanced_splits`: instead, the slot's own prompt and response keys shared out evenly in whole key
    blocks, read on the device) and leaves its partial softmax state in a float32 buffer, which a second kernel
    combines."""
    if triton is None:
        raise ImportError("triton_decode_attention needs the triton package (pip install triton); "
                          "use attention='sdpa' or the reference on machines without it.")
    batch, num_kv_heads, group, head_dim = q.shape
    block_size, prompt_columns = paged or (1, 0)
    capacity = (prompt_index.shape[1] - prompt_columns) * block_size if paged else response_k.shape[2]
    plan = launch_plan(group, head_dim, capacity, paged is not None, slot_heads=batch * num_kv_heads)
    q, out, fused, cos, sin, bias, strides = launch_arguments(q, prompt_k, prompt_v, response_k, response_v,
                                                              new_kv, rope, qkv_bias)
    table_stride = prompt_index.stride(0) if paged else 0
    part_acc, part_ml = partial_state(plan, batch, num_kv_heads, out)
    sizes = dict(GROUP=group, HEAD_DIM=head_dim, GROUP_PAD=plan.group_pad, BLOCK_D=plan.block_d,
                 NUM_SPLITS=plan.num_splits, WRITE_NEW=new_kv is not None, BALANCED=plan.balanced,
                 BLOCK_N=plan.block_n)
    _decode_attention_kernel[(batch, num_kv_heads, plan.num_splits)](
        q, prompt_k, prompt_v, response_k, response_v, prompt_index, prompt_len, response_len, out, fused,
        cos, sin, bias, scale * math.log2(math.e), *strides, table_stride, prompt_columns, part_acc, part_ml,
        plan.split_len, IEEE=q.dtype == torch.float32, ROPE=rope is not None,
        HAS_BIAS=rope is not None and qkv_bias is not None, PAGED=paged is not None, BLOCK_SIZE=block_size,
        ONE_BLOCK=paged is not None and plan.one_block(block_size), num_warps=plan.num_warps, **sizes)
    if plan.num_splits > 1:
        chunk = combine_chunk(plan.num_splits, group, plan.block_d)
        if chunk:
            _combine_all_splits_kernel[(batch, num_kv_heads, plan.block_d // chunk)](
                part_acc, part_ml, prompt_len, response_len, out, *out.stride()[:3], plan.split_len,
                ROWS=1 << (group - 1).bit_length(), SPLITS_PAD=1 << (plan.num_splits - 1).bit_length(),
                CHUNK_D=chunk, **sizes)
        else:
            _combine_splits_kernel[(batch, num_kv_heads)](part_acc, part_ml, prompt_len, response_len, out,
                                                          *out.stride()[:3], plan.split_len, **sizes)
    return out


if triton is not None:

    @triton.jit
    def _attend(q, k_base, v_base, begin, length, stride_l, m_i, l_i, acc, qk_scale, table, stride_block,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, ONE_BLOCK: tl.constexpr):
        """Online-softmax update of (m_i, l_i, acc) over keys [begin, length) of one (entry or slot, KV head).

        q (GROUP_PAD, BLOCK_D); m_i, l_i (GROUP_PAD,) float32 in log2 units; acc (GROUP_PAD, BLOCK_D) float32.
        PAGED: key i lies in block table[i // BLOCK_SIZE] (k_base then points at the pool's head), row i % BLOCK_SIZE.
        ONE_BLOCK (`LaunchPlan.one_block`: each iteration's keys share one block): one block id per iteration, loaded
        one iteration ahead so the key loads need not wait for it, and consecutive rows in that block, which the
        compiler sees as contiguous.
        """
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        if PAGED and ONE_BLOCK:  # the first iteration's block id, before the loop
            block = tl.load(table + begin // BLOCK_SIZE, mask=begin < length, other=0).to(tl.int64)
        for start in range(begin, length, BLOCK_N):  # device-side bound: only the slot's own keys are read
            cols = start + offs_n
            kv_mask = (cols[:, None] < length) & (offs_d[None, :] < HEAD_DIM)
            if PAGED and ONE_BLOCK:  # this iteration's block id came with the last one; fetch the next one's
                rows = block * stride_block + ((start % BLOCK_SIZE) + offs_n).to(tl.int64) * stride_l
                ahead = start + BLOCK_N
                block = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < length, other=0).to(tl.int64)
            else:
                rows = _key_rows(cols, length, stride_l, table, stride_block, PAGED, BLOCK_SIZE)
            offsets = rows[:, None] + offs_d[None, :]
            k = tl.load(k_base + offsets, mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
            v = tl.load(v_base + offsets, mask=kv_mask, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            # Column `start` is visible, so every row's max below is finite (padded rows score 0).
            scores = tl.where(cols[None, :] < length, scores * qk_scale, float("-inf"))  # (GROUP_PAD, BLOCK_N)
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.math.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf)
            p = tl.math.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _key_rows(cols, length, stride_l, table, stride_block, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """Offsets of keys `cols` from their head's base: contiguous rows, or (PAGED, block sizes that `BLOCK_N` does
        not divide) one block id per key through the block table, in int64 (a pool spans more elements than int32
        counts)."""
        if PAGED:
            blocks = tl.load(table + cols // BLOCK_SIZE, mask=cols < length, other=0).to(tl.int64)
            rows = blocks * stride_block + (cols % BLOCK_SIZE).to(tl.int64) * stride_l
        else:
            rows = cols * stride_l
        return rows

    @triton.jit
    def _load_new(new, stride_nkv, write, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """This step's key and value of one (slot, KV head) as stored: `new`, `new + stride_nkv` (BLOCK_D,)."""
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = (offs_d < HEAD_DIM) & write
        return tl.load(new + offs_d, mask=d_mask, other=0.0), tl.load(new + stride_nkv + offs_d, mask=d_mask, other=0.0)

    @triton.jit
    def _rotated(base, row_offsets, bias, bias_rows, cos, sin, mask,
                 HAS_BIAS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """Rows (R, BLOCK_D) of raw projections at base + row_offsets, bias rows added, RoPE'd in float32:
        x * cos + roll(x, D/2) * signed sin (`rotate_projections`); the roll is a second load."""
        offs_d = tl.arange(0, BLOCK_D)
        rolled = (offs_d + HEAD_DIM // 2) % HEAD_DIM
        x = tl.load(base + row_offsets[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        x_rolled = tl.load(base + row_offsets[:, None] + rolled[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(bias + bias_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            x_rolled += tl.load(bias + bias_rows[:, None] * HEAD_DIM + rolled[None, :], mask=mask,
                                other=0.0).to(tl.float32)
        return x * cos[None, :] + x_rolled * sin[None, :]

    @triton.jit
    def _attend_new(q, k_base, v_base, k_new, v_new, stride_l, cached, m_i, l_i, acc, qk_scale, table, stride_block,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """This step's key and value (BLOCK_D,) (see `_load_new`): stored at index `cached` of one slot's
        response cache (k_base, v_base) and folded into (m_i, l_i, acc) from registers, so the program
        never reads what it writes. A slot with no response token (cached = -1) writes and adds nothing."""
        offs_d = tl.arange(0, BLOCK_D)
        write = cached >= 0
        d_mask = (offs_d < HEAD_DIM) & write
        if PAGED:  # the row through the block table (cached clamped: a slot that writes nothing reads entry 0)
            row = tl.maximum(cached, 0)
            at = tl.load(table + row // BLOCK_SIZE).to(tl.int64) * stride_block + (row % BLOCK_SIZE).to(tl.int64) * stride_l
        else:
            at = cached.to(tl.int64) * stride_l
        tl.store(k_base + at + offs_d, k_new, mask=d_mask)
        tl.store(v_base + at + offs_d, v_new, mask=d_mask)
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale  # (rows,)
        m_new = tl.where(write, tl.maximum(m_i, score), m_i)
        alpha = tl.where(write, tl.math.exp2(m_i - m_new), 1.0)
        p = tl.where(write, tl.math.exp2(score - m_new), 0.0)
        return m_new, l_i * alpha + p, acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]

    @triton.jit
    def _decode_attention_kernel(
        Q, PK, PV, RK, RV, PROMPT_INDEX, PROMPT_LEN, RESPONSE_LEN, OUT, NEW_KV, COS, SIN, BIAS, qk_scale,
        stride_qb, stride_qh, stride_qg,
        stride_pe, stride_ph, stride_pl,
        stride_rb, stride_rh, stride_rl,
        stride_ob, stride_oh, stride_og,
        stride_nb, stride_nkv, stride_nh, stride_cb, stride_tb, prompt_columns, PART_ACC, PART_ML, split_len,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WRITE_NEW: tl.constexpr,
        ROPE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        PAGED: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        ONE_BLOCK: tl.constexpr,
        BALANCED: tl.constexpr,
    ):
        """One (slot, KV head): the prompt entry's keys, then the slot's response keys, one softmax.
        With WRITE_NEW the last response key/value (index response_len - 1) comes from NEW_KV: it is
        attended from registers and stored into the cache, so the cache write needs no kernel of its own
        (and this program never reads what it writes). With ROPE, Q and NEW_KV are raw projections: the
        bias rows (BIAS (H + 2 Hkv, D), HAS_BIAS) are added and RoPE applied (COS, SIN (B, D)) on load.
        PAGED: PROMPT_INDEX is the block table (B, columns) and PK is RK, the block pool (see the wrapper).
        NUM_SPLITS > 1: this program is split program_id(2) of the slot's response keys (see the wrapper); split 0 also
        takes the prompt and the new key; the partial state goes to PART_ACC / PART_ML."""
        slot = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        row_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
        q_base = Q + slot * stride_qb + head * stride_qh
        if ROPE:
            cos = tl.load(COS + slot * stride_cb + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
            sin = tl.load(SIN + slot * stride_cb + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
            q = _rotated(q_base, offs_g * stride_qg, BIAS, head * GROUP + offs_g, cos, sin, row_mask,
                         HAS_BIAS, HEAD_DIM, BLOCK_D).to(Q.dtype.element_ty)  # rounded once, as a RoPE kernel would
        else:
            q = tl.load(q_base + offs_g[:, None] * stride_qg + offs_d[None, :], mask=row_mask, other=0.0)
        # q (GROUP_PAD, BLOCK_D); padded rows are zeros
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        table = PROMPT_INDEX + slot * stride_tb  # PAGED: this slot's row of the block table
        if PAGED:
            prompt = head * stride_ph
            response = head * stride_rh
        else:
            prompt = tl.load(PROMPT_INDEX + slot).to(tl.int64) * stride_pe + head * stride_ph
            response = slot * stride_rb + head * stride_rh
        split = tl.program_id(2)
        response_len = tl.load(RESPONSE_LEN + slot).to(tl.int32)
        cached = response_len - 1 if WRITE_NEW else response_len
        if BALANCED and NUM_SPLITS > 1:  # this slot's own prompt and response keys in equal parts
            full_prompt = tl.load(PROMPT_LEN + slot).to(tl.int32)
            prompt_begin, prompt_end, begin, end, holds = _balanced_range(split, full_prompt, cached, NUM_SPLITS,
                                                                          BLOCK_N)
        else:  # split 0 takes the prompt; the response in parts of split_len keys
            prompt_begin, prompt_end = 0, tl.where(split == 0, tl.load(PROMPT_LEN + slot).to(tl.int32), 0)
            begin, end = 0, cached
            if NUM_SPLITS > 1:
                begin = split * split_len
                end = tl.minimum(cached, begin + split_len)
            holds = (split == 0) | (begin < cached)
        m_i, l_i, acc = _attend(q, PK + prompt, PV + prompt, prompt_begin, prompt_end, stride_pl,
                                m_i, l_i, acc, qk_scale, table, stride_pe, HEAD_DIM, BLOCK_D, BLOCK_N, IEEE,
                                PAGED, BLOCK_SIZE, ONE_BLOCK)
        m_i, l_i, acc = _attend(q, RK + response, RV + response, begin, end, stride_rl, m_i, l_i, acc, qk_scale,
                                table + prompt_columns, stride_rb, HEAD_DIM, BLOCK_D, BLOCK_N, IEEE, PAGED, BLOCK_SIZE,
                                ONE_BLOCK)
        if WRITE_NEW:
            new = NEW_KV + slot * stride_nb + head * stride_nh
            new_at = tl.where(split == 0, cached, -1)  # only split 0 stores and attends the new key
            write = new_at >= 0
            if ROPE:
                num_heads = tl.num_programs(1) * GROUP
                one = tl.arange(0, 1)
                one_mask = (one[:, None] < 1) & (offs_d[None, :] < HEAD_DIM) & write
                k_new = tl.sum(_rotated(new, one * 0, BIAS, num_heads + head + one * 0, cos, sin, one_mask,
                                        HAS_BIAS, HEAD_DIM, BLOCK_D), 0).to(RK.dtype.element_ty)
                v_new = tl.load(new + stride_nkv + offs_d, mask=(offs_d < HEAD_DIM) & write, other=0.0)
                if HAS_BIAS:
                    v_bias = BIAS + (num_heads + tl.num_programs(1) + head) * HEAD_DIM
                    v_new = (v_new.to(tl.float32) + tl.load(v_bias + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
                             .to(tl.float32)).to(RV.dtype.element_ty)
            else:
                k_new, v_new = _load_new(new, stride_nkv, write, HEAD_DIM, BLOCK_D)
            m_i, l_i, acc = _attend_new(q, RK + response, RV + response, k_new, v_new, stride_rl, new_at,
                                        m_i, l_i, acc, qk_scale, table + prompt_columns, stride_rb, HEAD_DIM, BLOCK_D,
                                        PAGED, BLOCK_SIZE)
        # With splits, a slot whose keys all fell to split 0 (count 1) is finished here and the combine skips it;
        # otherwise each split that holds keys leaves its partial state (the group's rows only) for the combine.
        alone = split == 0
        if NUM_SPLITS > 1:
            count = _held_splits(PROMPT_LEN, RESPONSE_LEN, slot, split_len, NUM_SPLITS, WRITE_NEW, BALANCED, BLOCK_N)
            part = (slot * tl.num_programs(1) + head) * NUM_SPLITS + split
            partial = holds & (count > 1)
            rows = offs_g < GROUP
            tl.store(PART_ACC + part * GROUP_PAD * BLOCK_D + offs_g[:, None] * BLOCK_D + offs_d[None, :], acc,
                     mask=row_mask & partial)
            tl.store(PART_ML + part * 2 * GROUP_PAD + offs_g, m_i, mask=rows & partial)
            tl.store(PART_ML + part * 2 * GROUP_PAD + GROUP_PAD + offs_g, l_i, mask=rows & partial)
            alone = alone & (count == 1)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i == 0 only when the slot sees no key: zeros
        tl.store(OUT + slot * stride_ob + head * stride_oh + offs_g[:, None] * stride_og + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_mask & alone)

    @triton.jit
    def _balanced_blocks(prompt_len, cached, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """A slot's key blocks (its prompt's, then its response's, each counted from its own start) and how many of
        them each split takes: prompt blocks, response blocks, blocks per split (at least one)."""
        prompt_blocks = tl.cdiv(tl.maximum(prompt_len, 0), BLOCK_N)
        response_blocks = tl.cdiv(tl.maximum(cached, 0), BLOCK_N)
        return prompt_blocks, response_blocks, tl.maximum(tl.cdiv(prompt_blocks + response_blocks, NUM_SPLITS), 1)

    @triton.jit
    def _balanced_range(split, prompt_len, cached, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Split `split`'s keys when a slot's prompt and response keys are shared out evenly in whole key blocks
        (`BALANCED`): its prompt keys [prompt_begin, prompt_end), its response keys [begin, end) (either range may be
        empty; each starts on a key block of its part, as the one-block loads need) and whether it holds any (split 0
        always does: the new key)."""
        prompt_blocks, response_blocks, per = _balanced_blocks(prompt_len, cached, NUM_SPLITS, BLOCK_N)
        first, last = split * per, split * per + per  # the split's blocks [first, last) of the slot's sequence
        prompt_begin = tl.minimum(first, prompt_blocks) * BLOCK_N
        prompt_end = tl.minimum(tl.minimum(last, prompt_blocks) * BLOCK_N, tl.maximum(prompt_len, 0))
        begin = tl.maximum(first - prompt_blocks, 0) * BLOCK_N
        end = tl.minimum(tl.maximum(last - prompt_blocks, 0) * BLOCK_N, tl.maximum(cached, 0))
        return prompt_begin, prompt_end, begin, end, (split == 0) | (first < prompt_blocks + response_blocks)

    @triton.jit
    def _combine_splits_kernel(PART_ACC, PART_ML, PROMPT_LEN, RESPONSE_LEN, OUT, stride_ob, stride_oh, stride_og,
                               split_len,
                               GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr,
                               BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, WRITE_NEW: tl.constexpr,
                               BALANCED: tl.constexpr, BLOCK_N: tl.constexpr):
        """One (slot, KV head): merge the partial softmax states of the splits that hold keys into the output."""
        slot = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        count = _held_splits(PROMPT_LEN, RESPONSE_LEN, slot, split_len, NUM_SPLITS, WRITE_NEW, BALANCED, BLOCK_N)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        first = (slot * tl.num_programs(1) + head) * NUM_SPLITS
        for split in range(0, count):
            part = first + split
            m_s = tl.load(PART_ML + part * 2 * GROUP_PAD + offs_g)
            l_s = tl.load(PART_ML + part * 2 * GROUP_PAD + GROUP_PAD + offs_g)
            acc_s = tl.load(PART_ACC + part * GROUP_PAD * BLOCK_D + offs_g[:, None] * BLOCK_D + offs_d[None, :])
            m_new = tl.maximum(m_i, m_s)
            seen = m_new > float("-inf")  # both -inf: nothing seen yet (a split 0 without keys)
            alpha = tl.where(seen, tl.math.exp2(m_i - m_new), 0.0)
            beta = tl.where(seen, tl.math.exp2(m_s - m_new), 0.0)
            l_i = l_i * alpha + l_s * beta
            acc = acc * alpha[:, None] + acc_s * beta[:, None]
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        row_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM) & (count > 1)  # 1: written already
        tl.store(OUT + slot * stride_ob + head * stride_oh + offs_g[:, None] * stride_og + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_mask)

    @triton.jit
    def _held_splits(PROMPT_LEN, RESPONSE_LEN, slot, split_len, NUM_SPLITS: tl.constexpr, WRITE_NEW: tl.constexpr,
                     BALANCED: tl.constexpr, BLOCK_N: tl.constexpr):
        """How many of a slot's splits hold keys and left a partial state (the first ones; split 0 always)."""
        response_len = tl.load(RESPONSE_LEN + slot).to(tl.int32)
        cached = response_len - 1 if WRITE_NEW else response_len
        if BALANCED:
            prompt_blocks, response_blocks, per = _balanced_blocks(tl.load(PROMPT_LEN + slot).to(tl.int32), cached,
                                                                   NUM_SPLITS, BLOCK_N)
            count = tl.maximum(1, tl.cdiv(prompt_blocks + response_blocks, per))
        else:
            count = tl.maximum(1, tl.cdiv(tl.maximum(cached, 0), split_len))
        return count

    @triton.jit
    def _combine_all_splits_kernel(PART_ACC, PART_ML, PROMPT_LEN, RESPONSE_LEN, OUT, stride_ob, stride_oh,
                                   stride_og, split_len,
                                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr,
                                   BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, WRITE_NEW: tl.constexpr,
                                   BALANCED: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                                   SPLITS_PAD: tl.constexpr, CHUNK_D: tl.constexpr):
        """One (slot, KV head, chunk of CHUNK_D head dims): every held split's partial state loaded at once
        (SPLITS_PAD, ROWS[, CHUNK_D]: NUM_SPLITS and GROUP padded to powers of two), merged by log-sum-exp weights (`decode_launch.COMBINE_TILE` says why)."""
        slot = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_g = tl.arange(0, ROWS)
        offs_d = tl.program_id(2) * CHUNK_D + tl.arange(0, CHUNK_D)
        count = _held_splits(PROMPT_LEN, RESPONSE_LEN, slot, split_len, NUM_SPLITS, WRITE_NEW, BALANCED, BLOCK_N)
        part = (slot * tl.num_programs(1) + head) * NUM_SPLITS + offs_s  # (SPLITS_PAD,); count <= NUM_SPLITS
        # splits not held were never written; a count of 1 was finished by its split 0
        held = (offs_s[:, None] < count) & (offs_g[None, :] < GROUP) & (count > 1)
        ml = PART_ML + part[:, None] * 2 * GROUP_PAD + offs_g[None, :]
        m_s = tl.load(ml, mask=held, other=float("-inf"))  # (SPLITS_PAD, ROWS)
        l_s = tl.load(ml + GROUP_PAD, mask=held, other=0.0)
        m = tl.max(m_s, 0)  # (ROWS,); -inf only for a row no split saw a key of
        weight = tl.where(m_s > float("-inf"), tl.math.exp2(m_s - m[None, :]), 0.0)
        l_i = tl.sum(l_s * weight, 0)
        acc_at = (part[:, None, None] * GROUP_PAD + offs_g[None, :, None]) * BLOCK_D + offs_d[None, None, :]
        acc_s = tl.load(PART_ACC + acc_at, mask=held[:, :, None] & (offs_d[None, None, :] < HEAD_DIM), other=0.0)
        out = tl.sum(acc_s * weight[:, :, None], 0) / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (ROWS, CHUNK_D)
        row_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM) & (count > 1)
        tl.store(OUT + slot * stride_ob + head * stride_oh + offs_g[:, None] * stride_og + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_mask)
