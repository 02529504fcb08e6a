"""Split-K Triton GEMMs for the decode step's projections with a narrow output (opt-in, unmeasured on a GPU so far):
the o projection (`BuiltinBackend(split_k_o_proj=True)`) and the MLP's down projection with the SwiGLU activation
fused into its operand load (`BuiltinBackend(fuse_mlp_down=True)`), and the PyTorch reference of both.

Why: at 512 rows the grpo-0.5b decode step's o and down projections have a 512 x 896 output, too few tiles for 132
SMs, and cuBLAS runs them at 173 and 405 TFLOP/s (4.75 and 11 µs per layer); before the down projection, Inductor's
`silu(gate) * up` kernel takes 4.1-6.8 µs more (10 MB read, 5 MB written). Here a (row tiles, column tiles, splits)
grid cuts the reduction dimension into `splits` slices, so there are `splits` times as many programs; each writes
float32 partial sums, (splits, rows, out), and the next compiled piece adds their sum into the residual
(`llama_forward.as_residual`, rounded to the model's dtype as the plain projection's output is), so no reduction
kernel is added. With `swiglu`, the input is the fused gate/up matmul's output [gate | up] and each program forms
silu(gate) * up of its tile in float32, rounded once to the weights' dtype (as the compiled kernel does).
`benchmarks/decode_projections.py` times both against cuBLAS over launch configurations and in whole rollouts; they
stay off by default until it has run.

`TRITON_INTERPRET=1` set before the first import runs the kernel on CPU tensors (how the tests check it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F

from hybridrl.rollout.llama_forward import (
    DecodeFunctions,
    LayerWeights,
    ModelWeights,
    _linear,
    _mlp,
    as_residual,
    rms_norm,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference is all there is
    triton = None

SPLITS, BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS = 4, 64, 64, 64, 4
"""Launch configuration: slices of the reduction dimension and tile sizes (`benchmarks/decode_projections.py` times
others). Float32 weights (tests, CPU-sized models) use half of BLOCK_K: their pipelined tiles would need 112 KB of
shared memory, more than an RTX 4090 or A6000 has."""


def _split_bounds(depth: int, splits: int, block_k: int) -> list[int]:
    """Slice starts of a reduction dimension of `depth`, each a multiple of `block_k`, and its end."""
    per_split = -(-depth // splits)
    per_split = -(-per_split // block_k) * block_k
    return [min(i * per_split, depth) for i in range(splits)] + [depth]


def reference_split_k_linear(x: torch.Tensor, weight: torch.Tensor, splits: int = SPLITS,
                             swiglu: bool = False) -> torch.Tensor:
    """x (M, K) (with `swiglu`: (M, 2 K) = [gate | up], used as silu(gate) * up rounded to the weights' dtype),
    weight (N, K) -> float32 partial sums (splits, M, N) whose sum is F.linear of them."""
    depth = weight.shape[1]
    if swiglu:
        gate, up = x.float().split(depth, dim=-1)
        x = (F.silu(gate) * up).to(weight.dtype)
    bounds = _split_bounds(depth, splits, 1)
    return torch.stack([F.linear(x[:, a:b].float(), weight[:, a:b].float()) for a, b in zip(bounds, bounds[1:])])


def triton_split_k_linear(x: torch.Tensor, weight: torch.Tensor, splits: int = SPLITS, swiglu: bool = False,
                          block_m: int = BLOCK_M, block_n: int = BLOCK_N, block_k: int | None = None,
                          num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Same contract as `reference_split_k_linear`, one kernel over a (row tiles, column tiles, splits) grid."""
    if triton is None:
        raise ImportError("the split-K projections need triton (pip install triton); "
                          "BuiltinBackend(split_k_o_proj=False, fuse_mlp_down=False) keeps cuBLAS.")
    rows = x.shape[0]
    out_features, depth = weight.shape
    assert x.shape[1] == (2 if swiglu else 1) * depth and x.stride(1) == 1 and weight.stride(1) == 1
    block_k = block_k or (BLOCK_K // 2 if weight.dtype == torch.float32 else BLOCK_K)
    out = torch.empty(splits, rows, out_features, dtype=torch.float32, device=x.device)
    per_split = _split_bounds(depth, splits, block_k)[1] if splits > 1 else depth
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n), splits)
    _split_k_kernel[grid](
        x, weight, out, rows, out_features, depth, x.stride(0), weight.stride(0), out.stride(0), out.stride(1),
        per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=weight.dtype == torch.float32,
        SWIGLU=swiglu, num_warps=num_warps)
    return out


def triton_swiglu_down(gate_up: torch.Tensor, down_weight: torch.Tensor, **launch) -> torch.Tensor:
    return triton_split_k_linear(gate_up, down_weight, swiglu=True, **launch)


