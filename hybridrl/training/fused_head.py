"""Softmax statistics of LM-head logits and their gradient, in one pass each: Triton kernels and the PyTorch reference.

`logprobs._ChunkedHeadLogprobs` makes a chunk of logits (C, V) with one matmul; everything after it is
elementwise over (C, V). Written in PyTorch that is a dozen float32 passes over memory (cast, scale,
logsumexp, softmax, products, sums; about twice as many in backward), which on the grpo-0.5b shape
(131k response tokens x 152k vocabulary per step) cost more GPU time than the head's matmuls. Here:

- forward, `softmax_stats`: one read of the logits per row, an online softmax keeping a running max,
  sum of exp(z - max) and sum of exp(z - max) * z, which give the log-normaliser, log p(target) and
  the entropy H = log_norm - E_p[z]. All float32, z = logits * scale.
- backward, `softmax_grad_`: one read and one in-place write of the logits, with
      d(loss)/d(logits) = scale * (g_logp * (onehot(target) - p) - g_entropy * p * (log p + H))
  from the saved log-normaliser and entropy. The chunk's logits are consumed: their buffer becomes
  the gradient (no second (C, V) tensor, nothing float32 of that size).

Both dispatch to Triton for CUDA tensors when Triton is importable, else to the `reference_*`
functions (plain float32 PyTorch), which are the oracle of the tests and what runs on CPU. One
program per row loops over the vocabulary in fixed blocks: no autotuning, no host sync. Every block
is loaded with masked lanes set to a large negative finite value (never -inf), so no lane ever
forms inf - inf. `TRITON_INTERPRET=1` set before the first import runs the kernels on CPU tensors.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below is all there is
    triton = None

BLOCK_V = 2048
"""Vocabulary entries per loop iteration (fixed, so every launch is the same kernel)."""
# Masked lanes hold -1e30 instead of -inf (written as a literal in the kernels: Triton reads no Python
# globals): exp(-1e30 - m) is 0 and -1e30 - (-1e30) is 0, never NaN.


def reference_softmax_stats(logits: torch.Tensor, targets: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(C, V) logits, (C,) targets -> float32 log p(target), entropy, log-normaliser of softmax(logits * scale)."""
    z = logits.float() * scale
    log_norm = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - log_norm
    entropy = log_norm - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, entropy, log_norm


