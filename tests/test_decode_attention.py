"""Prefix-shared decode attention: the Triton kernel (interpret mode on CPU) vs the PyTorch reference vs
SDPA, and the built-in engine on the prefix-shared layout vs HF and vs the per-slot SDPA layout."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine import kernel_choices
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.kv_cache import CacheGeometry, PrefixSharedKVCache, SlotKVCache, max_slots
from hybridrl.rollout.engine.scheduler import PromptEntries
from hybridrl.rollout.kernels import decode_attention, decode_launch
from hybridrl.rollout.kernels.decode_attention import (
    reference_decode_attention,
    rotate_projections,
    triton_decode_attention,
)

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention_cases as cases  # noqa: E402
from decode_attention_cases import CASES, TOLERANCE, check_fused_write, check_rope, make_case, rope_inputs  # noqa: E402
from test_builtin_engine import PROMPTS, hf_greedy, hf_logprobs, make_model  # noqa: E402

HAS_TRITON = decode_attention.triton is not None


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def sdpa_on_concatenated_kv(case: dict) -> torch.Tensor:
    """Per slot: SDPA (float32) of its folded query rows over cat(prompt keys, response keys), the keys the
    per-slot layout would hold; independent of the reference's masking arithmetic."""
    outputs = []
    for b in range(case["q"].shape[0]):
        entry, prompt_len, response_len = (int(case[k][b]) for k in ("prompt_index", "prompt_len", "response_len"))
        keys = torch.cat((case["prompt_k"][entry, :, :prompt_len], case["response_k"][b, :, :response_len]), dim=1)
        values = torch.cat((case["prompt_v"][entry, :, :prompt_len], case["response_v"][b, :, :response_len]), dim=1)
        outputs.append(F.scaled_dot_product_attention(case["q"][b].float(), keys.float(), values.float(),
                                                      scale=case["scale"]))
    return torch.stack(outputs).to(case["q"].dtype)


@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_equals_sdpa_on_concatenated_kv(shape, dtype):
    case = make_case(0, *shape, dtype=dtype)
    torch.testing.assert_close(reference_decode_attention(**case), sdpa_on_concatenated_kv(case), **TOLERANCE[dtype])


def test_reference_gives_zeros_when_a_slot_sees_no_key():
    case = make_case(1, 3, 2, 4, 32, 2, 8, 8)
    case["prompt_len"][1], case["response_len"][1] = 0, 0
    out = reference_decode_attention(**case)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out.isfinite().all()


@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_with_new_kv_equals_writing_first(shape, dtype):
    check_fused_write(reference_decode_attention, make_case(3, *shape, dtype=dtype), TOLERANCE[dtype])


def test_new_kv_is_not_written_for_a_slot_without_response_tokens():
    case = make_case(1, 3, 2, 4, 32, 2, 8, 8)
    case["prompt_len"][1], case["response_len"][1] = 0, 0
    before_k, before_v = case["response_k"].clone(), case["response_v"].clone()
    out = reference_decode_attention(**case, new_kv=torch.ones(3, 2, 2, 32))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(before_k[1], case["response_k"][1]) and torch.equal(before_v[1], case["response_v"][1])
    assert not torch.equal(before_k[0], case["response_k"][0])  # the other slots did write


