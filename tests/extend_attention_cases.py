"""The extend attention kernel against the masked-matmul form, run by test_multiturn_extend.py in a TRITON_INTERPRET=1
subprocess (kept apart so that the kernel is built in interpret mode)."""

from __future__ import annotations

import torch

from hybridrl.rollout.engine.llama_forward import _masked_gqa_attention
from hybridrl.rollout.kernels.extend_attention import BLOCK_M, BLOCK_N, extend_attention

# (rows, new ids, query heads, KV heads, head_dim, keys): group 7 as Qwen2-0.5B's; folded queries past one BLOCK_M
# and keys past one BLOCK_N (several loop iterations, a partial last block); one id; one row.
CASES = [(5, 12, 14, 2, 32, 150), (3, 1, 4, 2, 16, 40), (1, 9, 4, 4, 16, BLOCK_N), (6, 3, 7, 1, 64, 9)]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def check_kernel_cases() -> None:
    """float32 and float16 (the interpreter's `tl.dot` is unusable for bf16; the GPU test covers it): rows at
    different offsets, and rows whose positions clamp at the last key (as `extend` passes a padded row's)."""
    assert BLOCK_M >= 16 and BLOCK_N >= 16
    generator = torch.Generator().manual_seed(5)
    for rows, length, heads, kv_heads, head_dim, keys in CASES:
        for dtype in (torch.float32, torch.float16):
            q = torch.randn(rows, length, heads, head_dim, generator=generator).to(dtype)
            k, v = (torch.randn(rows, kv_heads, keys, head_dim, generator=generator).to(dtype) for _ in range(2))
            starts = torch.randint(0, keys, (rows, 1), generator=generator)
            positions = (starts + torch.arange(length)).clamp(max=keys - 1)
            want = _masked_gqa_attention(q.float(), k.float(), v.float(), positions).to(dtype)
            torch.testing.assert_close(extend_attention(q, k, v, positions), want, **TOLERANCE[dtype])
    print("extend attention kernel: ok")
