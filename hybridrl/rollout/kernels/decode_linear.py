"""The decode step's projections at small batches as one Triton kernel: y = x @ W^T for a few rows of x, and the
MLP's gate/up projection with SiLU(gate) * up applied before the result is stored.

Why: at the tail of a long-tail rollout a decode step runs 1-32 sequences, and each layer's matmuls then read the
weights once for almost no arithmetic. cuBLAS's kernels for such skinny products are tiled for larger batches
(<PROFILE>), and the gate/up product is followed by a SiLU-mul kernel of its own. Here each program owns `BLOCK_N`
output columns, streams their weight rows once over K, and keeps every row of x (padded to the 16 rows `tl.dot`
needs) in the tile: one read of the weights, one launch, no split-K reduction kernel. With `SILU_MUL` the program
owns gate columns n and up columns n + N (the stacked gate/up weight, `fuse_gate_up`) and stores
SiLU(gate) * up, so the MLP's intermediate never goes to memory in float32 or twice in the model dtype.

Numerics: float32 accumulation as cuBLAS; the gate and up sums enter SiLU-mul unrounded (the unfused path rounds
each to the model dtype first), so the MLP's input to `down` can differ from it by one rounding of the model dtype.
float32 inputs run `tl.dot` at IEEE precision (tests on CPU models), so float32 agrees with F.linear to summation
order. `TRITON_INTERPRET=1` runs the kernel on CPU tensors (float32 and float16 only: the interpreter's `tl.dot` is
wrong for bf16).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: F.linear everywhere
    triton = None

MAX_ROWS = 32
"""Batches up to this many rows take the kernel (`applies`); larger ones are tiled well by cuBLAS."""
NARROW_COLUMNS = 4096
"""Products with at most this many output columns (q/k/v, o, down at the 1.5B shape) are narrow: too few column
blocks to give every SM a program, so each program streams longer K tiles to keep enough bytes in flight."""
NUM_WARPS, NUM_STAGES = 4, 4


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `decode_linear` runs the kernel for x (M, K) and weight (N, K): CUDA, triton, M <= MAX_ROWS."""
    return triton is not None and x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype


def launch(columns: int) -> tuple[int, int]:
    """(output columns, K elements) per program tile. Narrow products: 16 columns (96-128 programs at 1536-2048
    columns) of 512-element K tiles, 16 KB of weight per pipeline stage; wide ones (gate/up, the LM head): 32 columns
    of 128, several programs per SM."""
    return (16, 512) if columns <= NARROW_COLUMNS else (32, 128)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> (M, N); with `silu_mul`, weight is gate and up stacked (2I, K) and the result
    SiLU(x @ gate^T) * (x @ up^T), (M, I)."""
    rows, depth = x.shape
    columns = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert weight.stride(-1) == 1, "weight rows must be contiguous"
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    block_n, block_k = launch(columns)
    _decode_linear_kernel[(triton.cdiv(columns, block_n),)](
        x, weight, out, rows, columns, x.stride(0), weight.stride(0), out.stride(0), K=depth,
        BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=silu_mul,
        IEEE=x.dtype == torch.float32, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


if triton is not None:

    @triton.jit
    def _decode_linear_kernel(X, W, OUT, M, N, stride_xm, stride_wn, stride_om, K: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr,
                              IEEE: tl.constexpr):
        columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        depth = tl.arange(0, BLOCK_K)
        w_rows = W + columns[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + depth
            x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                        other=0.0)
            w_mask = (columns[:, None] < N) & (k[None, :] < K)
            w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            if SILU_MUL:  # the up rows sit N rows below the gate rows
                up = tl.load(w_rows + N * stride_wn + k[None, :], mask=w_mask, other=0.0)
                if IEEE:
                    acc_up = tl.dot(x, tl.trans(up), acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(x, tl.trans(up), acc_up)
        if SILU_MUL:
            acc = acc * tl.sigmoid(acc) * acc_up
        mask = (rows[:, None] < M) & (columns[None, :] < N)
        tl.store(OUT + rows[:, None] * stride_om + columns[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@torch.library.custom_op("hybridrl::decode_linear", mutates_args=())
def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    """`decode_linear` where it `applies`, else F.linear (and SiLU-mul): an operator of its own so that a compiled
    decode piece calls it as it is, and the choice by batch is made when the step runs (or is captured), not traced."""
    if applies(x, weight):
        return decode_linear(x, weight, silu_mul)
    out = torch.nn.functional.linear(x, weight)
    if not silu_mul:
        return out
    gate, up = out.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@small_batch_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if silu_mul else weight.shape[0])