@pytest.mark.parametrize("with_bias", [False, True])
def test_rotate_projections_equals_transformers_rope(with_bias):
    """The attention's RoPE prologue: bias, then HF's `apply_rotary_pos_emb` (rotate_half form, unsigned sin)
    on q and the new key; the value gets the bias only."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    case = make_case(4, 6, 2, 7, 64, 3, 20, 20)
    cos, signed, bias = rope_inputs(case, with_bias)
    sin = torch.cat((-signed[:, :32], signed[:, 32:]), dim=-1)  # undo the sign of the first half
    new_kv = torch.randn(6, 2, 2, 64)
    q, kv = rotate_projections(case["q"], new_kv, cos, signed, bias)
    q_raw, k_raw, v_raw = case["q"].flatten(1, 2), new_kv[:, 0], new_kv[:, 1]  # (B, heads, D)
    if with_bias:
        rows = bias.view(-1, 64)
        q_raw, k_raw, v_raw = q_raw + rows[:14], k_raw + rows[14:16], v_raw + rows[16:]
    q_hf, k_hf = apply_rotary_pos_emb(q_raw[:, :, None], k_raw[:, :, None], cos[:, None], sin[:, None])
    torch.testing.assert_close(q, q_hf[:, :, 0].view_as(q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[:, 0], k_hf[:, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[:, 1], v_raw, atol=0, rtol=0)


@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_with_rope_equals_rotating_first(shape, dtype, with_bias):
    check_rope(reference_decode_attention, make_case(5, *shape, dtype=dtype), TOLERANCE[dtype], with_bias)


def run_in_interpreter(check: str) -> str:
    """`decode_attention_cases.<check>()` with the kernels built in Triton's interpreter."""
    return cases.run_in_interpreter("decode_attention_cases", check)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
def test_triton_kernel_matches_reference_in_interpret_mode():
    assert "kernel cases passed" in run_in_interpreter("check_kernel_cases")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
def test_split_kv_kernel_matches_reference_in_interpret_mode():
    """Split-KV on the prefix-shared layout (`decode_attention_cases.check_split_cases`)."""
    assert "split kernel cases passed" in cases.run_in_interpreter("decode_attention_cases", "check_split_cases",
                                                                   timeout=900)


def test_split_count_gives_wide_batches_few_splits_and_narrow_tails_many(monkeypatch):
    """Worked by hand at capacity 8,192 and 512-key splits, 2 KV heads: 4 slots -> 8 programs, 2048 // 8 = 256
    wanted, capped at 16; 180 slots -> 360 programs, 2048 // 360 = 5 -> 4 (a power of two); 512 slots -> 2 wanted,
    raised to the floor of 4; 40 slots -> 80 programs, 25 wanted -> 16; a capacity of 1,000 asks only 2 splits.
    16 slots -> 32 programs, 64 wanted -> 16; 17 slots -> 34 programs, 60 wanted -> 32 -> 16. Balanced splits (up
    to `BALANCED_MAX_SLOT_HEADS` = 32 pairs: 4 and 16 slots here, not 17) take split_count whatever the capacity
    (split_len: the capacity's share, rounded up to 32-key blocks)."""
    def plans(capacity: int) -> dict:
        return {slots: (plan.num_splits, plan.split_len, plan.balanced) for slots in (4, 16, 17, 40, 180, 512)
                for plan in [decode_launch.launch_plan(6, 128, capacity, paged=False, slot_heads=2 * slots)]}

    assert decode_launch.BALANCED_MAX_SLOT_HEADS == 32
    assert plans(8192) == {4: (16, 512, True), 16: (16, 512, True), 17: (16, 512, False), 40: (16, 512, False),
                           180: (4, 2048, False), 512: (4, 2048, False)}
    assert plans(1000) == {4: (16, 64, True), 16: (16, 64, True), 17: (2, 512, False), 40: (2, 512, False),
                           180: (2, 512, False), 512: (2, 512, False)}
    monkeypatch.setattr(decode_launch, "BALANCED_MAX_SLOT_HEADS", 1 << 30)  # balanced at every batch
    assert plans(1000) == {4: (16, 64, True), 16: (16, 64, True), 17: (16, 64, True), 40: (16, 64, True),
                           180: (4, 256, True), 512: (4, 256, True)}
    unsplit = decode_launch.launch_plan(6, 128, 512, paged=False, slot_heads=8)  # fits one split
    assert unsplit.num_splits == 1 and not unsplit.balanced


