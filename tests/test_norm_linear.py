"""The fused residual + RMSNorm + linear (+ SwiGLU) decode kernel: its reference against the plain
computation, the kernel against the reference in Triton's interpreter, and lowering for the GPUs we target."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridrl.rollout import norm_linear
from hybridrl.rollout.llama_forward import rms_norm
from hybridrl.rollout.norm_linear import fold_norm, reference_norm_linear

HAS_TRITON = norm_linear.triton is not None
SHAPES = [(5, 70, 40), (64, 64, 64), (130, 96, 200)]  # (rows, outputs, inner): partial and whole blocks


def make_inputs(rows, outputs, inner, residuals, swiglu, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(dtype)  # noqa: E731
    weight = randn(outputs * (2 if swiglu else 1), inner) * inner ** -0.5
    return randn(rows, inner), tuple(randn(rows, inner) for _ in range(residuals)), weight, 1 + randn(inner) * 0.1


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("residuals", [0, 1, 2])
def test_reference_equals_norm_then_linear(residuals, swiglu):
    """Folding the norm weight into W and scaling rows by 1/rms afterwards is the same as the decode step's
    own residual add, RMSNorm and projection(s), in float32."""
    h, extra, weight, norm_weight = make_inputs(9, 24, 32, residuals, swiglu)
    y, x = reference_norm_linear(h, extra, fold_norm(weight, norm_weight), eps=1e-6, swiglu=swiglu)
    expected_x = h + sum(extra) if extra else h
    expected = F.linear(rms_norm(expected_x, norm_weight, 1e-6), weight)
    if swiglu:
        gate, up = expected.chunk(2, dim=-1)
        expected = F.silu(gate) * up
    torch.testing.assert_close(x, expected_x, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def check_kernel_cases() -> None:
    """Run with TRITON_INTERPRET=1: the kernel equals the reference (float32, float16), every residual count,
    with and without SwiGLU, on shapes that end in partial blocks."""
    from hybridrl.rollout.norm_linear import triton_norm_linear

    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for shape in SHAPES:
            for residuals in (0, 1, 2):
                for swiglu in (False, True):
                    h, extra, weight, norm_weight = make_inputs(*shape, residuals, swiglu, dtype)
                    folded = fold_norm(weight, norm_weight)
                    y, x = triton_norm_linear(h, extra, folded, 1e-6, swiglu)
                    want_y, want_x = reference_norm_linear(h, extra, folded, 1e-6, swiglu)
                    torch.testing.assert_close(x, want_x, atol=tolerance, rtol=tolerance)
                    torch.testing.assert_close(y, want_y, atol=tolerance, rtol=tolerance)
    print("norm linear cases passed")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
def test_kernel_matches_reference_in_interpret_mode():
    sys.path.insert(0, os.path.dirname(__file__))
    from decode_attention_cases import run_in_interpreter

    assert "norm linear cases passed" in run_in_interpreter("test_norm_linear", "check_kernel_cases", timeout=600)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
@pytest.mark.parametrize("arch, shared_limit", [(90, 227 * 1024), (89, 99 * 1024), (80, 163 * 1024)])
def test_kernel_lowers_for_our_gpus(arch, shared_limit):
    """bf16, every residual count the engine uses, with and without SwiGLU: compiled to cubins on CPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = norm_linear._norm_linear_kernel
    if not isinstance(kernel, norm_linear.triton.runtime.JITFunction):
        pytest.skip("the kernel was built in interpret mode (TRITON_INTERPRET is set)")
    signature = {name: "*bf16" for name in ("H", "R1", "R2", "W", "OUT", "X_OUT")}
    signature.update({name: "i32" for name in ("M", "N", "K", "stride_h", "stride_r1", "stride_r2", "stride_w",
                                                "stride_o", "stride_x")}, eps="fp32")
    for residuals, swiglu in ((0, False), (2, False), (1, True)):
        launch = norm_linear.LAUNCH[swiglu]
        constants = dict(NUM_RESIDUALS=residuals, SWIGLU=swiglu, IEEE=False, BLOCK_M=launch.block_m,
                         BLOCK_N=launch.block_n, BLOCK_K=launch.block_k)
        full = {name: signature.get(name, "constexpr") for name in kernel.arg_names}
        compiled = norm_linear.triton.compile(ASTSource(kernel, full, constants), target=GPUTarget("cuda", arch, 32),
                                              options=dict(num_warps=launch.num_warps,
                                                           num_stages=launch.num_stages))
        assert "cubin" in compiled.asm and compiled.metadata.shared <= shared_limit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
def test_kernel_on_cuda_at_the_benchmark_shapes():
    """bf16 at the grpo-0.5b decode shapes (512 rows, hidden 896; q/k/v 1152 outputs, gate/up 2 x 4864)."""
    from hybridrl.rollout.norm_linear import triton_norm_linear

    for outputs, residuals, swiglu in ((1152, 2, False), (4864, 1, True), (1152, 0, False)):
        h, extra, weight, norm_weight = make_inputs(512, outputs, 896, residuals, swiglu)
        h, extra, weight, norm_weight = (h.cuda().bfloat16(), tuple(r.cuda().bfloat16() for r in extra),
                                         weight.cuda().bfloat16(), norm_weight.cuda().bfloat16())
        folded = fold_norm(weight, norm_weight)
        y, x = triton_norm_linear(h, extra, folded, 1e-6, swiglu)
        want_y, want_x = reference_norm_linear(h, extra, folded, 1e-6, swiglu)
        torch.testing.assert_close(x, want_x, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(y, want_y, atol=2e-2, rtol=2e-2)
