"""The decode step's MLP down projection with the SwiGLU activation fused into its operand load (opt-in,
`BuiltinBackend(fuse_mlp_down=True)`): a split-K Triton GEMM and the PyTorch reference it must equal.

Why: at 512 rows the grpo-0.5b decode step spends 4.1-6.8 µs per layer in Inductor's `silu(gate) * up` kernel
(10 MB read and 5 MB written between two matmuls) and ~11 µs in cuBLAS's down projection, whose 512 x 896 output
has too few tiles for 132 SMs (`docs/benchmarks.md`, 2026-12-01). Here each program loads tiles of gate and up
from the fused gate/up matmul's output, forms silu(gate) * up in float32, rounds it once to the weights' dtype
(as the compiled pointwise kernel does) and multiplies it by its tile of the down weights, over one of `splits`
slices of the intermediate dimension; the float32 partial sums go out as (splits, rows, hidden) and the next
compiled piece adds them into the residual (`llama_forward.as_residual`), so no reduction kernel is added.
Whether this beats cuBLAS + the pointwise kernel on a GPU is for `benchmarks/mlp_down.py` to say; it is off by
default until it has.

`TRITON_INTERPRET=1` set before the first import runs the kernel on CPU tensors (how the tests check it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F

from hybridrl.rollout.llama_forward import DecodeFunctions, LayerWeights, ModelWeights, _linear, rms_norm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference is all there is
    triton = None

SPLITS, BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS = 4, 64, 64, 64, 4
"""Launch configuration: slices of the intermediate dimension and tile sizes (`benchmarks/mlp_down.py` times others).
Float32 weights (tests, CPU-sized models) use half of BLOCK_K: their pipelined tiles would need 112 KB of shared
memory, more than an RTX 4090 or A6000 has."""


def reference_swiglu_down(gate_up: torch.Tensor, down_weight: torch.Tensor, splits: int = SPLITS) -> torch.Tensor:
    """gate_up (M, 2 I) = [gate | up], down_weight (N, I) -> float32 partial sums (splits, M, N) whose sum is
    F.linear(silu(gate) * up, down_weight) with the activation rounded to the weights' dtype once."""
    intermediate = down_weight.shape[1]
    gate, up = gate_up.float().split(intermediate, dim=-1)
    act = (F.silu(gate) * up).to(down_weight.dtype).float()
    bounds = _split_bounds(intermediate, splits, 1)
    return torch.stack([F.linear(act[:, a:b], down_weight[:, a:b].float()) for a, b in zip(bounds, bounds[1:])])


def _split_bounds(intermediate: int, splits: int, block_k: int) -> list[int]:
    """Slice starts of the intermediate dimension, each a multiple of `block_k`, and its end."""
    per_split = -(-intermediate // splits)
    per_split = -(-per_split // block_k) * block_k
    return [min(i * per_split, intermediate) for i in range(splits)] + [intermediate]


def triton_swiglu_down(gate_up: torch.Tensor, down_weight: torch.Tensor, splits: int = SPLITS,
                       block_m: int = BLOCK_M, block_n: int = BLOCK_N, block_k: int | None = None,
                       num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Same contract as `reference_swiglu_down`, one kernel over a (row tiles, column tiles, splits) grid."""
    if triton is None:
        raise ImportError("the fused MLP down projection needs triton (pip install triton); "
                          "BuiltinBackend(fuse_mlp_down=False) keeps cuBLAS.")
    rows = gate_up.shape[0]
    hidden, intermediate = down_weight.shape
    block_k = block_k or (BLOCK_K // 2 if down_weight.dtype == torch.float32 else BLOCK_K)
    assert gate_up.shape[1] == 2 * intermediate and gate_up.stride(1) == 1 and down_weight.stride(1) == 1
    out = torch.empty(splits, rows, hidden, dtype=torch.float32, device=gate_up.device)
    per_split = _split_bounds(intermediate, splits, block_k)[1] if splits > 1 else intermediate
    grid = (triton.cdiv(rows, block_m), triton.cdiv(hidden, block_n), splits)
    _swiglu_down_kernel[grid](
        gate_up, down_weight, out, rows, hidden, intermediate, gate_up.stride(0), down_weight.stride(0),
        out.stride(0), out.stride(1), per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=down_weight.dtype == torch.float32,
        num_warps=num_warps)
    return out


if triton is not None:

    @triton.jit
    def _swiglu_down_kernel(GATE_UP, W, OUT, rows, hidden, intermediate, stride_gm, stride_wn, stride_os,
                            stride_om, per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        start = split * per_split
        end = tl.minimum(start + per_split, intermediate)
        lanes = tl.arange(0, BLOCK_K)
        gate_rows = GATE_UP + row.to(tl.int64)[:, None] * stride_gm
        weight_cols = W + col.to(tl.int64)[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(start, end, BLOCK_K):
            ks = k + lanes
            a_mask = (row[:, None] < rows) & (ks[None, :] < end)
            gate = tl.load(gate_rows + ks[None, :], mask=a_mask, other=0.0).to(tl.float32)
            up = tl.load(gate_rows + intermediate + ks[None, :], mask=a_mask, other=0.0).to(tl.float32)
            act = (gate * tl.sigmoid(gate) * up).to(W.dtype.element_ty)  # (BLOCK_M, BLOCK_K), rounded once
            w = tl.load(weight_cols + ks[:, None], mask=(ks[:, None] < end) & (col[None, :] < hidden), other=0.0)
            if IEEE:
                acc += tl.dot(act, w, input_precision="ieee")
            else:
                acc += tl.dot(act, w)
        out_mask = (row[:, None] < rows) & (col[None, :] < hidden)
        tl.store(OUT + split * stride_os + row[:, None] * stride_om + col[None, :], acc, mask=out_mask)


def attention_output_and_gate_up(w: ModelWeights, lw: LayerWeights, h: torch.Tensor, attn: torch.Tensor):
    """`llama_forward.attention_output_and_mlp` up to the fused gate/up matmul: the residual o and [gate | up]."""
    o = _linear(attn.reshape(h.shape[0], -1), lw.o_weight, lw.o_bias, lw.o_lora)
    return o, F.linear(rms_norm(h + o, lw.post_norm, w.rms_eps), lw.gate_up_weight)


def with_fused_mlp_down(functions: DecodeFunctions, mlp_down: Callable, compile: bool) -> DecodeFunctions:
    """`functions` whose decode layers end with `mlp_down` (this module's kernel or its reference) after the gate/up
    matmul, for layers with fused gate/up weights and no LoRA on the down projection; other layers as before. The
    MLP residual is then the float32 partial sums, which the next piece adds (`llama_forward.as_residual`)."""
    piece = attention_output_and_gate_up
    if compile:
        compiled = torch.compile(attention_output_and_gate_up, fullgraph=True)

        def piece(w, lw, h, attn):
            for tensor in (h, attn):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
            return compiled(w, lw, h, attn)

    def attention_output_and_mlp(w, lw, h, attn):
        if lw.gate_up_weight is None or lw.down_lora is not None:
            return functions.attention_output_and_mlp(w, lw, h, attn)
        o, gate_up = piece(w, lw, h, attn)
        return o, mlp_down(gate_up, lw.down_weight)

    return replace(functions, attention_output_and_mlp=attention_output_and_mlp)
