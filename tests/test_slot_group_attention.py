"""`slot_group_attention.py` (several slots per program) against the prefix-shared reference: in Triton's
interpreter on CPU, lowered for sm_90 without a GPU, and on a GPU at the benchmark shape."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hybridrl.rollout import slot_group_attention
from hybridrl.rollout.decode_attention import reference_decode_attention

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention_cases as cases  # noqa: E402

HAS_TRITON = slot_group_attention.triton is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (optional)")


@needs_triton
def test_slot_groups_match_reference_in_interpret_mode():
    assert "slot group cases passed" in cases.run_in_interpreter("decode_attention_cases", "check_slot_group_cases",
                                                                  timeout=600)


@needs_triton
def test_engine_with_slot_groups_in_interpret_mode_matches_sdpa():
    output = cases.run_in_interpreter("decode_attention_cases", "check_engine_with_slot_groups", timeout=600)
    assert output.count("engine with kernel passed") == 5


@needs_triton
@pytest.mark.parametrize("slots, rope, diagonal", [(2, False, False), (2, True, False), (4, True, False),
                                                   (2, True, True), (4, True, True)])
def test_slot_group_kernel_compiles_for_hopper(slots, rope, diagonal):
    """bf16 at Qwen2-0.5B's group (7 query heads per KV head) and head_dim 64, lowered to a cubin on CPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = slot_group_attention._slot_group_kernel
    if not isinstance(kernel, slot_group_attention.triton.runtime.JITFunction):
        pytest.skip("the kernel was built in interpret mode (TRITON_INTERPRET is set)")
    signature = {name: "constexpr" for name in kernel.arg_names}
    signature.update({name: "*bf16" for name in ("Q", "PK", "PV", "RK", "RV", "OUT", "NEW_KV", "COS", "SIN", "BIAS")})
    signature.update({name: "*i64" for name in ("PROMPT_INDEX", "PROMPT_LEN", "RESPONSE_LEN")})
    signature.update({name: "i32" for name in kernel.arg_names if name.startswith("stride")}, qk_scale="fp32",
                     batch="i32")
    constants = dict(GROUP=7, HEAD_DIM=64, SLOTS=slots, ROWS_PAD=max(16, 1 << (7 * slots - 1).bit_length()),
                     BLOCK_D=64, BLOCK_N=slot_group_attention.BLOCK_N, IEEE=False, WRITE_NEW=True, ROPE=rope,
                     HAS_BIAS=rope, DIAGONAL=diagonal)
    compiled = slot_group_attention.triton.compile(ASTSource(kernel, signature, constants),
                                                   target=GPUTarget("cuda", 90, 32),
                                                   options=dict(num_warps=slot_group_attention.NUM_WARPS))
    assert "cubin" in compiled.asm and compiled.metadata.shared < 160 * 1024


def test_slot_counts_other_than_1_2_4_are_refused():
    case = cases.make_case(0, *cases.CASES[0])
    with pytest.raises((ValueError, ImportError), match="slots must be 1, 2 or 4|needs the triton package"):
        slot_group_attention.slot_group_decode_attention(**case, slots=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("slots, diagonal", [(2, False), (4, False), (2, True), (4, True)])
def test_slot_groups_on_cuda_at_the_benchmark_shape(slots, diagonal):
    """bf16, 512 slots of 64 entries (8 adjacent samples each), group 7, head_dim 64, with RoPE and bias."""
    def engine_case(seed: int) -> dict:
        case = cases.make_case(seed, 512, 2, 7, 64, 64, 256, 256, dtype=torch.bfloat16, device="cuda")
        case["prompt_index"] = torch.arange(512, device="cuda") // 8
        return cases.engine_like(case)

    case = engine_case(0)
    attention = lambda **kwargs: slot_group_attention.slot_group_decode_attention(**kwargs, slots=slots,  # noqa: E731
                                                                                    diagonal=diagonal)
    torch.testing.assert_close(attention(**case), reference_decode_attention(**case), **cases.BF16_TOLERANCE)
    cases.check_rope(attention, engine_case(1), cases.BF16_TOLERANCE, True)


def test_slots_per_program_is_validated_in_config_and_engine():
    from hybridrl.config import ConfigError, load_config
    from hybridrl.rollout.builtin import BuiltinBackend
    from test_builtin_engine import make_model

    with pytest.raises(ConfigError, match="rollout.slots_per_program must be 1, 2 or 4; got 3"):
        load_config(None, ["rollout.slots_per_program=3"])
    with pytest.raises(ConfigError, match="set rollout.attention=triton"):
        load_config(None, ["rollout.slots_per_program=2", "rollout.attention=sdpa"])
    assert load_config(None, ["rollout.slots_per_program=4", "rollout.attention=triton"]).rollout.slots_per_program == 4
    with pytest.raises(ValueError, match="slots_per_program must be 1, 2 or 4"):
        BuiltinBackend(make_model("llama"), slots_per_program=8)
