"""The fused LM-head softmax kernels equal the PyTorch reference, and the reference's closed-form gradient
equals autograd's (float64)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hybridrl.training import fused_head
from hybridrl.training.logprobs import token_logprobs

sys.path.insert(0, os.path.dirname(__file__))
from decode_attention_cases import run_in_interpreter  # noqa: E402
from fused_head_cases import check_kernel_cases, make_case  # noqa: E402

HAS_TRITON = fused_head.triton is not None


def test_reference_gradient_is_autograds():
    logits, targets, g_logp, g_entropy = make_case(6, 37, torch.float64, seed=3)
    logits.requires_grad_(True)
    logp, entropy, log_norm = fused_head.reference_softmax_stats(logits, targets, 1 / 0.6)
    assert logp.dtype == torch.float32 and torch.allclose(
        log_norm.double(), torch.logsumexp(logits.detach() / 0.6, -1), atol=1e-5)
    (logp * g_logp).sum().add((entropy * g_entropy).sum()).backward()
    closed_form = fused_head.reference_softmax_grad(logits.detach(), targets, log_norm, entropy, g_logp.float(),
                                                    g_entropy.float(), 1 / 0.6)
    assert torch.allclose(closed_form, logits.grad, atol=1e-5)


def test_cpu_tensors_use_the_reference():
    logits, targets, g_logp, g_entropy = make_case(3, 20, torch.float32)
    assert not fused_head.fused(logits)
    if fused_head.triton is not None:  # on CUDA: the kernels for vocabularies of more than one block only
        assert not fused_head.fused_for(fused_head.BLOCK_V, True) and fused_head.fused_for(fused_head.BLOCK_V + 1, True)
    stats = fused_head.softmax_stats(logits, targets, 1.0)
    assert torch.equal(stats[0], fused_head.reference_softmax_stats(logits, targets, 1.0)[0])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
def test_triton_kernels_match_reference_in_interpret_mode():
    assert "fused head cases passed" in run_in_interpreter("fused_head_cases", "check_kernel_cases")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
@pytest.mark.parametrize("arch, dtype", [(90, "bf16"), (90, "fp32"), (89, "bf16"), (80, "bf16"), (75, "fp16")])
def test_triton_kernels_compile_for_hopper(arch, dtype):
    """The interpreter does not lower the kernels; this compiles them to cubins on CPU: sm_90 (H100/H200)
    and the smaller cards a team may train on (RTX 40xx, A100, a T4 in float16), within 64 KiB of shared
    memory, the smallest of them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(fused_head._softmax_stats_kernel, fused_head.triton.runtime.JITFunction):
        pytest.skip("the kernels were built in interpret mode (TRITON_INTERPRET is set)")
    for kernel, pointers in ((fused_head._softmax_stats_kernel, {"LOGP", "ENTROPY", "LOG_NORM"}),
                             (fused_head._softmax_grad_kernel, {"LOG_NORM", "ENTROPY", "GRAD_LOGP", "GRAD_ENTROPY"})):
        signature = {"LOGITS": "*" + dtype, "stride_row": "i32", "TARGETS": "*i64", "vocab": "i32", "scale": "fp32",
                     "BLOCK": "constexpr", **{name: "*fp32" for name in pointers}}
        signature = {name: signature[name] for name in kernel.arg_names}
        compiled = fused_head.triton.compile(ASTSource(kernel, signature, {"BLOCK": fused_head.BLOCK_V}),
                                             target=GPUTarget("cuda", arch, 32), options=dict(num_warps=8))
        assert "cubin" in compiled.asm and compiled.metadata.shared <= 64 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
def test_fused_head_on_cuda():
    """Kernels vs reference on the GPU, then the whole chunked head (bf16, benchmark vocabulary) against
    float32 autograd on full logits: values, hidden and weight gradients (the float32 addmm path)."""
    check_kernel_cases("cuda")
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(700, 896, generator=generator) * 0.5).cuda().bfloat16()
    head = torch.nn.Linear(896, 151936, bias=False).cuda().bfloat16()
    targets = torch.randint(0, 151936, (700,), generator=generator).cuda()
    weights = torch.randn(2, 700, generator=generator).cuda()
    h32, w32 = hidden.float().requires_grad_(True), head.weight.detach().float().requires_grad_(True)
    log_probs = torch.log_softmax(h32 @ w32.t() / 0.9, -1)
    want_logp = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    want_entropy = -(log_probs.exp() * log_probs).sum(-1)
    ((want_logp * weights[0]).sum() + (want_entropy * weights[1]).sum()).backward()
    for chunk_tokens in (300, 100):  # one group of chunks per weight product, then two (the last one partial)
        hidden_in = hidden.clone().requires_grad_(True)
        head.weight.grad = None
        logp, entropy = token_logprobs(hidden_in, head, targets, temperature=0.9, with_entropy=True,
                                       chunk_tokens=chunk_tokens)
        ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        assert (logp - want_logp).abs().max() < 0.05 and (entropy - want_entropy).abs().max() < 0.05
        for mine, reference in ((hidden_in.grad, h32.grad), (head.weight.grad, w32.grad)):
            relative = (mine.float() - reference).norm() / reference.norm()
            assert relative < 0.02, (chunk_tokens, relative.item())