def test_narrowest_grids_take_wide_tiles_over_more_warps():
    """`NARROW_SLOT_HEADS` = 8 pairs: 4 slots of Qwen2.5-1.5B's heads (2 KV heads of 128 dims) take 64 keys per
    iteration over 4 warps, and their split length stays a whole number of those 64-key blocks; 8 slots (16 pairs)
    and head dims of 64 keep the plan's 32 keys over 2 warps (paged) or 1 (contiguous)."""
    def plan(slots: int, head_dim: int = 128, paged: bool = True, capacity: int = 8192) -> tuple:
        chosen = decode_launch.launch_plan(6, head_dim, capacity, paged=paged, slot_heads=2 * slots)
        return chosen.block_n, chosen.num_warps, chosen.num_splits, chosen.split_len, chosen.balanced

    assert decode_launch.NARROW_SLOT_HEADS == 8
    assert plan(4) == (64, 4, 16, 512, True) and plan(1) == (64, 4, 16, 512, True)
    assert plan(4, capacity=1000) == (64, 4, 16, 64, True)  # 1000 / 16 = 63 keys, rounded up to one 64-key block
    assert plan(8) == (32, 2, 16, 512, True) and plan(4, head_dim=64, paged=False) == (32, 1, 16, 512, True)


def test_combine_chunk_keeps_every_split_of_a_chunk_in_one_tile(monkeypatch):
    """By hand at `COMBINE_TILE` 8,192 elements, group 6 (8 rows padded), head_dim 128: 4 splits -> 8192 // 32 = 256,
    capped at 128 (one program per slot and head); 3 splits pad to 4 -> 128; 16 -> 64; 64 -> 16; 128 -> 8, raised to
    the floor of 16. 0 turns the one-load merge off (the per-split loop)."""
    chunks = {splits: decode_launch.combine_chunk(splits, 6, 128) for splits in (3, 4, 16, 64, 128)}
    assert decode_launch.COMBINE_TILE == 8192 and chunks == {3: 128, 4: 128, 16: 64, 64: 16, 128: 16}
    assert decode_launch.combine_chunk(16, 2, 16) == 16  # never wider than the head
    monkeypatch.setattr(decode_launch, "COMBINE_TILE", 0)
    assert decode_launch.combine_chunk(16, 6, 128) == 0


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
@pytest.mark.skipif(not os.environ.get("HYBRIDRL_SLOW_TESTS"), reason="set HYBRIDRL_SLOW_TESTS=1 (~10 s: the engine "
                    "runs the kernel in Triton's interpreter)")
def test_engine_with_triton_kernel_in_interpret_mode_matches_sdpa():
    assert "engine with kernel passed" in run_in_interpreter("check_engine_with_kernel")
    assert "engine with kernel passed" in run_in_interpreter("check_engine_with_kernel_rope")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
@pytest.mark.skipif(not os.environ.get("HYBRIDRL_SLOW_TESTS"), reason="set HYBRIDRL_SLOW_TESTS=1 (minutes: 40 decode "
                    "steps of the engine run the split kernel in Triton's interpreter)")
def test_engine_with_split_kv_kernel_in_interpret_mode_matches_sdpa():
    assert "engine with split kernel passed" in cases.run_in_interpreter("decode_attention_cases",
                                                                         "check_engine_with_split_kernel", timeout=1200)


