"""Cases for the fused LM-head kernels, run by test_fused_head.py (also inside Triton's interpreter)."""

from __future__ import annotations

import torch

from hybridrl.training import fused_head

# (rows, vocab, dtype, scale): vocab below one block, one block and a ragged tail, several blocks.
CASES = [(3, 50, torch.float32, 1.0), (5, 2048 + 7, torch.float32, 1 / 0.7), (4, 3 * 2048, torch.bfloat16, 1.0),
         (2, 4100, torch.float16, 2.0)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def make_case(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(dtype)
    logits[0, 7 % vocab] = 40.0  # one peaked row: a large max must not overflow or lose the rest
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[0], targets[-1] = 0, vocab - 1  # first and last column (the ragged tail)
    grads = torch.randn(2, rows, generator=generator)
    return logits.to(device), targets.to(device), grads[0].to(device), grads[1].to(device)


def check_kernel_cases(device: str = "cpu") -> None:
    for seed, (rows, vocab, dtype, scale) in enumerate(CASES):
        logits, targets, g_logp, g_entropy = make_case(rows, vocab, dtype, seed, device)
        want = fused_head.reference_softmax_stats(logits, targets, scale)
        got = fused_head.triton_softmax_stats(logits, targets, scale)
        for name, mine, reference in zip(("logp", "entropy", "log_norm"), got, want):
            error = (mine - reference).abs().max().item()
            assert error <= 2e-5 * max(1.0, reference.abs().max().item()), (name, rows, vocab, dtype, error)
        want_grad = fused_head.reference_softmax_grad(logits, targets, want[2], want[1], g_logp, g_entropy, scale)
        got_grad = fused_head.triton_softmax_grad_(logits.clone(), targets, want[2], want[1], g_logp, g_entropy, scale)
        assert got_grad.dtype == logits.dtype
        error = (got_grad.float() - want_grad.float()).abs().max().item()
        assert error <= TOLERANCE[dtype] * max(1.0, want_grad.float().abs().max().item()), (rows, vocab, dtype, error)
    print("fused head cases passed")
