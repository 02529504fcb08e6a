"""Residual adds + RMSNorm + a linear layer as one kernel for the decode step (opt-in, `fuse_norms`).

    x = h + r1 + r2                     (the residual stream; written back once, by the first column block)
    y = rmsnorm(x) * g @ W.T            computed as  (x @ (W * g).T) / rms(x)

The norm weight g is folded into the engine's own fused copy of W (`fold_norm`), and the row's 1/rms(x)
scales the accumulator at the end, so the normalized input never exists and the norm needs no kernel of
its own. With `swiglu`, W stacks the gate rows over the up rows (2I, K) and the result is
silu(x̂ Wgᵀ) * (x̂ Wuᵀ) (x̂ the normalized input): the MLP's activation comes out of the same kernel.

A decode step's kernels are small and the gap between two kernels (~1.8 µs on an H200) is a large part
of their time, so two kernels fewer per layer (the two norms) and one fewer (SiLU·mul) is the point.
Everything is computed in float32 and rounded once; the reference below is the oracle of the tests and
the engine's path on CPU. First timed on an H200 on 2026-11-30 (docs/benchmarks.md): with 64×64×64 blocks
1.75× slower than the unfused step; `benchmarks/norm_linear.py` sweeps the launch against cuBLAS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # llama_forward imports this module
    from hybridrl.rollout.llama_forward import ModelWeights

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference is all there is
    triton = None



class Launch(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


LAUNCH = {False: Launch(64, 64, 64, 4, 3), True: Launch(64, 64, 64, 4, 3)}
"""Launch configuration by `swiglu` (the q/k/v kernel, the gate/up kernel): fixed, since graph capture needs
one kernel per shape; `benchmarks/norm_linear.py` sweeps them (`set_launch` takes its choice)."""


def set_launch(swiglu: bool, launch: Launch | tuple) -> None:
    LAUNCH[swiglu] = Launch(*launch)


def fold_norm(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """W * g along the input dimension, in W's dtype: a new tensor (the engine folds into its fused copies)."""
    return weight * norm_weight[None, :].to(weight.dtype)


def reference_norm_linear(h: torch.Tensor, residuals: tuple[torch.Tensor, ...], folded_weight: torch.Tensor,
                          eps: float, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, x): y (M, N) as described in the module docstring, in h's dtype; x = h + residuals (M, K)."""
    x = h.float()
    for residual in residuals:
        x = x + residual.float()
    x = x.to(h.dtype)
    inv_rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    y = (x.float() @ folded_weight.float().t()) * inv_rms
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y.to(h.dtype), x