def compile_kernel_for_hopper(dtype: str, group: int, head_dim: int, rope: bool = False, arch: int = 90,
                              block_size: int | None = None, num_splits: int = 1, balanced: bool = False,
                              slot_heads: int = 1024):
    """Compile the kernel ahead of time for sm_<arch> (Triton's own ptxas; no GPU or driver needed); with
    `block_size`, its paged variant (`paged_attention.py`); with `num_splits` > 1, its split-KV variant (`balanced`:
    each slot's own keys shared evenly); tiles and warps as the plan gives a grid of `slot_heads` (slot, KV head)
    pairs (the default: a wide batch; `decode_launch.NARROW_SLOT_HEADS` or fewer: the narrow tail's)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = decode_attention._decode_attention_kernel
    signature = {name: "constexpr" for name in kernel.arg_names}
    signature.update({name: "*" + dtype for name in ("Q", "PK", "PV", "RK", "RV", "OUT", "NEW_KV", "COS", "SIN",
                                                     "BIAS")})
    signature.update({name: "*i64" for name in ("PROMPT_INDEX", "PROMPT_LEN", "RESPONSE_LEN")})
    signature.update({name: "i32" for name in kernel.arg_names if name.startswith("stride")}, qk_scale="fp32",
                     prompt_columns="i32", split_len="i32", PART_ACC="*fp32", PART_ML="*fp32")
    plan = decode_launch.launch_plan(group, head_dim, 0, block_size is not None, slot_heads=slot_heads)
    constants = dict(GROUP=group, HEAD_DIM=head_dim, GROUP_PAD=plan.group_pad, BLOCK_D=plan.block_d,
                     BLOCK_N=plan.block_n, IEEE=dtype == "fp32",
                     WRITE_NEW=True, ROPE=rope, HAS_BIAS=rope,  # the variants the engine runs
                     PAGED=block_size is not None, BLOCK_SIZE=block_size or 1, NUM_SPLITS=num_splits,
                     ONE_BLOCK=block_size is not None and plan.one_block(block_size), BALANCED=balanced)
    # What a launch at the engine's shapes specializes: pointers 16-byte aligned, strides multiples of 16 (heads of 64
    # or 128; the block table's row stride, its column count, need not be).
    aligned = [index for index, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*") or (name.startswith("stride") and name != "stride_tb")]
    attrs = {(index,): [["tt.divisibility", 16]] for index in aligned}
    return decode_attention.triton.compile(ASTSource(kernel, signature, constants, attrs),
                                           target=GPUTarget("cuda", arch, 32), options=dict(num_warps=plan.num_warps))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
@pytest.mark.parametrize("dtype, group, head_dim, rope", [("bf16", 7, 64, False), ("bf16", 7, 64, True),
                                                         ("fp32", 2, 16, True), ("fp32", 4, 128, False)])
def test_triton_kernel_compiles_for_hopper(dtype, group, head_dim, rope):
    """The interpreter does not lower the kernel; this does (to a cubin), so type errors in the compiled
    path and shared-memory overuse show up on CPU. Cases: the benchmark's (bf16, group 7, head_dim 64),
    the GPU test's tiny float32 model, and the largest float32 tiles (head_dim 128)."""
    if not isinstance(decode_attention._decode_attention_kernel, decode_attention.triton.runtime.JITFunction):
        pytest.skip("the kernel was built in interpret mode (TRITON_INTERPRET is set)")
    compiled = compile_kernel_for_hopper(dtype, group, head_dim, rope)
    assert "cubin" in compiled.asm and compiled.metadata.shared < 160 * 1024  # H200: 227 KiB per block


