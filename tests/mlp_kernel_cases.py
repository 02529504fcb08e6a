"""Cases for the fused SwiGLU + down projection kernel (`hybridrl/rollout/mlp_kernels.py`), run by
test_mlp_kernels.py inside Triton's interpreter (a subprocess with TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridrl.rollout.mlp_kernels import reference_swiglu_down, triton_swiglu_down

# (rows, intermediate, hidden, dtype, splits): ragged tiles everywhere (rows, columns and slices that are not
# multiples of the tiles), one split, more splits than blocks (empty slices), and 16-bit weights. No bfloat16 here:
# triton 3.6's interpreter rounds float32 to bfloat16 wrongly (values off by 1e11 where float16 matches exactly);
# bfloat16 is checked on the GPU (`test_mlp_kernels.py`, marked gpu).
CASES = [(5, 70, 24, torch.float32, 1), (5, 70, 24, torch.float32, 3), (33, 200, 40, torch.float16, 4),
         (3, 96, 130, torch.float16, 2), (2, 64, 16, torch.float32, 5)]
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
             torch.float16: dict(atol=3e-3, rtol=3e-3)}


def make_case(rows: int, intermediate: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * intermediate, generator=generator) * 2).to(dtype)
    down = (torch.randn(hidden, intermediate, generator=generator) / intermediate**0.5).to(dtype)
    return gate_up, down


def plain_mlp_down(gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """What the engine computes without the kernel: silu(gate) * up in the weights' dtype, then the matmul."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.linear((F.silu(gate) * up).to(down.dtype).float(), down.float())


def check_kernel_matches_the_reference() -> None:
    for rows, intermediate, hidden, dtype, splits in CASES:
        gate_up, down = make_case(rows, intermediate, hidden, dtype)
        got = triton_swiglu_down(gate_up, down, splits=splits)
        assert got.shape == (splits, rows, hidden) and got.dtype == torch.float32
        reference = reference_swiglu_down(gate_up, down, splits=splits)
        torch.testing.assert_close(got.sum(0), reference.sum(0), **TOLERANCE[dtype])
        torch.testing.assert_close(got.sum(0), plain_mlp_down(gate_up, down), **TOLERANCE[dtype])
        print(f"rows {rows} intermediate {intermediate} hidden {hidden} {dtype} splits {splits}: match")
    print("mlp kernel passed")