def triton_norm_linear(h: torch.Tensor, residuals: tuple[torch.Tensor, ...], folded_weight: torch.Tensor,
                       eps: float, swiglu: bool = False, launch: Launch | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_norm_linear` as one Triton kernel over an (M / block_m, N / block_n) grid; `launch`
    defaults to `LAUNCH[swiglu]`."""
    if triton is None:
        raise ImportError("triton_norm_linear needs the triton package (pip install triton).")
    assert len(residuals) <= 2 and h.dim() == 2 and h.stride(-1) == 1 and folded_weight.stride(-1) == 1
    rows, inner = h.shape
    outputs = folded_weight.shape[0] // (2 if swiglu else 1)
    out = torch.empty(rows, outputs, dtype=h.dtype, device=h.device)
    x = torch.empty_like(h) if residuals else h
    r1 = residuals[0] if residuals else h  # placeholders when absent
    r2 = residuals[1] if len(residuals) > 1 else h
    launch = launch or LAUNCH[swiglu]
    grid = (triton.cdiv(rows, launch.block_m), triton.cdiv(outputs, launch.block_n))
    _norm_linear_kernel[grid](
        h, r1, r2, folded_weight, out, x, rows, outputs, inner, eps,
        h.stride(0), r1.stride(0), r2.stride(0), folded_weight.stride(0), out.stride(0), x.stride(0),
        NUM_RESIDUALS=len(residuals), SWIGLU=swiglu, IEEE=h.dtype == torch.float32,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out, x


def decode_layers_fused_norms(w: ModelWeights, tokens: torch.Tensor, attend: Callable, norm_linear: Callable,
                               final_logits: Callable) -> torch.Tensor:
    """The decode layer stack with residual adds, RMSNorms and the SiLU·mul inside two `norm_linear` kernels
    per layer (folded norm weights), attention applying bias and RoPE, and cuBLAS for the o and down
    projections: five kernels per layer."""
    batch = tokens.shape[0]
    h, pending = F.embedding(tokens, w.embed), ()
    for layer_index, lw in enumerate(w.layers):
        raw, h = norm_linear(h, pending, lw.qkv_weight, w.rms_eps)
        raw = raw.view(batch, -1, w.head_dim)
        attn = attend(layer_index, raw[:, : w.num_heads].view(batch, w.num_kv_heads, -1, w.head_dim),
                      raw[:, w.num_heads:].view(batch, 2, w.num_kv_heads, w.head_dim))
        o = F.linear(attn.reshape(batch, -1), lw.o_weight, lw.o_bias)
        activation, h = norm_linear(h, (o,), lw.gate_up_weight, w.rms_eps, swiglu=True)
        pending = (F.linear(activation, lw.down_weight),)
    return final_logits(w, h, pending)


if triton is not None:

    @triton.jit
    def _norm_linear_kernel(H, R1, R2, W, OUT, X_OUT, M, N, K, eps,
                            stride_h, stride_r1, stride_r2, stride_w, stride_o, stride_x,
                            NUM_RESIDUALS: tl.constexpr, SWIGLU: tl.constexpr, IEEE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One (row block, output block): x = h + residuals loaded block by block along K (written back by
        the first output block only), the sum of squares kept per row, x @ W.T accumulated (two accumulators,
        gate and up, with SWIGLU), then scaled by 1/rms and stored."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask, n_mask = offs_m < M, offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        squares = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(0, K, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a_mask = m_mask[:, None] & k_mask[None, :]
            x = tl.load(H + offs_m[:, None] * stride_h + offs_k[None, :], mask=a_mask, other=0.0)
            if NUM_RESIDUALS > 0:
                total = x.to(tl.float32) + tl.load(R1 + offs_m[:, None] * stride_r1 + offs_k[None, :], mask=a_mask,
                                                   other=0.0).to(tl.float32)
                if NUM_RESIDUALS > 1:
                    total += tl.load(R2 + offs_m[:, None] * stride_r2 + offs_k[None, :], mask=a_mask,
                                     other=0.0).to(tl.float32)
                x = total.to(H.dtype.element_ty)
                # A masked store, not a branch: a branch inside the loop keeps Triton from pipelining it.
                tl.store(X_OUT + offs_m[:, None] * stride_x + offs_k[None, :], x, mask=a_mask & (pid_n == 0))
            x32 = x.to(tl.float32)
            squares += tl.sum(x32 * x32, 1)
            w_mask = n_mask[:, None] & k_mask[None, :]
            w = tl.load(W + offs_n[:, None] * stride_w + offs_k[None, :], mask=w_mask, other=0.0)
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            if SWIGLU:
                w_up = tl.load(W + (N + offs_n)[:, None] * stride_w + offs_k[None, :], mask=w_mask, other=0.0)
                if IEEE:
                    acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(x, tl.trans(w_up), acc_up)
        inv_rms = tl.math.rsqrt(squares / K + eps)
        y = acc * inv_rms[:, None]
        if SWIGLU:
            y = y * tl.sigmoid(y) * (acc_up * inv_rms[:, None])
        tl.store(OUT + offs_m[:, None] * stride_o + offs_n[None, :], y.to(OUT.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])