def ptxas_report(compiled) -> str:
    """Triton's own ptxas -v on a compiled kernel's PTX for sm_90a (registers, spills)."""
    import subprocess

    ptxas = os.path.join(os.path.dirname(decode_attention.triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this triton build ships no ptxas")
    ptx = Path(tempfile.mkdtemp()) / "kernel.ptx"
    ptx.write_text(compiled.asm["ptx"])
    return subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                          capture_output=True, text=True, check=True).stderr


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
@pytest.mark.parametrize("num_splits", [4, 8, 16, 64])
def test_combine_kernel_and_prefetched_block_ids_compile_for_hopper_without_spills(num_splits):
    """The split-KV combine kernel (every split's partial state in one load, head dims chunked by
    `decode_launch.combine_chunk`) with balanced splits at Qwen2.5-1.5B's heads, and the paged kernel with balanced
    splits and block ids loaded one iteration ahead (blocks of 64, as the engine's narrow batches run it): lowered
    for sm_90 and within the registers."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(decode_attention._combine_all_splits_kernel, decode_attention.triton.runtime.JITFunction):
        pytest.skip("the kernel was built in interpret mode (TRITON_INTERPRET is set)")
    kernel = decode_attention._combine_all_splits_kernel
    signature = {name: "constexpr" for name in kernel.arg_names}
    signature.update(PART_ACC="*fp32", PART_ML="*fp32", PROMPT_LEN="*i64", RESPONSE_LEN="*i64", OUT="*bf16",
                     stride_ob="i32", stride_oh="i32", stride_og="i32", split_len="i32")
    constants = dict(GROUP=6, HEAD_DIM=128, GROUP_PAD=16, BLOCK_D=128, NUM_SPLITS=num_splits, WRITE_NEW=True,
                     BALANCED=True, BLOCK_N=32, ROWS=8, SPLITS_PAD=num_splits,
                     CHUNK_D=decode_launch.combine_chunk(num_splits, 6, 128))
    compiled = decode_attention.triton.compile(ASTSource(kernel, signature, constants),
                                               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert "0 bytes spill stores" in ptxas_report(compiled)
    for slot_heads in (32, decode_launch.NARROW_SLOT_HEADS):  # the plan's tiles and warps, then the narrowest grids'
        prefetch = compile_kernel_for_hopper("bf16", 6, 128, rope=True, block_size=64, num_splits=num_splits,
                                             balanced=True, slot_heads=slot_heads)
        assert "0 bytes spill stores" in ptxas_report(prefetch)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
@pytest.mark.parametrize("dtype, group, head_dim, block_size, num_splits", [
    ("bf16", 7, 64, None, 1), ("bf16", 7, 128, None, 1), ("bf16", 8, 128, None, 1), ("fp16", 4, 128, None, 1),
    ("bf16", 6, 128, 64, 16), ("bf16", 7, 64, 64, 16), ("bf16", 6, 128, None, 16), ("bf16", 7, 64, None, 16)])
def test_default_launch_does_not_spill_registers_on_hopper(dtype, group, head_dim, block_size, num_splits):
    """The default warps per program (`default_num_warps`: one up to head_dim 64, two above) keep the engine's
    kernel (RoPE and bias inside) within 255 registers for sm_90: at head_dim 128 the paged kernel spills at one warp
    (and, compiled without the launch's alignment specialization, the contiguous one did too, ~340 bytes per thread),
    which a GPU run would only show as a slower rollout. Read from Triton's own ptxas (-v). The paged
    variant (block size 64) too, and both layouts' split-KV variants: Qwen2.5-1.5B's heads (group 6, head_dim 128)
    and Qwen2-0.5B's."""
    if not isinstance(decode_attention._decode_attention_kernel, decode_attention.triton.runtime.JITFunction):
        pytest.skip("the kernel was built in interpret mode (TRITON_INTERPRET is set)")
    report = ptxas_report(compile_kernel_for_hopper(dtype, group, head_dim, rope=True, block_size=block_size,
                                                    num_splits=num_splits))
    assert "0 bytes spill stores" in report and "registers" in report, report


SHARED_MEMORY_PER_BLOCK = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024}
"""Opt-in shared memory per block (CUDA programming guide): T4, A100, RTX 30xx/A6000, RTX 40xx/L4."""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
@pytest.mark.parametrize("arch, dtype", [(75, "fp16"), (80, "bf16"), (86, "bf16"), (89, "bf16"), (89, "fp16")])
def test_triton_kernel_compiles_for_smaller_gpus(arch, dtype):
    """The small-team cards (a 24 GB RTX 4090 or A5000, an A100, a T4 in float16): the engine's kernel
    variants (with and without RoPE inside) lower for each and fit its shared memory."""
    if not isinstance(decode_attention._decode_attention_kernel, decode_attention.triton.runtime.JITFunction):
        pytest.skip("the kernel was built in interpret mode (TRITON_INTERPRET is set)")
    for group, head_dim, rope in ((7, 64, False), (7, 64, True), (4, 128, True)):  # Qwen2-0.5B; Llama/Qwen-7B
        compiled = compile_kernel_for_hopper(dtype, group, head_dim, rope, arch)
        assert "cubin" in compiled.asm and compiled.metadata.shared <= SHARED_MEMORY_PER_BLOCK[arch]


def test_prompt_entries_are_refcounted_and_reused():
    entries = PromptEntries(2)
    assert entries.acquire(5) == (0, True) and entries.acquire(5) == (0, False) and entries.acquire(7) == (1, True)
    entries.release(5)
    assert entries.entry_of == {5: 0, 7: 1} and entries.free == []  # prompt 5 still has a live sample
    entries.release(5)
    assert entries.acquire(8) == (0, True)  # the freed entry is reused
    with pytest.raises(AssertionError, match="prompt entries"):
        entries.acquire(9)


def test_prefix_shared_layout_stores_prompts_once_so_more_slots_fit():
    geometry = CacheGeometry(num_layers=24, num_kv_heads=2, head_dim=64, element_size=2, longest_prompt=256,
                             max_new_tokens=256, num_prompts=64)
    assert PrefixSharedKVCache.bytes_for(geometry, 512) < 0.6 * SlotKVCache.bytes_for(geometry, 512)
    budget = SlotKVCache.bytes_for(geometry, 300)
    assert max_slots(lambda s: SlotKVCache.bytes_for(geometry, s), budget, 512) == 300
    assert max_slots(lambda s: PrefixSharedKVCache.bytes_for(geometry, s), budget, 512) == 512


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefix_shared_engine_matches_hf(family):
    """On CPU attention="triton" runs the prefix-shared layout with the PyTorch reference for the attention."""
    model = make_model(family)
    engine = BuiltinBackend(model, attention="triton")
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0, n=3))
    assert engine.last_stats["attention"] == "reference"
    for generation in outputs:
        prompt = PROMPTS[generation.prompt_index]
        assert generation.token_ids == hf_greedy(model, prompt, 16)
        torch.testing.assert_close(torch.tensor(generation.logprobs), hf_logprobs(model, prompt, generation.token_ids),
                                   atol=1e-4, rtol=0)
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, n=3, seed=4)
    shared = BuiltinBackend(model, attention="triton").generate(PROMPTS, sampled)
    per_slot = BuiltinBackend(model, attention="sdpa").generate(PROMPTS, sampled)
    assert [g.token_ids for g in shared] == [g.token_ids for g in per_slot]
    for a, b in zip(shared, per_slot):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefix_shared_continuous_batching_reuses_entries_and_compacts(family, monkeypatch):
    model = make_model(family)
    prompts = [[i + 1, i + 2, i + 3, i + 4][: 1 + i % 4] for i in range(10)]
    free_run = BuiltinBackend(model, attention="sdpa").generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    # Uneven lengths: slots free up mid-run. (This eos and 5 slots make the llama model compact; since the decode step
    # launched ahead at each sync, the qwen2 model's slots free in an order that needs no move.)
    model.generation_config.eos_token_id = free_run[0].token_ids[1]
    params = SamplingParams(max_new_tokens=12, temperature=0, n=3)
    reference = BuiltinBackend(model, attention="sdpa").generate(prompts, params)
    moves = []
    original_move = PrefixSharedKVCache.move
    monkeypatch.setattr(PrefixSharedKVCache, "move", lambda self, s, d: (moves.append(len(s)), original_move(self, s, d)))
    resident = []  # prompts prefilled only for their logits: an earlier sample already filled their entry
    original_writes = PrefixSharedKVCache.prefill_writes

    def prefill_writes(self, rows, sequences):
        written_rows, entries = original_writes(self, rows, sequences)
        resident.extend(set(rows) - set(written_rows))
        return written_rows, entries

    monkeypatch.setattr(PrefixSharedKVCache, "prefill_writes", prefill_writes)
    engine = BuiltinBackend(model, attention="triton", max_num_seqs=5, sync_every=2, release_after_generate=False)
    outputs = engine.generate(prompts, params)
    assert engine.last_stats["num_slots"] == 5 and engine.last_stats["prefill_waves"] >= 5
    assert engine.cache.prompt_kv.shape[2] == 5  # 10 prompts through 5 entries: entries were reused
    assert moves or family == "qwen2", "no compaction happened"
    assert resident, "no prompt was admitted while its entry was live"
    assert [g.token_ids for g in outputs] == [g.token_ids for g in reference]
    assert [g.finish_reason for g in outputs] == [g.finish_reason for g in reference]
    assert {g.finish_reason for g in reference} == {"stop", "length"}
    for a, b in zip(outputs, reference):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_attention_option_is_validated_and_plumbed_from_the_config():
    from hybridrl.config.loading import load_config
    from hybridrl.config.schema import ConfigError
    from hybridrl.training.components import build_rollout

    with pytest.raises(ValueError, match="attention must be one of"):
        BuiltinBackend(make_model("qwen2"), attention="flash")
    for removed in ("flash", "triton-stacked"):
        with pytest.raises(ConfigError, match="rollout.engine.attention must be one of"):
            load_config(None, [f"rollout.engine.attention={removed}"])
    for option in ("triton", "sdpa"):
        config = load_config(None, [f"rollout.engine.attention={option}", "rollout.backend=builtin"])
        backend = build_rollout(config, make_model("qwen2"), None, torch.device("cpu"))
        assert isinstance(backend, BuiltinBackend) and backend.attention == option
    assert load_config(None, []).rollout.engine.attention == "auto"
    # The key moved into the advanced section: the old spelling names the new one.
    with pytest.raises(ConfigError, match="'rollout.attention' is now 'rollout.engine.attention'"):
        load_config(None, ["rollout.attention=triton"])


