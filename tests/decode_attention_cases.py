"""Random prefix-shared attention inputs, tolerances and the checks that test_decode_attention.py runs
in a TRITON_INTERPRET=1 subprocess (kept apart so that the kernel check imports no transformers)."""

from __future__ import annotations

import torch

from hybridrl.rollout.kernels.decode_attention import (
    reference_decode_attention,
    rotate_projections,
    triton_decode_attention,
)

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
    before = case["response_k"].clone()
    assert torch.equal(triton_decode_attention(**case, new_kv=torch.ones(3, 2, 2, 32))[1], torch.zeros(2, 4, 32))
    assert torch.equal(case["response_k"][1], before[1]) and not torch.equal(case["response_k"][0], before[0])
    for seed, shape in enumerate(CASES):
        for dtype in (torch.float32, torch.float16):
            check_fused_write(triton_decode_attention, make_case(seed, *shape, dtype=dtype), TOLERANCE[dtype])
            for bias in (False, True):
                check_rope(triton_decode_attention, make_case(seed, *shape, dtype=dtype), TOLERANCE[dtype], bias)
    print("kernel cases passed")


SPLIT_CASES = [(7, 2, 7, 64, 3, 40, 150), (5, 3, 4, 32, 2, 20, 100), (4, 1, 16, 64, 4, 17, 70), (3, 2, 1, 32, 1, 9, 40),
               (3, 2, 6, 128, 2, 30, 150)]
"""Shapes for split-KV (responses above the checks' 32-key splits): GQA groups 7 (Qwen2-0.5B), 4, 16 and 1 (no
sharing), and Qwen2.5-1.5B's heads (6 of 128 dims) at 6 (slot, KV head) pairs, which the plan gives its narrow-grid
tiles (`decode_launch.NARROW_SLOT_HEADS`); no capacity is a multiple of the split length, so each one's last split
is partial."""


def at_split_edges(case: dict, split_len: int) -> dict:
    """`case` with response lengths at and around the split edges, in turn over the slots: all keys in split 0
    (split_len), one key past it (split_len + 1, where the fused write's new key is the last of split 0), two splits
    and one key, the capacity, a single key."""
    capacity = case["response_k"].shape[2]
    edges = [split_len, split_len + 1, split_len + 2, 2 * split_len + 1, capacity, 1]
    lengths = torch.tensor([min(capacity, edges[slot % len(edges)]) for slot in range(case["q"].shape[0])])
    return dict(case, response_len=lengths.to(case["response_len"]))


def check_split_cases() -> None:
    """Run with TRITON_INTERPRET=1: the prefix-shared (contiguous) kernel with split-KV against the float32
    reference, as `paged_attention_cases` checks the paged one. 32-key splits: uneven random lengths, lengths at the
    split edges (`at_split_edges`), a slot that sees no key, the fused write and RoPE + bias, float32 and float16.
    These with capacity-sized splits; then 8-key ones (rounded up to 32-key blocks: the last splits hold no key);
    last, balanced splits (`balanced_splits`: each slot's own keys shared evenly), float32. The batch picks one or
    the other in the engine; here `BALANCED_MAX_SLOT_HEADS` forces each at every batch."""
    from hybridrl.rollout.kernels import decode_launch

    default = decode_launch.SPLIT_KEYS, decode_launch.BALANCED_MAX_SLOT_HEADS
    for split_keys, dtypes, balanced in ((32, (torch.float32, torch.float16), False), (8, (torch.float32,), False),
                                         (32, (torch.float32,), True)):  # balanced: each slot's keys shared evenly
        decode_launch.SPLIT_KEYS, decode_launch.BALANCED_MAX_SLOT_HEADS = split_keys, (1 << 30) * balanced
        for seed, shape in enumerate(SPLIT_CASES):
            plan = decode_launch.launch_plan(shape[2], shape[3], shape[6], paged=False, slot_heads=shape[0] * shape[1])
            assert plan.num_splits > 1 and plan.balanced == balanced and shape[6] % plan.split_len != 0, (shape, plan)
            for dtype in dtypes:
                case = make_case(seed, *shape, dtype=dtype)
                edges = at_split_edges(case, plan.split_len)
                for inputs in (case, edges):
                    torch.testing.assert_close(triton_decode_attention(**inputs), reference_decode_attention(**inputs),
                                               **TOLERANCE[dtype])
                check_fused_write(triton_decode_attention, edges, TOLERANCE[dtype])
                check_rope(triton_decode_attention, case, TOLERANCE[dtype], with_bias=seed % 2 == 0)
        blind = make_case(9, *SPLIT_CASES[1])
        blind["prompt_len"][2], blind["response_len"][2] = 0, 0
        assert torch.equal(triton_decode_attention(**blind)[2], torch.zeros(3, 4, 32))
    decode_launch.SPLIT_KEYS, decode_launch.BALANCED_MAX_SLOT_HEADS = default
    print("split kernel cases passed")