def reference_softmax_grad(logits: torch.Tensor, targets: torch.Tensor, log_norm: torch.Tensor,
                           entropy: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """d(loss)/d(logits) in logits' dtype, given d(loss)/d(log p(target)) and d(loss)/d(entropy) per row."""
    log_p = logits.float() * scale - log_norm[:, None]
    p = log_p.exp()
    grad = -p * (grad_logp[:, None] + grad_entropy[:, None] * (log_p + entropy[:, None]))
    grad.scatter_add_(-1, targets[:, None], grad_logp[:, None].float())
    return (grad * scale).to(logits.dtype)


if triton is not None:
    @triton.jit
    def _softmax_stats_kernel(LOGITS, stride_row, TARGETS, LOGP, ENTROPY, LOG_NORM, vocab, scale,
                              BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = LOGITS + row.to(tl.int64) * stride_row
        offsets = tl.arange(0, BLOCK)
        lane_max = tl.full((BLOCK,), -1e30, tl.float32)
        lane_sum = tl.zeros((BLOCK,), tl.float32)  # sum of exp(z - lane_max)
        lane_dot = tl.zeros((BLOCK,), tl.float32)  # sum of exp(z - lane_max) * z
        for start in range(0, vocab, BLOCK):
            cols = start + offsets
            valid = cols < vocab
            z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * scale
            z = tl.where(valid, z, -1e30)
            new_max = tl.maximum(lane_max, z)
            rescale = tl.exp(lane_max - new_max)
            e = tl.where(valid, tl.exp(z - new_max), 0.0)
            lane_sum = lane_sum * rescale + e
            lane_dot = lane_dot * rescale + e * tl.where(valid, z, 0.0)
            lane_max = new_max
        row_max = tl.max(lane_max, 0)
        weight = tl.exp(lane_max - row_max)
        total = tl.sum(lane_sum * weight, 0)
        log_norm = row_max + tl.log(total)
        target = tl.load(TARGETS + row)
        z_target = tl.load(base + target).to(tl.float32) * scale
        tl.store(LOGP + row, z_target - log_norm)
        tl.store(ENTROPY + row, log_norm - tl.sum(lane_dot * weight, 0) / total)
        tl.store(LOG_NORM + row, log_norm)

    @triton.jit
    def _softmax_grad_kernel(LOGITS, stride_row, TARGETS, LOG_NORM, ENTROPY, GRAD_LOGP, GRAD_ENTROPY, vocab,
                             scale, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = LOGITS + row.to(tl.int64) * stride_row
        offsets = tl.arange(0, BLOCK)
        log_norm = tl.load(LOG_NORM + row)
        entropy = tl.load(ENTROPY + row)
        g_logp = tl.load(GRAD_LOGP + row)
        g_entropy = tl.load(GRAD_ENTROPY + row)
        target = tl.load(TARGETS + row)
        for start in range(0, vocab, BLOCK):
            cols = start + offsets
            valid = cols < vocab
            log_p = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * scale - log_norm
            p = tl.exp(log_p)
            grad = -p * (g_logp + g_entropy * (log_p + entropy))
            grad = tl.where(cols == target, grad + g_logp, grad)
            tl.store(base + cols, (grad * scale).to(LOGITS.dtype.element_ty), mask=valid)


def _check_rows(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"expected row-major (C, V) logits, got shape {tuple(logits.shape)} strides {logits.stride()}")


def triton_softmax_stats(logits: torch.Tensor, targets: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference_softmax_stats` in one Triton pass (CUDA tensors, or CPU ones under TRITON_INTERPRET=1)."""
    if triton is None:
        raise ImportError("triton is not installed; use reference_softmax_stats")
    _check_rows(logits)
    rows, vocab = logits.shape
    logp, entropy, log_norm = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    if rows:
        _softmax_stats_kernel[(rows,)](logits, logits.stride(0), targets, logp, entropy, log_norm, vocab,
                                       float(scale), BLOCK=BLOCK_V, num_warps=8)
    return logp, entropy, log_norm


def triton_softmax_grad_(logits: torch.Tensor, targets: torch.Tensor, log_norm: torch.Tensor,
                         entropy: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """`reference_softmax_grad` in one Triton pass, written over `logits` (which is returned)."""
    if triton is None:
        raise ImportError("triton is not installed; use reference_softmax_grad")
    _check_rows(logits)
    rows, vocab = logits.shape
    if rows:
        _softmax_grad_kernel[(rows,)](logits, logits.stride(0), targets, log_norm, entropy,
                                      grad_logp.float().contiguous(), grad_entropy.float().contiguous(), vocab,
                                      float(scale), BLOCK=BLOCK_V, num_warps=8)
    return logits


def fused(logits: torch.Tensor) -> bool:
    """Whether the Triton kernels serve these logits (`fused_for` their vocabulary and device)."""
    return fused_for(logits.shape[-1], logits.is_cuda)


def fused_for(vocab: int, on_cuda: bool) -> bool:
    """CUDA with Triton importable and a vocabulary of more than one block. Within one block (a character-level
    model's vocabulary, say) the PyTorch reference moves little memory per chunk, while the kernels would cost a
    Triton build at a process's first update."""
    return triton is not None and on_cuda and vocab > BLOCK_V


def softmax_stats(logits, targets, scale):
    """log p(target), entropy and log-normaliser (float32, (C,)) of softmax(logits * scale)."""
    return triton_softmax_stats(logits, targets, scale) if fused(logits) else reference_softmax_stats(logits, targets, scale)


def softmax_grad_(logits, targets, log_norm, entropy, grad_logp, grad_entropy, scale):
    """d(loss)/d(logits); may overwrite `logits` with it (the Triton path does), so do not reuse them."""
    if fused(logits):
        return triton_softmax_grad_(logits, targets, log_norm, entropy, grad_logp, grad_entropy, scale)
    return reference_softmax_grad(logits, targets, log_norm, entropy, grad_logp, grad_entropy, scale)
