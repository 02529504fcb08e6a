"""Random prefix-shared attention inputs, tolerances and the checks that test_decode_attention.py runs
in a TRITON_INTERPRET=1 subprocess (kept apart so that the kernel check imports no transformers)."""

from __future__ import annotations

import torch

from hybridrl.rollout.decode_attention import reference_decode_attention, triton_decode_attention

# (batch, kv_heads, group, head_dim, entries, prompt_max, response_max): group 7 is Qwen2-0.5B's;
# lengths above the key block (64 keys for 16-bit dtypes, 32 for float32) run several loop
# iterations with a partial last block.
CASES = [(6, 2, 7, 64, 3, 150, 130), (5, 3, 4, 32, 2, 40, 20), (4, 1, 16, 64, 4, 17, 70), (3, 2, 1, 32, 1, 9, 5)]
FLOAT32_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
BF16_TOLERANCE = dict(atol=2e-2, rtol=2e-2)
"""bf16 outputs: a few bf16 roundings (eps 7.8e-3) of values of order 1; the kernel also rounds P to bf16."""
FP16_TOLERANCE = dict(atol=2e-3, rtol=2e-3)
TOLERANCE = {torch.float32: FLOAT32_TOLERANCE, torch.bfloat16: BF16_TOLERANCE, torch.float16: FP16_TOLERANCE}


def make_case(seed: int, batch: int, kv_heads: int, group: int, head_dim: int, entries: int, prompt_max: int,
              response_max: int, dtype=torch.float32, device: str = "cpu") -> dict:
    """Random inputs shaped as the engine passes them: per-layer views of 6-D caches (so strides are the
    engine's), more response slots than the batch, adjacent slots sharing prompt entries, and lengths
    that include 1, the maximum, and a free slot (prompt_len 0, response_len 1)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    prompt_cache = randn(2, 2, entries, kv_heads, prompt_max, head_dim)  # (layers, 2, entries, Hkv, Lp, D)
    response_cache = randn(2, 2, batch + 2, kv_heads, response_max, head_dim)
    prompt_index = torch.sort(torch.randint(0, entries, (batch,), generator=generator)).values
    prompt_len = torch.randint(1, prompt_max + 1, (batch,), generator=generator)
    response_len = torch.randint(1, response_max + 1, (batch,), generator=generator)
    prompt_len[0], response_len[0], prompt_len[-1], response_len[-1] = 1, response_max, prompt_max, 1
    if batch > 2:
        prompt_len[1], response_len[1] = 0, 1  # a free slot: it sees only the key it just wrote
    to = dict(device=device)
    return dict(q=randn(batch, kv_heads, group, head_dim), prompt_k=prompt_cache[1, 0], prompt_v=prompt_cache[1, 1],
                response_k=response_cache[1, 0], response_v=response_cache[1, 1],
                prompt_index=prompt_index.to(**to), prompt_len=prompt_len.to(**to), response_len=response_len.to(**to),
                scale=head_dim ** -0.5)


def check_kernel_cases() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1 (the kernel is built when decode_attention is imported).

    float32 and float16 only: the interpreter's `tl.dot` returns garbage for bf16 inputs (numpy has no
    bf16; a plain bf16 load/store is fine), so the bf16 kernel is checked by the GPU test alone. float16
    runs the same low-precision branch (P cast to the value dtype)."""
    for seed, shape in enumerate(CASES):
        for dtype in (torch.float32, torch.float16):
            case = make_case(seed, *shape, dtype=dtype)
            torch.testing.assert_close(triton_decode_attention(**case), reference_decode_attention(**case),
                                       **TOLERANCE[dtype])
    case = make_case(9, 3, 2, 4, 32, 2, 8, 8)
    case["prompt_len"][1], case["response_len"][1] = 0, 0
    assert torch.equal(triton_decode_attention(**case)[1], torch.zeros(2, 4, 32))
    print("kernel cases passed")


def check_engine_with_kernel() -> None:
    """The engine with the Triton kernel itself (interpret mode) in place of the CPU reference: greedy
    tokens equal to the sdpa engine's, log-probs within 1e-5, with continuous batching (5 slots)."""
    import sys

    from hybridrl.rollout import builtin
    from hybridrl.rollout.base import SamplingParams
    from test_builtin_engine import PROMPTS, make_model

    torch.set_num_threads(1)
    builtin._decode_attention_function = lambda device: ("triton-interpret", triton_decode_attention)
    model, params = make_model("qwen2"), SamplingParams(max_new_tokens=8, temperature=0, n=2)
    engine = builtin.BuiltinBackend(model, attention="triton", max_num_seqs=5, sync_every=2)
    shared = engine.generate(PROMPTS, params)
    assert engine.last_stats["attention"] == "triton-interpret" and engine.last_stats["prefill_waves"] >= 2
    per_slot = builtin.BuiltinBackend(model, attention="sdpa").generate(PROMPTS, params)
    assert [g.token_ids for g in shared] == [g.token_ids for g in per_slot]
    for a, b in zip(shared, per_slot):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    print("engine with kernel passed", file=sys.stdout)


INTERPRETER_SHIM = """
# Test-only patch: triton 3.6's interpreter takes int() of a 1-element numpy array for a scalar's
# __index__, which numpy 2.4 (installed here) refuses, so any loop bounded by a loaded length fails in
# interpret mode (compiled kernels are unaffected). Skipped where the interpreter lacks the hook.
from triton.runtime import interpreter
if hasattr(interpreter, "_patch_lang_tensor"):
    _original = interpreter._patch_lang_tensor
    def _patched(tensor, scope):
        _original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = _patched
"""
