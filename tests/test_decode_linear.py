"""The skinny-batch projection kernel and the narrow-batch decode pieces: the kernel against F.linear and the engine
with it against HF (Triton's interpreter on CPU), its lowering for Hopper, and that the pieces equal the regular ones
when their projection is F.linear."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridrl.rollout.kernels import decode_linear

sys.path.insert(0, os.path.dirname(__file__))
from decode_attention_cases import run_in_interpreter  # noqa: E402

needs_triton = pytest.mark.skipif(decode_linear.triton is None, reason="triton is not installed (optional)")


@needs_triton
def test_kernel_matches_linear_in_interpret_mode():
    output = run_in_interpreter("decode_linear_cases", "check_kernel_matches_linear")
    assert "decode_linear kernel passed" in output, output


@needs_triton
def test_engine_with_the_kernel_matches_hf_in_interpret_mode():
    output = run_in_interpreter("decode_linear_cases", "check_engine_with_kernel", timeout=600)
    assert "engine with decode_linear passed" in output, output


@needs_triton
@pytest.mark.parametrize("columns, depth, silu_mul", [(2048, 1536, False), (1536, 8960, False), (17920, 1536, True),
                                                      (151936, 1536, False)])
@pytest.mark.parametrize("block_m", [16, 32])
def test_kernel_pipelines_its_loads_on_hopper(columns, depth, silu_mul, block_m):
    """Lowered for sm_90 at the 1.5B shape's products (on CPU): the weight loads go through cp.async (software
    pipelined, so several tiles are in flight), nothing spills, and shared memory fits one SM (228 KB)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = decode_linear._decode_linear_kernel
    if not isinstance(kernel, decode_linear.triton.runtime.JITFunction):
        pytest.skip("the kernel was built in interpret mode (TRITON_INTERPRET is set)")
    signature = {name: "constexpr" for name in kernel.arg_names}
    signature.update(X="*bf16", W="*bf16", OUT="*bf16", M="i32", N="i32", stride_xm="i32", stride_wn="i32",
                     stride_om="i32")
    # Triton specialises arguments divisible by 16 at launch (all of these are at this shape): so here.
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ("X", "W", "OUT", "N", "stride_xm", "stride_wn", "stride_om")}
    block_n, block_k = decode_linear.launch(columns // 2 if silu_mul else columns)
    constants = dict(K=depth, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=silu_mul, IEEE=False)
    compiled = decode_linear.triton.compile(ASTSource(kernel, signature, constants, attrs),
                                            target=GPUTarget("cuda", 90, 32),
                                            options=dict(num_warps=decode_linear.NUM_WARPS,
                                                         num_stages=decode_linear.NUM_STAGES))
    ptx = compiled.asm["ptx"]
    assert "cp.async" in ptx and ".local" not in ptx
    assert compiled.metadata.shared <= 228 * 1024


def test_small_batch_pieces_equal_the_regular_ones_with_f_linear():
    """On CPU the operator is F.linear (and SiLU-mul): the narrow-batch pieces compute what the regular pieces do."""
    from test_builtin_engine import make_model

    from hybridrl.rollout.engine import small_batch
    from hybridrl.rollout.engine.llama_forward import attention_inputs, attention_output_and_mlp
    from hybridrl.rollout.engine.weights import resolve_weights, unpacked

    model = make_model("qwen2")
    weights = resolve_weights(model, fuse_qkv=True, fuse_gate_up=True)
    layer = unpacked(weights.layers[0])
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(3, model.config.hidden_size, generator=generator)
    pending = (torch.randn(3, model.config.hidden_size, generator=generator),)
    for got, want in zip(small_batch.small_attention_inputs(weights, layer, h, pending, None, None),
                         attention_inputs(weights, layer, h, pending, None, None)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    attn = torch.randn(3, weights.num_kv_heads, weights.num_heads // weights.num_kv_heads, weights.head_dim,
                       generator=generator)
    for got, want in zip(small_batch.small_attention_output_and_mlp(weights, layer, h, attn),
                         attention_output_and_mlp(weights, layer, h, attn)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
