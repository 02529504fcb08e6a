"""Attention for a wave of multi-turn resumes (`llama_forward.extend`) in one Triton kernel.

A resume feeds a few dozen new ids per row (a turn's last token and an observation) against every key its slot holds,
a few hundred; the benchmark's wave is 512 rows x 33 ids x ~450 keys. Written as two matmuls and a softmax, the scores
(rows x query heads x ids x keys, ~100M elements per layer there) are written, softmaxed and read back; here each
program keeps them in registers with an online softmax (as flash attention does), so only q, the keys, the values and
the output move.

Layout: one program per (block of `BLOCK_M` folded queries, KV head, row), the query blocks of one row and head
launched next to each other so that their reads of the same keys can hit L2. The query heads that share a KV head
are folded into the query axis (query-major: folded index m is id m // group of query head kv_head * group +
m % group), so one pass over a KV head's keys serves all of them, as in decode. Query m sees key j when j <= its
position; the loop stops at the block's furthest position, so a row never reads past its own ids (the rest of the
key bucket is not loaded at all). Folded indices past the last id (a block's tail) load position -1 and store
nothing.

Inputs are those of `llama_forward._masked_gqa_attention`: q (P, L, H, D), keys/values (P, Hkv, K, D), positions
(P, L) -> (P, L, H, D) in q's dtype; float32 accumulation, P rounded to the value dtype before its matmul. Called
inside the compiled `extend` piece (torch.compile traces user Triton kernels). Triton is optional: without it the
module imports and `extend_attention` raises ImportError. `TRITON_INTERPRET=1` before the first import runs the kernel
on CPU tensors (tests).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: llama_forward's other attentions remain
    triton = None

BLOCK_M = 64
BLOCK_N = 64


def extend_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor | None = None) -> torch.Tensor:
    """q (P, L, H, D), keys/values (P, Hkv, K, D), positions (P, L) of the queries -> (P, L, H, D): softmax over the
    keys j <= each query's position (see the module docstring). `slots` (P,): keys/values are instead a per-slot cache
    layer's (S, Hkv, max_len, D) and row p reads slot slots[p] in place, with no gathered copy of the rows' slots."""
    if triton is None:
        raise ImportError("the extend attention kernel needs Triton; install the triton package (it comes with "
                          "torch's CUDA builds) or use another extend attention.")
    rows, length, num_heads, head_dim = q.shape
    num_kv_heads, key_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    grid = (triton.cdiv(length * group, BLOCK_M), num_kv_heads, rows)
    _extend_attention_kernel[grid](
        q, keys, values, positions, positions if slots is None else slots, out,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), positions.stride(0), out.stride(0), out.stride(1),
        out.stride(2), length, key_len,
        SCALE=head_dim ** -0.5, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", IN_PLACE=slots is not None)
    return out


if triton is not None:
    @triton.jit
    def _extend_attention_kernel(q, k, v, positions, slots, out,
                                 stride_qp, stride_ql, stride_qh, stride_kp, stride_kh, stride_kn,
                                 stride_vp, stride_vh, stride_vn, stride_pp, stride_op, stride_ol, stride_oh,
                                 length, key_len,
                                 SCALE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                                 IN_PLACE: tl.constexpr):
        # SCALE a compile-time constant: torch.compile passes a Python float argument as float64, which would make the
        # scores and the loop-carried maximum float64.
        row = tl.program_id(2)
        kv_head = tl.program_id(1)
        folded = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        token = folded // GROUP
        head = kv_head * GROUP + folded % GROUP
        real = token < length
        dims = tl.arange(0, HEAD_DIM)
        row_q = q + row.to(tl.int64) * stride_qp
        query = tl.load(row_q + token[:, None] * stride_ql + head[:, None] * stride_qh + dims[None, :],
                        mask=real[:, None], other=0.0)  # (BLOCK_M, D)
        position = tl.load(positions + row.to(tl.int64) * stride_pp + token, mask=real, other=-1)
        # A large finite start, not -inf: a padding query sees no key, and exp(-inf - -inf) would be NaN.
        running_max = tl.full([BLOCK_M], -1.0e30, tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if IN_PLACE:  # the row's keys are its slot's in the cache
            source = tl.load(slots + row).to(tl.int64)
        else:
            source = row.to(tl.int64)
        row_k = k + source * stride_kp + kv_head * stride_kh
        row_v = v + source * stride_vp + kv_head * stride_vh
        end = tl.minimum(tl.max(position, 0) + 1, key_len)
        for start in range(0, end, BLOCK_N):
            key = start + tl.arange(0, BLOCK_N)
            inside = key < key_len
            keys_t = tl.load(row_k + key[None, :] * stride_kn + dims[:, None], mask=inside[None, :], other=0.0)
            scores = tl.dot(query, keys_t, input_precision=PRECISION) * SCALE  # (BLOCK_M, BLOCK_N)
            scores = tl.where(key[None, :] <= position[:, None], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            weights = tl.exp(scores - new_max[:, None])
            rescale = tl.exp(running_max - new_max)
            total = total * rescale + tl.sum(weights, 1)
            block_v = tl.load(row_v + key[:, None] * stride_vn + dims[None, :], mask=inside[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(block_v.dtype), block_v, input_precision=PRECISION)
            running_max = new_max
        result = acc / tl.maximum(total, 1e-30)[:, None]
        tl.store(out + row.to(tl.int64) * stride_op + token[:, None] * stride_ol + head[:, None] * stride_oh
                 + dims[None, :], result.to(out.dtype.element_ty), mask=real[:, None])