def with_new_kv(case: dict, seed: int = 7) -> tuple[dict, torch.Tensor]:
    """A copy of `case` with its own response caches, and random new keys/values (B, 2, Hkv, D)."""
    case = dict(case, response_k=case["response_k"].clone(), response_v=case["response_v"].clone())
    batch, kv_heads, _, head_dim = case["q"].shape
    generator = torch.Generator().manual_seed(seed)
    new_kv = torch.randn(batch, 2, kv_heads, head_dim, generator=generator).to(case["q"])
    return case, new_kv


def check_fused_write(attention, case: dict, tolerance: dict) -> None:
    """`attention(..., new_kv=)` equals writing new_kv at response index response_len - 1 first and then
    attending without it (the engine's unfused path), in the output and in both caches."""
    fused, new_kv = with_new_kv(case)
    written, _ = with_new_kv(case)
    slots, at = torch.arange(new_kv.shape[0]), written["response_len"].cpu() - 1
    written["response_k"][slots.to(new_kv.device), :, at.to(new_kv.device)] = new_kv[:, 0]
    written["response_v"][slots.to(new_kv.device), :, at.to(new_kv.device)] = new_kv[:, 1]
    out = attention(**fused, new_kv=new_kv)
    torch.testing.assert_close(out, reference_decode_attention(**written), **tolerance)
    assert torch.equal(fused["response_k"], written["response_k"]) and torch.equal(fused["response_v"], written["response_v"])


def rope_inputs(case: dict, with_bias: bool, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """cos and signed sin (B, D) of random positions (as `llama_forward.rope_table` rows), and a q/k/v bias
    (H*D + 2*Hkv*D,) or None."""
    batch, kv_heads, group, head_dim = case["q"].shape
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (batch, 1), generator=generator).float()
    angles = positions * 10000.0 ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.cat((angles, angles), dim=-1)
    half = head_dim // 2
    sin = torch.cat((-angles.sin()[:, :half], angles.sin()[:, half:]), dim=-1)
    bias = torch.randn((kv_heads * group + 2 * kv_heads) * head_dim, generator=generator) if with_bias else None
    to = dict(dtype=case["q"].dtype, device=case["q"].device)
    return angles.cos().to(**to), sin.to(**to), bias.to(**to) if bias is not None else None


def check_rope(attention, case: dict, tolerance: dict, with_bias: bool) -> None:
    """`attention(raw q, new_kv=raw, rope=, qkv_bias=)` equals attending with the projections rotated first
    (`rotate_projections`, itself checked against transformers' RoPE), in the output and both caches."""
    cos, sin, bias = rope_inputs(case, with_bias)
    fused, raw_kv = with_new_kv(case)
    rotated, _ = with_new_kv(case)
    rotated["q"], rotated_kv = rotate_projections(case["q"], raw_kv, cos, sin, bias)
    out = attention(**fused, new_kv=raw_kv, rope=(cos, sin), qkv_bias=bias)
    expected = reference_decode_attention(**rotated, new_kv=rotated_kv)
    torch.testing.assert_close(out, expected, **tolerance)
    torch.testing.assert_close(fused["response_k"], rotated["response_k"], **tolerance)
    assert torch.equal(fused["response_v"], rotated["response_v"]) or with_bias
    torch.testing.assert_close(fused["response_v"], rotated["response_v"], **tolerance)


