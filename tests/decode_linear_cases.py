"""Checks of the skinny-batch projection kernel (`hybridrl/rollout/kernels/decode_linear.py`) that
test_decode_linear.py runs in a TRITON_INTERPRET=1 subprocess: the kernel against F.linear, and the engine's decode
with its narrow-batch pieces (`engine/small_batch.py`) running the kernel against HF."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from hybridrl.rollout.kernels import decode_linear
from hybridrl.rollout.kernels.decode_linear import decode_linear as kernel

# (rows, output columns, K): one row; rows not a power of two; 17 rows (BLOCK_M 32); columns past the last program's
# block and K past the last K tile, for narrow (16 x 512 tiles) and wide (32 x 128) products.
CASES = [(1, 48, 1000), (5, 40, 256), (17, 96, 130), (32, 4200, 200), (3, 10000, 70)]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
"""float32: IEEE dots, so only the summation order differs; float16: the output's own rounding."""


def check_kernel_matches_linear() -> None:
    generator = torch.Generator().manual_seed(0)
    for rows, columns, depth in CASES:
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(rows, depth, generator=generator).to(dtype)
            weight = (torch.randn(columns, depth, generator=generator) / depth**0.5).to(dtype)
            expected = F.linear(x.float(), weight.float())
            torch.testing.assert_close(kernel(x, weight).float(), expected, **TOLERANCE[dtype])
            gate, up = expected.chunk(2, dim=-1)
            torch.testing.assert_close(kernel(x, weight, silu_mul=True).float(), F.silu(gate) * up, **TOLERANCE[dtype])
    # Split-K: float32 partial sums over K ranges (the last one short), added up by the second kernel.
    for tile in (decode_linear.Launch(16, 128, 3), decode_linear.Launch(32, 64, 8)):
        x = torch.randn(6, 1000, generator=generator)
        weight = torch.randn(40, 1000, generator=generator) / 1000**0.5
        torch.testing.assert_close(kernel(x, weight, tile=tile), F.linear(x, weight), **TOLERANCE[torch.float32])
    # A strided x (a row-sliced view) and a finished row of zeros.
    x = torch.randn(8, 64, generator=generator)[::2]
    x[1] = 0
    weight = torch.randn(24, 64, generator=generator)
    torch.testing.assert_close(kernel(x, weight), F.linear(x, weight), **TOLERANCE[torch.float32])
    print("decode_linear kernel passed")


def check_engine_with_kernel() -> None:
    """The engine's decode with the narrow-batch pieces and the kernel itself (interpret mode) in every plain
    projection (fused q/k/v, o, gate/up with SiLU-mul, down split-K, the LM head), float32 on CPU: greedy tokens equal HF's, log-probs
    within 1e-4 of HF's forward pass, with continuous batching (3 slots)."""
    from test_builtin_engine import PROMPTS, hf_greedy, hf_logprobs, make_model

    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.engine import runner
    from hybridrl.rollout.engine.backend import BuiltinBackend
    from hybridrl.rollout.engine import small_batch

    torch.set_num_threads(1)
    calls = []
    decode_linear.applies = lambda x, weight: calls.append(x.shape) or x.shape[0] <= decode_linear.MAX_ROWS
    # Every product through the kernel (the tiny model's are all narrow), o and down (K >= columns) split-K, their
    # partial sums added up by the next fused piece.
    decode_linear.launch = lambda columns, depth: (decode_linear.Launch(16, 32, 2) if depth >= columns
                                                   else decode_linear.Launch(16, 64))
    original = runner.ModelRunner._decode_functions

    def with_pieces(self, device):
        functions, sampler = original(self, device)
        return small_batch.with_small_batch(functions, compiled=False), sampler

    runner.ModelRunner._decode_functions = with_pieces
    small_batch.ENABLED = True
    model = make_model("qwen2")
    engine = BuiltinBackend(model, attention="triton", fuse_qkv=True, fuse_gate_up=True, max_num_seqs=3, sync_every=2)
    generations = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0, n=1))
    assert engine.last_stats["rope_in_attention"] and engine.last_stats["fuse_gate_up"]
    assert len(calls) >= 4 * model.config.num_hidden_layers + 1, "the kernel did not run in the decode"
    for generation in generations:
        prompt = PROMPTS[generation.prompt_index]
        assert generation.token_ids == hf_greedy(model, prompt, 6), generation
        expected = hf_logprobs(model, prompt, generation.token_ids, temperature=1.0)
        logits_logprobs = torch.tensor(generation.logprobs)
        assert (logits_logprobs - expected).abs().max() < 1e-4, (logits_logprobs, expected)
    print("engine with decode_linear passed", file=sys.stdout)
