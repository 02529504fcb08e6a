"""The decode step's sampling kernels against `sample_and_record` (Triton's interpreter on CPU), their lowering for
GPUs, and which settings use them."""

from __future__ import annotations

import os
import sys

import pytest

from hybridrl.rollout.engine.sampling import SamplerSettings
from hybridrl.rollout.kernels import sampling_kernels

sys.path.insert(0, os.path.dirname(__file__))
from decode_attention_cases import run_in_interpreter  # noqa: E402

HAS_TRITON = sampling_kernels.triton is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (optional; CPU uses PyTorch)")


@needs_triton
def test_kernels_match_the_reference_sampler_in_interpret_mode():
    output = run_in_interpreter("sampling_kernel_cases", "check_kernels_match_the_reference")
    assert "sampling kernels passed" in output, output


@needs_triton
def test_only_plain_temperature_sampling_uses_the_kernels():
    assert sampling_kernels.sampling_kernel_applies(SamplerSettings(temperature=0.8), 1000)
    for settings in (SamplerSettings(temperature=0), SamplerSettings(top_k=5), SamplerSettings(top_p=0.9),
                     SamplerSettings(min_p=0.1)):
        assert not sampling_kernels.sampling_kernel_applies(settings, 1000), settings
    assert not sampling_kernels.sampling_kernel_applies(SamplerSettings(), 10007)  # a prime: one block of 10007


def compile_for(arch: int, kernel, signature: dict, constants: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {name: "constexpr" for name in kernel.arg_names}
    full.update(signature)
    return sampling_kernels.triton.compile(ASTSource(kernel, full, constants), target=GPUTarget("cuda", arch, 32),
                                           options=dict(num_warps=4))


@needs_triton
@pytest.mark.parametrize("arch, dtype", [(90, "bf16"), (80, "bf16"), (89, "fp16"), (90, "fp32")])
def test_kernels_compile_for_gpus(arch, dtype):
    """The interpreter does not lower the kernels; this does (to a cubin), on CPU: the grpo-0.5b shape (blocks of 128,
    1187 blocks) on Hopper, Ampere and Ada."""
    if not isinstance(sampling_kernels._block_stats_kernel, sampling_kernels.triton.runtime.JITFunction):
        pytest.skip("the kernels were built in interpret mode (TRITON_INTERPRET is set)")
    stats = compile_for(arch, sampling_kernels._block_stats_kernel,
                        dict(LOGITS="*" + dtype, MAXIMA="*fp32", SUMS="*fp32", stride_row="i32", num_blocks="i32",
                             inv_temperature="fp32"), dict(SIZE=128, SIZE_PAD=128, BLOCKS_PER_PROGRAM=64))
    pointers = dict(LOGITS="*" + dtype, MAXIMA="*fp32", SUMS="*fp32", UNIFORM_TABLE="*fp32", DONE="*i1",
                    GEN_LEN="*i64", LAST_TOKEN="*i64", OUT_TOKENS="*i64", OUT_LOGPROBS="*fp32", STOP_IDS="*i64")
    scalars = {name: "i32" for name in ("stride_row", "stride_uniform", "stride_tokens", "stride_logprobs",
                                        "num_blocks", "num_stops", "max_new_tokens")}
    draw = compile_for(arch, sampling_kernels._draw_and_record_kernel,
                       dict(pointers, **scalars, inv_temperature="fp32"),
                       dict(SIZE=128, SIZE_PAD=128, BLOCKS_PAD=2048, STOPS_PAD=2))
    assert "cubin" in stats.asm and "cubin" in draw.asm
