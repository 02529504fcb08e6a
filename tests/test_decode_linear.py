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
@pytest.mark.parametrize("block_m", [16])
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
                     stride_om="i32", stride_os="i32")
    # Triton specialises arguments divisible by 16 at launch (all of these are at this shape): so here.
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ("X", "W", "OUT", "N", "stride_xm", "stride_wn", "stride_om", "stride_os")}
    tile = decode_linear.launch(columns // 2 if silu_mul else columns, depth) or decode_linear.DEFAULT
    k_per_split = decode_linear.split_sizes(depth, tile)[0]
    constants = dict(K=depth, K_PER_SPLIT=k_per_split, BLOCK_M=block_m, BLOCK_N=tile.columns, BLOCK_K=tile.depth,
                     SILU_MUL=silu_mul, IEEE=False)
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


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or decode_linear.triton is None,
                                reason="needs CUDA and triton")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_kernel_in_bf16_on_the_gpu_is_as_close_to_float32_as_cublas(rows):
    """The 1.5B shape's products in bf16: the kernel's largest error against F.linear in float32 at most twice
    cuBLAS's own (both round the float32 sums to bf16 once; SiLU-mul adds one rounding on cuBLAS's side)."""
    torch.manual_seed(rows)
    for columns, depth, silu_mul in [(2048, 1536, False), (1536, 8960, False), (17920, 1536, True)]:
        x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(columns, depth, device="cuda", dtype=torch.bfloat16) / depth**0.5
        expected, cublas = F.linear(x.float(), weight.float()), F.linear(x, weight).float()
        if silu_mul:
            expected, cublas = (F.silu(gate) * up for gate, up in (expected.chunk(2, -1), cublas.chunk(2, -1)))
        error = (decode_linear.decode_linear(x, weight, silu_mul).float() - expected).abs().max()
        assert error <= 2 * (cublas - expected).abs().max() + 1e-3, (columns, error)


@pytest.mark.gpu
@needs_cuda
def test_engine_with_small_batch_pieces_on_the_gpu(monkeypatch):
    """Compiled pieces and CUDA graphs with the narrow-batch pieces on (the kernel in every projection): float32
    greedy tokens equal the pieces-off engine's, log-probs HF's; bf16 log-probs of the same sampled tokens within bf16 noise of the pieces-off engine."""
    from test_builtin_engine import PROMPTS, hf_logprobs, make_model

    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.engine import small_batch
    from hybridrl.rollout.engine.backend import BuiltinBackend

    model = make_model("qwen2").cuda()
    # Every product of the tiny model through the kernel (its products are all narrow), o and down split-K.
    monkeypatch.setattr(decode_linear, "launch", lambda columns, depth: (
        decode_linear.Launch(16, 128, 2) if depth >= columns else decode_linear.Launch(16, 128)))
    greedy = SamplingParams(max_new_tokens=12, temperature=0, n=2)
    monkeypatch.setattr(small_batch, "ENABLED", False)
    off = BuiltinBackend(model, max_num_seqs=5, sync_every=3, fuse_gate_up=True).generate(PROMPTS, greedy)
    monkeypatch.setattr(small_batch, "ENABLED", True)
    engine = BuiltinBackend(model, max_num_seqs=5, sync_every=3, fuse_gate_up=True)
    on = engine.generate(PROMPTS, greedy)
    assert engine.last_stats["compiled"] and engine.last_stats["graphs_captured"] >= 1
    assert [g.token_ids for g in on] == [g.token_ids for g in off]
    reference = make_model("qwen2")  # the same weights, on the CPU (seeded)
    for generation in on[::2]:
        expected = hf_logprobs(reference, PROMPTS[generation.prompt_index], generation.token_ids)
        assert (torch.tensor(generation.logprobs) - expected).abs().max() < 1e-3
    bf16 = make_model("qwen2").to("cuda", torch.bfloat16)
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=4)
    on = BuiltinBackend(bf16, max_num_seqs=5, fuse_gate_up=True).generate(PROMPTS, sampled)
    monkeypatch.setattr(small_batch, "ENABLED", False)
    off = BuiltinBackend(bf16, max_num_seqs=5, fuse_gate_up=True).generate(PROMPTS, sampled)
    same = [(a, b) for a, b in zip(on, off) if a.token_ids == b.token_ids]
    assert len(same) >= len(on) // 2
    for a, b in same:
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 0.1


def test_compiled_pieces_with_split_k_partials_equal_the_eager_step(monkeypatch):
    """On CPU (the operator is F.linear, zero-padded into partial sums where a launch splits): the compiled narrow-batch
    pieces, with o and down as (splits, B, N) partials added up by the next piece, give the eager regular step's
    logits at several batches, compiled once for all batches but 1 (dynamo specialises 1)."""
    from test_builtin_engine import make_model

    from hybridrl.rollout.engine import small_batch
    from hybridrl.rollout.engine.llama_forward import EAGER_DECODE, _decode_layers
    from hybridrl.rollout.engine.weights import resolve_weights

    monkeypatch.setattr(decode_linear, "launch", lambda columns, depth: (decode_linear.Launch(16, 32, 2)
                                                                         if depth >= columns else None))
    monkeypatch.setattr(small_batch, "ENABLED", True)
    torch._dynamo.reset()
    model = make_model("qwen2")
    weights = resolve_weights(model, fuse_qkv=True, fuse_gate_up=True)
    pieces = small_batch.with_small_batch(EAGER_DECODE, compiled=True)
    generator = torch.Generator().manual_seed(0)
    cos, sin = torch.randn(8, weights.head_dim, generator=generator), torch.randn(8, weights.head_dim, generator=generator)
    with torch.no_grad():
        for batch in (1, 3, 5, 7):
            tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=generator)
            positions = torch.arange(batch)
            step = [_decode_layers(weights, tokens, cos[positions], sin[positions], functions,
                                   lambda layer, q, kv: q.contiguous()) for functions in (EAGER_DECODE, pieces)]
            torch.testing.assert_close(step[1], step[0], atol=1e-5, rtol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 8  # 3 pieces (+ the first layer's inputs) x 2


def test_the_pieces_run_only_for_compiled_cuda_steps():
    """The light rollout's uncompiled step and CPU steps keep F.linear (no kernel built in their first call)."""
    from hybridrl.rollout.engine import kernel_choices

    assert not kernel_choices.small_batch_projections_on(torch.device("cpu"), compiled=True)
    assert not kernel_choices.small_batch_projections_on(torch.device("cuda"), compiled=False)
    assert kernel_choices.small_batch_projections_on(torch.device("cuda"), compiled=True) == \
        kernel_choices.triton_available()
