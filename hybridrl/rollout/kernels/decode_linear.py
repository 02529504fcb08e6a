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

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: F.linear everywhere
    triton = None

MAX_ROWS = 16
"""Batches up to this many rows take the kernel (`applies`); at 32 rows its gate/up was already slower than cuBLAS's
product plus the SiLU-mul kernel (docs/benchmarks.md, "Where a decode step's time goes")."""
NUM_WARPS, NUM_STAGES = 4, 4


@dataclass(frozen=True)
class Launch:
    """A program's tile: `columns` output columns over `depth`-element K tiles; `splits` programs share each column
    block's K (split-K: float32 partial sums, added up by a second kernel)."""

    columns: int
    depth: int
    splits: int = 1


NARROW_COLUMNS = 4096
"""Products with at most this many output columns (q/k/v, o, down at the 1.5B shape) are narrow: too few column
blocks of 16 to give every SM a program, so the kernel needs split-K there to keep enough bytes in flight."""
DEFAULT = Launch(16, 512)


def launch(columns: int, depth: int) -> Launch | None:
    """The tile for a product of `columns` outputs over `depth` inputs (at any rows up to MAX_ROWS: the split count
    fixes the shape of `partial` results, which a compiled piece sees for every batch), or None where cuBLAS is as
    fast. Wide products (gate/up, the LM head): 32 columns of 128, several programs per SM (gate/up with SiLU-mul
    16.8-17.1 µs against cuBLAS's 17.4-17.7 plus a 1.1-1.3 µs SiLU-mul; the LM head 108.5-112 against 119-120 at 1-8
    rows). Narrow products (o, down): split-K, 4 x 96 programs (one program per 16 columns over the whole K ran
    down at 1.45 TB/s, 19 µs against cuBLAS's 12), whose partial sums the engine adds up inside the next fused
    kernel (`partial`). q/k/v (~5 µs for ~1 µs of weights, latency-bound both ways, and read by the attention
    kernel, which cannot add partial sums): cuBLAS."""
    if columns > NARROW_COLUMNS:
        return Launch(32, 128)
    return Launch(16, 128, 4) if columns == depth or depth > 2 * NARROW_COLUMNS else None


def split_sizes(depth: int, tile: Launch) -> tuple[int, int]:
    """(K per split program, splits): K shared over at most `tile.splits` programs in whole K tiles."""
    def ceil_div(a: int, b: int) -> int:
        return -(-a // b)

    k_per_split = ceil_div(ceil_div(depth, tile.splits), tile.depth) * tile.depth
    return k_per_split, ceil_div(depth, k_per_split)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `decode_linear` runs the kernel for x (M, K) and weight (N, K): CUDA, triton, M <= MAX_ROWS."""
    return triton is not None and x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype


def decode_linear(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False, tile: Launch | None = None,
                  partial: bool = False) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> (M, N); with `silu_mul`, weight is gate and up stacked (2I, K) and the result
    SiLU(x @ gate^T) * (x @ up^T), (M, I). `tile`: the launch (`launch` by default). `partial` with split-K: the
    float32 partial sums (splits, M, N) as they are, for a consumer that adds them up itself."""
    rows, depth = x.shape
    columns = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert weight.stride(-1) == 1, "weight rows must be contiguous"
    tile = tile or launch(columns, depth) or DEFAULT
    assert tile.splits == 1 or not silu_mul, "SiLU-mul needs whole sums: no split-K"
    k_per_split, splits = split_sizes(depth, tile)
    out = torch.empty(splits, rows, columns, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    _decode_linear_kernel[(triton.cdiv(columns, tile.columns), splits)](
        x, weight, out, rows, columns, x.stride(0), weight.stride(0), out.stride(1), out.stride(0), K=depth,
        K_PER_SPLIT=k_per_split, BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=tile.columns,
        BLOCK_K=tile.depth, SILU_MUL=silu_mul, IEEE=x.dtype == torch.float32, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    if splits == 1:
        return out[0]
    if partial:
        return out
    total = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(rows * columns, block),)](out, total, rows * columns, SPLITS=splits, BLOCK=block)
    return total


if triton is not None:

    @triton.jit
    def _decode_linear_kernel(X, W, OUT, M, N, stride_xm, stride_wn, stride_om, stride_os, K: tl.constexpr,
                              K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, IEEE: tl.constexpr):
        columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        depth = tl.arange(0, BLOCK_K)
        w_rows = W + columns[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K_PER_SPLIT, BLOCK_K):
            k = split * K_PER_SPLIT + start + depth
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
        out = OUT + split * stride_os + rows[:, None] * stride_om + columns[None, :]
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _sum_splits_kernel(PARTIALS, OUT, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        """OUT (numel,) = the sum over SPLITS float32 partials (SPLITS, numel), rounded once to OUT's dtype."""
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for split in range(SPLITS):
            total += tl.load(PARTIALS + split * numel + offsets, mask=mask, other=0.0)
        tl.store(OUT + offsets, total.to(OUT.dtype.element_ty), mask=mask)


@torch.library.custom_op("hybridrl::decode_linear", mutates_args=())
def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool, partial: bool) -> torch.Tensor:
    """`decode_linear` where it `applies` and `launch` has a tile for the product, else F.linear (and SiLU-mul): an
    operator of its own so that a compiled decode piece calls it as it is, and the choice by batch is made when the
    step runs (or is captured), not traced. `partial`: the result of a split-K launch stays (splits, M, N) float32
    partial sums (`partial_splits` of them; F.linear's result then comes as the first of zero-padded ones)."""
    tile = launch(weight.shape[0] // 2 if silu_mul else weight.shape[0], x.shape[-1])
    if tile is not None and applies(x, weight):
        return decode_linear(x, weight, silu_mul, tile, partial)
    out = torch.nn.functional.linear(x, weight)
    splits = partial_splits(weight, silu_mul, partial)
    if splits > 1:
        padded = out.new_zeros(splits, *out.shape, dtype=torch.float32)
        padded[0] = out
        return padded
    if not silu_mul:
        return out
    gate, up = out.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def partial_splits(weight: torch.Tensor, silu_mul: bool, partial: bool) -> int:
    """How many partial sums `small_batch_linear` returns for this weight (1: a plain (M, N) result)."""
    tile = launch(weight.shape[0] // 2 if silu_mul else weight.shape[0], weight.shape[1])
    return split_sizes(weight.shape[1], tile)[1] if partial and tile is not None else 1


@small_batch_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool, partial: bool) -> torch.Tensor:
    columns = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    splits = partial_splits(weight, silu_mul, partial)
    if splits > 1:
        return x.new_empty(splits, x.shape[0], columns, dtype=torch.float32)
    return x.new_empty(x.shape[0], columns)
