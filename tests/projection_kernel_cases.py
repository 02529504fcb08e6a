"""Cases for the split-K projection kernel (`hybridrl/rollout/projection_kernels.py`), run by
test_projection_kernels.py inside Triton's interpreter (a subprocess with TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridrl.rollout.projection_kernels import reference_split_k_linear, triton_split_k_linear

# (rows, depth, out, dtype, splits): ragged tiles everywhere (rows, columns and slices that are not multiples of the
# tiles), one split, more splits than blocks (empty slices), and 16-bit weights. No bfloat16 here: triton 3.6's
# interpreter rounds float32 to bfloat16 wrongly (values off by 1e11 where float16 matches exactly); bfloat16 is
# checked on the GPU (`test_projection_kernels.py`, marked gpu).
CASES = [(5, 70, 24, torch.float32, 1), (5, 70, 24, torch.float32, 3), (33, 200, 40, torch.float16, 4),
         (3, 96, 130, torch.float16, 2), (2, 64, 16, torch.float32, 5)]
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
             torch.float16: dict(atol=3e-3, rtol=3e-3)}


def make_case(rows: int, depth: int, out: int, dtype: torch.dtype, swiglu: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, (2 if swiglu else 1) * depth, generator=generator) * 2).to(dtype)
    weight = (torch.randn(out, depth, generator=generator) / depth**0.5).to(dtype)
    return x, weight


def plain_projection(x: torch.Tensor, weight: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """What the engine computes without the kernel: (silu(gate) * up in the weights' dtype, then) the matmul."""
    if swiglu:
        gate, up = x.float().chunk(2, dim=-1)
        x = (F.silu(gate) * up).to(weight.dtype)
    return F.linear(x.float(), weight.float())


def check_kernel_matches_the_reference() -> None:
    for swiglu in (False, True):
        for rows, depth, out, dtype, splits in CASES:
            x, weight = make_case(rows, depth, out, dtype, swiglu)
            got = triton_split_k_linear(x, weight, splits=splits, swiglu=swiglu)
            assert got.shape == (splits, rows, out) and got.dtype == torch.float32
            reference = reference_split_k_linear(x, weight, splits=splits, swiglu=swiglu)
            torch.testing.assert_close(got.sum(0), reference.sum(0), **TOLERANCE[dtype])
            torch.testing.assert_close(got.sum(0), plain_projection(x, weight, swiglu), **TOLERANCE[dtype])
            print(f"swiglu {swiglu} rows {rows} depth {depth} out {out} {dtype} splits {splits}: match")
    print("projection kernel passed")