def assert_same_samples(ours, reference, allowed_boundary_flips: int) -> None:
    """Equal tokens and log-probs, except that up to `allowed_boundary_flips` sampled sequences may part at a
    token one id away from the reference's: the sampler inverts the CDF in vocabulary order, so a uniform lying
    within float32 rounding of the boundary between ids t and t+1 picks either, depending on the attention
    kernel's summation order (e.g. ...55, 15 against ...55, 14). Any other difference fails."""
    flips = 0
    for a, b in zip(ours, reference):
        parted = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if parted is None:
            assert a.token_ids == b.token_ids
        else:
            assert abs(a.token_ids[parted] - b.token_ids[parted]) == 1, (a.token_ids, b.token_ids)
            flips += 1
        same = len(a.token_ids) if parted is None else parted
        assert a.logprobs[:same] == pytest.approx(b.logprobs[:same], abs=1e-4)
    assert flips <= allowed_boundary_flips, f"{flips} sequences parted from the reference"


def test_assert_same_samples_accepts_only_a_boundary_flip():
    from types import SimpleNamespace as Generation

    reference = [Generation(token_ids=[5, 9, 14], logprobs=[-1.0, -2.0, -3.0])]
    assert_same_samples([Generation(token_ids=[5, 9, 15], logprobs=[-1.0, -2.0, -2.5])], reference, 1)
    for token_ids, allowed in (([5, 9, 15], 0), ([5, 9, 16], 1), ([5, 8, 14], 0)):
        with pytest.raises(AssertionError):
            assert_same_samples([Generation(token_ids=token_ids, logprobs=[-1.0, -2.0, -3.0])], reference, allowed)
    with pytest.raises(AssertionError):  # equal tokens, a log-prob off
        assert_same_samples([Generation(token_ids=[5, 9, 14], logprobs=[-1.0, -2.1, -3.0])], reference, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_kernel_and_engine_on_cuda():
    for seed, shape in enumerate(CASES + [(512, 2, 7, 64, 64, 256, 256)]):  # the last one: the benchmark's shape
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            case = make_case(seed, *shape, dtype=dtype, device="cuda")
            torch.testing.assert_close(triton_decode_attention(**case), reference_decode_attention(**case),
                                       **TOLERANCE[dtype])
            check_rope(triton_decode_attention, case, TOLERANCE[dtype], with_bias=seed % 2 == 0)
    model = make_model("qwen2").cuda()
    assert kernel_choices.auto_fuses_gate_up(model)  # a tiny model's gate/up copy is far under 5% of the GPU
    prompts = [[i + 1, i + 2, i + 3, i + 4][: 1 + i % 4] for i in range(9)]
    for params in (SamplingParams(max_new_tokens=20, temperature=0, n=2),
                   SamplingParams(max_new_tokens=12, temperature=0.9, n=3, seed=5)):
        per_slot = BuiltinBackend(model, attention="sdpa", max_num_seqs=5, sync_every=3).generate(prompts, params)
        for fuse_qkv, fuse_gate_up in ((False, False), (True, False), (True, True)):  # RoPE in the kernel or not
            triton_engine = BuiltinBackend(model, attention="triton", max_num_seqs=5, sync_every=3, fuse_qkv=fuse_qkv,
                                           fuse_gate_up=fuse_gate_up)  # compiled + graphs
            shared = triton_engine.generate(prompts, params)
            stats = triton_engine.last_stats
            assert stats["attention"] == "triton" and stats["graphs_captured"] >= 1
            assert stats["rope_in_attention"] == fuse_qkv
            assert [g.token_ids for g in triton_engine.generate(prompts, params)] == [g.token_ids for g in shared]
            assert_same_samples(shared, per_slot, allowed_boundary_flips=0 if params.temperature == 0 else 1)
    for generation in shared[::3]:  # sampled at T=0.9: log-probs against the HF forward pass
        ids = torch.tensor([prompts[generation.prompt_index] + generation.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompts[generation.prompt_index]) - 1 : -1].float()
        reference = torch.log_softmax(logits / 0.9, -1).gather(1, ids[0, -len(generation.token_ids):, None])[:, 0]
        torch.testing.assert_close(torch.tensor(generation.logprobs), reference.cpu(), atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_split_kv_kernel_and_engine_on_cuda(monkeypatch):
    """Split-KV on the prefix-shared layout, compiled: bf16 (which the interpreter cannot check) against the float32
    reference, at Qwen2-0.5B's heads with 32-key splits and at Qwen2.5-1.5B's with the default 512-key ones; then the
    engine (compiled, CUDA graphs) with 32-key splits over forced uneven lengths equals the per-slot SDPA engine."""
    default_split_keys = decode_launch.SPLIT_KEYS
    for seed, (shape, split_keys) in enumerate([(cases.SPLIT_CASES[0], 32), ((64, 2, 6, 128, 8, 512, 2000), None)]):
        monkeypatch.setattr(decode_launch, "SPLIT_KEYS", split_keys or default_split_keys)
        plan = decode_launch.launch_plan(shape[2], shape[3], shape[6], paged=False, slot_heads=shape[0] * shape[1])
        assert plan.num_splits > 1
        case = make_case(seed, *shape, dtype=torch.bfloat16, device="cuda")
        tolerance = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(triton_decode_attention(**case), reference_decode_attention(**case), **tolerance)
        check_fused_write(triton_decode_attention, cases.at_split_edges(case, plan.split_len), tolerance)
        check_rope(triton_decode_attention, case, tolerance, with_bias=True)
    monkeypatch.setattr(decode_launch, "SPLIT_KEYS", 32)
    model = make_model("qwen2").cuda()
    prompts = [[i + 1, i + 2, i + 3, i + 4][: 1 + i % 4] for i in range(9)]
    params = SamplingParams(max_new_tokens=100, temperature=0.9, n=3, seed=5, ignore_eos=True)
    lengths = [(100, 33, 64, 5, 31, 97)[i % 6] for i in range(27)]  # within a split, at its edge, across several
    per_slot = BuiltinBackend(model, attention="sdpa", max_num_seqs=6, sync_every=3).generate(prompts, params, lengths)
    engine = BuiltinBackend(model, attention="triton", max_num_seqs=6, sync_every=3, release_after_generate=False)
    shared = engine.generate(prompts, params, lengths)
    assert engine.last_stats["attention"] == "triton" and engine.last_stats["graphs_captured"] >= 1
    assert decode_launch.launch_plan(2, 16, engine.cache.response_kv.shape[-2], paged=False).num_splits > 1
    assert [len(g.token_ids) for g in shared] == lengths
    assert_same_samples(shared, per_slot, allowed_boundary_flips=1)  # summation orders differ