def check_engine_with_kernel(**engine_options) -> None:
    """The engine with the Triton kernel itself (interpret mode) in place of the CPU reference: greedy tokens equal
    to the sdpa engine's, log-probs within 1e-5, with continuous batching (5 slots)."""
    import sys

    from test_builtin_engine import PROMPTS, make_model

    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.engine import runner
    from hybridrl.rollout.engine.backend import BuiltinBackend
    from hybridrl.rollout.engine.kernel_choices import AttentionPath
    from hybridrl.rollout.engine.kv_cache import PrefixSharedKVCache

    torch.set_num_threads(1)
    engine_options.setdefault("fuse_qkv", False)  # without: RoPE in a compiled step piece, the kernel plain
    runner.attention_path = lambda *options: AttentionPath("triton-interpret", PrefixSharedKVCache,
                                                           triton_decode_attention)
    model, params = make_model("qwen2"), SamplingParams(max_new_tokens=8, temperature=0, n=2)
    engine = BuiltinBackend(model, attention="triton", max_num_seqs=5, sync_every=2, **engine_options)
    shared = engine.generate(PROMPTS, params)
    assert engine.last_stats["attention"] == "triton-interpret" and engine.last_stats["prefill_waves"] >= 2
    assert engine.last_stats["rope_in_attention"] == bool(engine_options.get("fuse_qkv"))
    per_slot = BuiltinBackend(model, attention="sdpa").generate(PROMPTS, params)
    assert [g.token_ids for g in shared] == [g.token_ids for g in per_slot]
    for a, b in zip(shared, per_slot):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    print("engine with kernel passed", file=sys.stdout)


def check_engine_with_kernel_rope() -> None:
    """fuse_qkv on Qwen2 (q/k/v biases): RoPE and the biases applied inside the kernel."""
    check_engine_with_kernel(fuse_qkv=True)


def check_engine_with_split_kernel() -> None:
    """The engine with the kernel (interpret mode) splitting responses into 32-key splits, over forced lengths that
    end inside split 0, at its edge and in split 1: greedy tokens equal to the sdpa engine's, log-probs within 1e-5."""
    from test_builtin_engine import PROMPTS, make_model

    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.engine import runner
    from hybridrl.rollout.engine.backend import BuiltinBackend
    from hybridrl.rollout.engine.kernel_choices import AttentionPath
    from hybridrl.rollout.engine.kv_cache import PrefixSharedKVCache
    from hybridrl.rollout.kernels import decode_launch

    torch.set_num_threads(1)
    decode_launch.SPLIT_KEYS = 32
    runner.attention_path = lambda *options: AttentionPath("triton-interpret", PrefixSharedKVCache,
                                                           triton_decode_attention)
    model, params = make_model("qwen2"), SamplingParams(max_new_tokens=40, temperature=0, n=2, ignore_eos=True)
    lengths = [(40, 33, 32, 5)[i % 4] for i in range(len(PROMPTS) * 2)]
    engine = BuiltinBackend(model, attention="triton", max_num_seqs=5, sync_every=4, release_after_generate=False)
    shared = engine.generate(PROMPTS, params, lengths)
    assert engine.last_stats["attention"] == "triton-interpret"
    assert decode_launch.launch_plan(2, 16, engine.cache.response_kv.shape[-2], paged=False).num_splits > 1
    per_slot = BuiltinBackend(model, attention="sdpa").generate(PROMPTS, params, lengths)
    assert [g.token_ids for g in shared] == [g.token_ids for g in per_slot]
    assert [len(g.token_ids) for g in shared] == lengths
    for a, b in zip(shared, per_slot):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    print("engine with split kernel passed")


def run_in_interpreter(module: str, check: str, timeout: int = 300) -> str:
    """Run `<module>.<check>()` (a module in tests/) in a subprocess with TRITON_INTERPRET=1, which must be set
    before a kernel module is first imported for its kernels to be built in interpret mode; its stdout."""
    import os
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {tests_dir!r})\n{INTERPRETER_SHIM}\nimport {module} as cases; cases.{check}()"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(tests_dir), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


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
