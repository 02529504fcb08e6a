"""The fused SwiGLU + down projection: the PyTorch reference against the plain MLP, the Triton kernel against both
(Triton's interpreter on CPU), and its lowering for GPUs."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hybridrl.rollout import mlp_kernels

sys.path.insert(0, os.path.dirname(__file__))
import mlp_kernel_cases as cases  # noqa: E402
from decode_attention_cases import run_in_interpreter  # noqa: E402

needs_triton = pytest.mark.skipif(mlp_kernels.triton is None, reason="triton is not installed (optional)")


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_reference_partials_sum_to_the_plain_mlp(splits):
    gate_up, down = cases.make_case(6, 100, 12, torch.float32)
    partials = mlp_kernels.reference_swiglu_down(gate_up, down, splits=splits)
    assert partials.shape == (splits, 6, 12)
    torch.testing.assert_close(partials.sum(0), cases.plain_mlp_down(gate_up, down), atol=1e-5, rtol=1e-5)


@needs_triton
def test_kernel_matches_the_reference_in_interpret_mode():
    assert "mlp kernel passed" in run_in_interpreter("mlp_kernel_cases", "check_kernel_matches_the_reference")


@needs_triton
@pytest.mark.parametrize("arch, dtype", [(90, "bf16"), (80, "bf16"), (89, "fp16"), (90, "fp32")])
def test_kernel_compiles_for_gpus(arch, dtype):
    """The interpreter does not lower the kernel; this does (to a cubin) on CPU, and checks its shared memory."""
    kernel = mlp_kernels._swiglu_down_kernel
    if not isinstance(kernel, mlp_kernels.triton.runtime.JITFunction):
        pytest.skip("the kernel was built in interpret mode (TRITON_INTERPRET is set)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" for name in kernel.arg_names}
    signature.update(GATE_UP="*" + dtype, W="*" + dtype, OUT="*fp32")
    signature.update({name: "i32" for name in ("rows", "hidden", "intermediate", "stride_gm", "stride_wn",
                                                "stride_os", "stride_om", "per_split")})
    block_k = mlp_kernels.BLOCK_K // 2 if dtype == "fp32" else mlp_kernels.BLOCK_K  # as the launcher picks it
    constants = dict(BLOCK_M=mlp_kernels.BLOCK_M, BLOCK_N=mlp_kernels.BLOCK_N, BLOCK_K=block_k, IEEE=dtype == "fp32")
    compiled = mlp_kernels.triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", arch, 32),
                                          options=dict(num_warps=mlp_kernels.NUM_WARPS))
    assert "cubin" in compiled.asm and compiled.metadata.shared <= 99 * 1024  # fits an RTX 4090 / A6000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or mlp_kernels.triton is None, reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_the_plain_mlp_on_gpu(dtype):
    """bfloat16 (which the interpreter cannot check) and float32, at the grpo-0.5b decode shape and a ragged one."""
    for rows, intermediate, hidden, splits in ((512, 4864, 896, mlp_kernels.SPLITS), (37, 200, 40, 3)):
        gate_up, down = (t.cuda() for t in cases.make_case(rows, intermediate, hidden, dtype))
        got = mlp_kernels.triton_swiglu_down(gate_up, down, splits=splits).sum(0)
        torch.testing.assert_close(got, cases.plain_mlp_down(gate_up, down), **cases.TOLERANCE[dtype])