def reference_swiglu_down(gate_up: torch.Tensor, down_weight: torch.Tensor, splits: int = SPLITS) -> torch.Tensor:
    return reference_split_k_linear(gate_up, down_weight, splits, swiglu=True)


if triton is not None:

    @triton.jit
    def _split_k_kernel(X, W, OUT, rows, out_features, depth, stride_xm, stride_wn, stride_os, stride_om, per_split,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                        SWIGLU: tl.constexpr):
        row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        start = split * per_split
        end = tl.minimum(start + per_split, depth)
        lanes = tl.arange(0, BLOCK_K)
        x_rows = X + row.to(tl.int64)[:, None] * stride_xm
        weight_cols = W + col.to(tl.int64)[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(start, end, BLOCK_K):
            ks = k + lanes
            x_mask = (row[:, None] < rows) & (ks[None, :] < end)
            if SWIGLU:  # X is [gate | up]: the activation of this tile, rounded once
                gate = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
                up = tl.load(x_rows + depth + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
                a = (gate * tl.sigmoid(gate) * up).to(W.dtype.element_ty)
            else:
                a = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
            w = tl.load(weight_cols + ks[:, None], mask=(ks[:, None] < end) & (col[None, :] < out_features), other=0.0)
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        out_mask = (row[:, None] < rows) & (col[None, :] < out_features)
        tl.store(OUT + split * stride_os + row[:, None] * stride_om + col[None, :], acc, mask=out_mask)


def o_partials_and_gate_up(w: ModelWeights, lw: LayerWeights, h: torch.Tensor, o: torch.Tensor):
    """After a split-K o projection: the post-attention norm of h + o (o's partial sums, or o itself) and the fused
    gate/up matmul: [gate | up]."""
    return F.linear(rms_norm(h + as_residual(o, h.dtype), lw.post_norm, w.rms_eps), lw.gate_up_weight)


def attention_output_and_gate_up(w: ModelWeights, lw: LayerWeights, h: torch.Tensor, attn: torch.Tensor):
    """`llama_forward.attention_output_and_mlp` up to the fused gate/up matmul: the residual o and [gate | up]."""
    o = _linear(attn.reshape(h.shape[0], -1), lw.o_weight, lw.o_bias, lw.o_lora)
    return o, o_partials_and_gate_up(w, lw, h, o)


def _maybe_compiled(fn: Callable, compile: bool) -> Callable:
    """`fn` compiled with its activations' batch dimension dynamic (one compilation for every batch bucket)."""
    if not compile:
        return fn
    compiled = torch.compile(fn, fullgraph=True)

    def call(w, lw, h, x):
        torch._dynamo.maybe_mark_dynamic(h, 0)
        torch._dynamo.maybe_mark_dynamic(x, 1 if x.dim() == 3 else 0)  # partial sums: batch second
        return compiled(w, lw, h, x)

    return call


def mlp_after_o(w: ModelWeights, lw: LayerWeights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """After a split-K o projection, the plain MLP of the post-attention norm of h + o."""
    return _mlp(lw, rms_norm(h + as_residual(o, h.dtype), lw.post_norm, w.rms_eps))


def with_split_k_projections(functions: DecodeFunctions, linear: Callable, compile: bool, o_proj: bool,
                             mlp_down: bool) -> DecodeFunctions:
    """`functions` whose decode layers run `linear` (`triton_split_k_linear` or its reference) for the o projection
    (`o_proj`, where it has no bias or LoRA) and/or the SwiGLU + down projection (`mlp_down`, where gate/up are fused
    and the down projection has no LoRA); other layers as before. Those residuals are then float32 partial sums,
    which the next piece adds (`llama_forward.as_residual`)."""
    after_o_gate_up, after_o_mlp = (_maybe_compiled(fn, compile) for fn in (o_partials_and_gate_up, mlp_after_o))
    up_to_gate_up = _maybe_compiled(attention_output_and_gate_up, compile)

    def attention_output_and_mlp(w, lw, h, attn):
        split_o = o_proj and lw.o_bias is None and lw.o_lora is None
        split_down = mlp_down and lw.gate_up_weight is not None and lw.down_lora is None
        if split_o:
            o = linear(attn.reshape(h.shape[0], -1), lw.o_weight)
            if not split_down:
                return o, after_o_mlp(w, lw, h, o)
            gate_up = after_o_gate_up(w, lw, h, o)
        elif split_down:
            o, gate_up = up_to_gate_up(w, lw, h, attn)
        else:
            return functions.attention_output_and_mlp(w, lw, h, attn)
        return o, linear(gate_up, lw.down_weight, swiglu=True)

    return replace(functions, attention_output_and_mlp=attention_output_and_mlp)
