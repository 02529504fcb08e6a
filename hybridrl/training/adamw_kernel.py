"""`optim.adamw_chunk` as one hand-written Triton kernel: LeanAdamW's update of a flat bucket on CUDA.

Why not `torch.compile(adamw_chunk)`: one kernel too, but every process pays dynamo's trace and inductor's code
generation at its first optimizer step (seconds), and each later call its guards. This kernel is compiled by Triton
once per machine and signature (kept in Triton's cache on disk), and a call is one launch.

Same arithmetic as `adamw_chunk`, in float32, element by element: the moments updated in place, the new weights
written to a fresh tensor in the weights' dtype, bf16 ones stochastically rounded with the counter hash of
`optim.counter_noise` (its 32-bit products wrap natively in uint32 here). `hyper` is read on the device (lr, betas,
eps, decay, bias corrections, apply, gradient scale), so no value is a compile-time constant and `apply` 0 leaves
everything as it was. `TRITON_INTERPRET=1` set before the first import runs the kernel on CPU tensors (the tests do).
"""

from __future__ import annotations

import threading

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: optim.adamw_chunk runs eagerly
    triton = None
try:  # Triton 3: the hash of Triton's own sources and library that starts every kernel's cache key
    from triton.runtime.cache import triton_key
except ImportError:
    triton_key = None

BLOCK = 1024
"""Elements per program: enough to keep the loads wide; the update is bound by memory traffic."""

if triton is not None:
    @triton.jit(do_not_specialize=["numel"])  # one build for every bucket size, not one per divisibility class
    def _adamw_kernel(WEIGHTS, GRADS, M, V, OUT, HYPER, NOISE_BASE, numel, ROUND: tl.constexpr,
                      GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        valid = offsets < numel
        lr = tl.load(HYPER + 0)
        beta1 = tl.load(HYPER + 1)
        beta2 = tl.load(HYPER + 2)
        eps = tl.load(HYPER + 3)
        decay = tl.load(HYPER + 4)
        correction1 = tl.load(HYPER + 5)
        correction2 = tl.load(HYPER + 6)
        apply = tl.load(HYPER + 7)
        scale = tl.load(HYPER + 8)
        grad = tl.load(GRADS + offsets, mask=valid, other=0.0)
        scaled = grad.to(tl.float32) * scale  # gradient clipping's grad.mul_(scale), rounded as it rounds:
        if GRAD_BF16:  # to nearest even bf16, in bits (Triton's interpreter would truncate a cast)
            bits = scaled.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            scaled = bits.to(tl.float32, bitcast=True)
        else:
            scaled = scaled.to(GRADS.dtype.element_ty).to(tl.float32)
        grad = tl.where(apply > 0, scaled, 0.0)
        m = tl.load(M + offsets, mask=valid, other=0.0)
        v = tl.load(V + offsets, mask=valid, other=0.0)
        m = m + (1 - beta1) * apply * (grad - m)  # torch.lerp_ for weights below 0.5
        v = v * (1 - (1 - beta2) * apply) + (1 - beta2) * apply * grad * grad
        tl.store(M + offsets, m, mask=valid)
        tl.store(V + offsets, v, mask=valid)
        updated = tl.load(WEIGHTS + offsets, mask=valid, other=0.0).to(tl.float32) * (1 - lr * decay * apply)
        updated = updated - tl.div_rn((lr * apply / correction1) * m, tl.div_rn(tl.sqrt_rn(v), tl.sqrt_rn(correction2)) + eps)
        if ROUND:  # stochastic rounding to bf16 with optim.counter_noise's bits
            x = (tl.load(NOISE_BASE) + offsets).to(tl.uint32)  # the counter mod 2**32
            x = x ^ (x >> 16)
            x = x * 0x7FEB352D
            x = x ^ (x >> 15)
            x = x * 0x846CA68B
            x = x ^ (x >> 16)
            noise = (x >> 16).to(tl.int32)
            bits = updated.to(tl.int32, bitcast=True)
            updated = ((bits + noise) & -65536).to(tl.float32, bitcast=True)
        tl.store(OUT + offsets, updated.to(OUT.dtype.element_ty), mask=valid)


_pending: threading.Thread | None = None
"""The running `prefetch_cache_key` thread, joined before the first launch (`wait_for_cache_key`)."""


def prefetch_cache_key() -> threading.Thread | None:
    """Compute `triton_key` in a background thread (the thread, or None without Triton 3). Computed once per process,
    at the first kernel a process looks up: it hashes Triton's sources and its ~400 MB library, 0.4 s of the first
    optimizer step on the GPU machines. The trainer starts it with its first step, so it runs while the first rollout
    does (the hashing releases the GIL); started any earlier, its seconds would leave the steps' clock."""
    global _pending
    if triton_key is None:
        return None

    def compute() -> None:
        try:
            triton_key()
        except Exception:  # noqa: BLE001 - an unusual install; the first kernel lookup computes (or reports) it
            pass
    _pending = threading.Thread(target=compute, name="triton-cache-key", daemon=True)
    _pending.start()
    return _pending


def wait_for_cache_key() -> None:
    """Join a running `prefetch_cache_key`: a kernel lookup meanwhile would compute the same hash again beside it."""
    global _pending
    if _pending is not None:
        _pending.join()
        _pending = None


def available(device: torch.device) -> bool:
    """Whether the kernel serves tensors on `device` (CUDA with Triton importable)."""
    return triton is not None and device.type == "cuda"


def triton_adamw_chunk(weights: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                       noise_base: torch.Tensor | None, hyper: torch.Tensor) -> torch.Tensor:
    """`optim.adamw_chunk` in one launch: flat contiguous `weights`, `grad` and float32 moments `m`, `v` (updated in
    place); returns the new weights in the weights' dtype. `noise_base` (one int64 on the device) is given exactly
    for bf16 weights, which are then stochastically rounded."""
    if triton is None:
        raise ImportError("triton is not installed; use optim.adamw_chunk")
    out = torch.empty_like(weights)
    numel = weights.numel()
    if numel:
        wait_for_cache_key()
        rounded = noise_base is not None
        _adamw_kernel[(triton.cdiv(numel, BLOCK),)](
            weights, grad, m, v, out, hyper, noise_base if rounded else hyper, numel, ROUND=rounded,
            GRAD_BF16=grad.dtype == torch.bfloat16, BLOCK=BLOCK, num_warps=4)
    return out
