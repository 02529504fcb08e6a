"""The split-K projections (o, and down with the SwiGLU fused): the PyTorch reference against the plain projection,
the Triton kernel against both (Triton's interpreter on CPU; bfloat16 on the GPU), and its lowering for GPUs."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hybridrl.rollout import projection_kernels

sys.path.insert(0, os.path.dirname(__file__))
import projection_kernel_cases as cases  # noqa: E402
from decode_attention_cases import run_in_interpreter  # noqa: E402

needs_triton = pytest.mark.skipif(projection_kernels.triton is None, reason="triton is not installed (optional)")


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_reference_partials_sum_to_the_plain_projection(splits, swiglu):
    x, weight = cases.make_case(6, 100, 12, torch.float32, swiglu)
    partials = projection_kernels.reference_split_k_linear(x, weight, splits=splits, swiglu=swiglu)
    assert partials.shape == (splits, 6, 12)
    torch.testing.assert_close(partials.sum(0), cases.plain_projection(x, weight, swiglu), atol=1e-5, rtol=1e-5)


@needs_triton
def test_kernel_matches_the_reference_in_interpret_mode():
    assert "projection kernel passed" in run_in_interpreter("projection_kernel_cases",
                                                            "check_kernel_matches_the_reference")


@needs_triton
@pytest.mark.parametrize("arch, dtype", [(90, "bf16"), (80, "bf16"), (89, "fp16"), (90, "fp32")])
@pytest.mark.parametrize("swiglu", [False, True])
def test_kernel_compiles_for_gpus(arch, dtype, swiglu):
    """The interpreter does not lower the kernel; this does (to a cubin) on CPU, and checks its shared memory."""
    kernel = projection_kernels._split_k_kernel
    if not isinstance(kernel, projection_kernels.triton.runtime.JITFunction):
        pytest.skip("the kernel was built in interpret mode (TRITON_INTERPRET is set)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" for name in kernel.arg_names}
    signature.update(X="*" + dtype, W="*" + dtype, OUT="*fp32")
    signature.update({name: "i32" for name in ("rows", "out_features", "depth", "stride_xm", "stride_wn",
                                                "stride_os", "stride_om", "per_split")})
    block_k = projection_kernels.BLOCK_K // 2 if dtype == "fp32" else projection_kernels.BLOCK_K  # as launched
    constants = dict(BLOCK_M=projection_kernels.BLOCK_M, BLOCK_N=projection_kernels.BLOCK_N, BLOCK_K=block_k,
                     IEEE=dtype == "fp32", SWIGLU=swiglu)
    compiled = projection_kernels.triton.compile(ASTSource(kernel, signature, constants),
                                                 target=GPUTarget("cuda", arch, 32),
                                                 options=dict(num_warps=projection_kernels.NUM_WARPS))
    assert "cubin" in compiled.asm and compiled.metadata.shared <= 99 * 1024  # fits an RTX 4090 / A6000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or projection_kernels.triton is None, reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_the_plain_projection_on_gpu(dtype):
    """bfloat16 (which the interpreter cannot check) and float32, at the grpo-0.5b decode shapes and a ragged one."""
    shapes = ((512, 4864, 896, True), (512, 896, 896, False), (37, 200, 40, True), (37, 200, 40, False))
    for rows, depth, out, swiglu in shapes:
        x, weight = (t.cuda() for t in cases.make_case(rows, depth, out, dtype, swiglu))
        got = projection_kernels.triton_split_k_linear(x, weight, swiglu=swiglu).sum(0)
        torch.testing.assert_close(got, cases.plain_projection(x, weight, swiglu), **cases.TOLERANCE[dtype])
