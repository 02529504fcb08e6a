"""Paged KV cache: block bookkeeping (shared prompt blocks, admission by blocks, preemption), the engine on paged vs
contiguous layouts (same tokens and log-probs, with preemption forced), and the paged attention (reference on CPU,
the Triton kernel in interpret mode and on CUDA)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine import scheduler as scheduling
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.blocks import BlockAllocator
from hybridrl.rollout.engine.scheduler import Scheduler
from hybridrl.rollout.kernels import decode_attention
from hybridrl.rollout.kernels.paged_attention import reference_paged_decode_attention

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention_cases as cases  # noqa: E402
from paged_attention_cases import BLOCK_SIZES, check_paged  # noqa: E402
from test_builtin_engine import PROMPTS, hf_logprobs, make_model, one_thread  # noqa: E402,F401 (an autouse fixture)

HAS_TRITON = decode_attention.triton is not None
CPU_GIB = 4 * 1024**3  # a fractional kv_cache_memory on CPU is a fraction of 4 GiB (runner.CPU_MEMORY_REFERENCE_GIB)


def memory_for_blocks(model, num_blocks: int, block_size: int) -> float:
    """The kv_cache_memory that holds exactly `num_blocks` blocks of `model`'s float32 KV on CPU."""
    config = model.config
    token_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4
    return (num_blocks * block_size * token_bytes + 1) / CPU_GIB


def watch_schedulers(monkeypatch) -> list[Scheduler]:
    """Every Scheduler the engine builds, so a test can inspect its blocks after the call."""
    made, original = [], Scheduler.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(Scheduler, "__init__", init)
    return made


# ---- bookkeeping ----------------------------------------------------------------------------------

def test_samples_of_a_prompt_share_its_blocks_and_everything_is_returned():
    allocator = BlockAllocator(num_blocks=20, block_size=4, prompt_columns=3)
    scheduler = Scheduler([0, 0, 0, 1], [9, 2], num_slots=4, blocks=allocator, window=3, max_new_tokens=10)
    admitted = scheduler.admit()
    assert [s.fills_entry for s in admitted] == [True, False, False, True]  # the first sample of each prompt
    rows: dict[int, dict[int, int]] = {}
    for slot, column, block in allocator.take_writes():
        rows.setdefault(slot, {})[column] = block
    prompt_zero = [rows[0][column] for column in range(3)]  # 9 tokens: 3 blocks of 4
    assert all([rows[slot][column] for column in range(3)] == prompt_zero for slot in (1, 2))
    assert len(set(prompt_zero) | {rows[3][0]}) == 4 and 0 not in prompt_zero  # block 0 is scratch
    # first window: generated 1 -> 3 steps write 3 response rows -> one block each
    assert {slot: rows[slot][3] for slot in range(3)} and len({rows[slot][3] for slot in range(4)}) == 4
    assert allocator.in_use == 3 + 1 + 4
    scheduler.record_progress([4, 4, 4, 4])
    scheduler.reserve()  # generated 4 -> 3 more steps -> rows 6 -> 2 blocks each
    assert allocator.in_use == 3 + 1 + 8
    for slot in (0, 1, 3):
        scheduler.finish(slot)
    assert allocator.in_use == 3 + 2  # prompt 0 is still held by slot 2
    scheduler.finish(2)
    assert allocator.in_use == 0 and len(allocator.free) == allocator.num_usable == 19
    assert not allocator.prompt_blocks and not allocator.response and allocator.peak_in_use == 12


def test_admission_waits_for_blocks_and_preemption_takes_the_youngest():
    allocator = BlockAllocator(num_blocks=1 + 6, block_size=4, prompt_columns=1)
    scheduler = Scheduler([0, 1, 2, 3], [4, 4, 4, 4], num_slots=4, blocks=allocator, window=4, max_new_tokens=12)
    assert [s.index for s in scheduler.admit()] == [0, 1, 2]  # 2 blocks each (prompt + first window): 6 of 6
    assert [s.index for s in scheduler.waiting] == [3]
    scheduler.record_progress([5, 5, 5])  # each now needs a second response block, and none is free
    preempted = scheduler.reserve()
    assert [s.index for s in preempted] == [2]  # the youngest gives its two blocks to the two older ones
    assert [s.index for s in scheduler.waiting] == [2, 3] and scheduler.waiting[0].kept == 5  # it keeps its tokens
    assert scheduler.preemptions == 1 and scheduler.preempted_tokens == 5
    assert sorted(scheduler.live) == [0, 1] and allocator.in_use == 6
    scheduler.finish(0)  # 3 blocks back: the kept sequence needs its prompt's and 5 - 1 + 4 response rows' (2)
    assert [s.index for s in scheduler.admit()] == [2] and [s.index for s in scheduler.waiting] == [3]
    assert scheduler.live[0].generated == 5 and len(allocator.response[2].blocks) == 2 and not allocator.free
    scheduler.record_progress([5, 9])  # slot 0 (the kept one) is back at 5, as the runner restores it
    assert scheduler.decoded_tokens == 3 * 4 + 4  # three sequences 1 -> 5, then sequence 1 5 -> 9


def replay_reserves(pool: int, monkeypatch=None) -> list:
    """Uneven forced lengths (limits at the syncs), a window of 3, blocks of 4: every sync's progress, `reserve`,
    harvest and admission; returns each sync's (preempted, block-table writes, response blocks). With `monkeypatch`,
    `reserve` never takes its fast path (its sum of needs made too large)."""
    if monkeypatch is not None:
        monkeypatch.setattr(Scheduler, "_window_needs", lambda self: [(None, 0, 1 << 30)])
    lengths = [5, 17, 2, 30, 9, 12, 25, 3]
    allocator = BlockAllocator(num_blocks=pool, block_size=4, prompt_columns=2)
    scheduler = Scheduler([i // 2 for i in range(8)], [6, 5, 7, 8], num_slots=6, blocks=allocator, window=3,
                          max_new_tokens=30, limits=lengths, limits_at_sync=True)
    history, done = [], [0] * 6
    while scheduler.has_work:
        preempted = [s.index for s in scheduler.reserve()]
        scheduler.admit()
        history.append((preempted, allocator.take_writes(),
                        {index: list(held.blocks) for index, held in allocator.response.items()}))
        steps = scheduler.steps_until_sync(3, 30)
        scheduler.record_progress([scheduler.live[slot].generated + steps if slot in scheduler.live else 0
                                   for slot in range(6)])
        scheduler.harvest(done, torch.zeros(6, 40, dtype=torch.long), set(), None)
    assert allocator.in_use == 0
    return history


@pytest.mark.parametrize("pool", [200, 14])
def test_reserve_fast_path_gives_the_blocks_of_the_ordered_scan(pool, monkeypatch):
    """`reserve` without preemption grows every sequence in one pass (`_window_needs`): the same blocks, writes and
    preemptions as the oldest-first scan, with a pool that never runs dry and one that preempts."""
    fast = replay_reserves(pool)
    assert any(preempted for preempted, _, _ in fast) == (pool == 14)
    assert fast == replay_reserves(pool, monkeypatch)


# ---- the engine -----------------------------------------------------------------------------------

def assert_same_generations(ours, reference) -> None:
    assert [g.token_ids for g in ours] == [g.token_ids for g in reference]
    assert [g.finish_reason for g in ours] == [g.finish_reason for g in reference]
    for a, b in zip(ours, reference):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_gives_the_contiguous_tokens_and_logprobs_with_and_without_preemption(seed, monkeypatch):
    """float32, sampled, uneven lengths (a tenth of the vocabulary stops): paged equals both contiguous layouts,
    with a roomy pool and with pools so small that sequences are preempted and recomputed, and every block is back
    in the free list after each call."""
    model = make_model("qwen2", seed=seed)
    prompts = PROMPTS + [[i + 2, (5 * i) % 60 + 1, 7][: 1 + i % 3] for i in range(4)]
    params = SamplingParams(max_new_tokens=14, temperature=1.0, n=3, seed=seed, ignore_eos=True,
                            stop_token_ids=list(range(seed, model.config.vocab_size, 11)))
    per_slot = BuiltinBackend(model, attention="sdpa", max_num_seqs=7, sync_every=3).generate(prompts, params)
    shared = BuiltinBackend(model, attention="triton", max_num_seqs=7, sync_every=3).generate(prompts, params)
    assert_same_generations(shared, per_slot)
    assert len({len(g.token_ids) for g in per_slot}) > 3
    schedulers, preemptions = watch_schedulers(monkeypatch), []
    for num_blocks, block_size in ((400, 4), (8, 4), (14, 2), (6, 8)):
        engine = BuiltinBackend(model, kv_cache="paged", kv_block_size=block_size, sync_every=3,
                                kv_cache_memory=memory_for_blocks(model, num_blocks, block_size))
        paged = engine.generate(prompts, params)
        stats = engine.last_stats
        assert stats["kv_cache"] == "paged" and stats["attention"] == "paged-reference"
        assert_same_generations(paged, per_slot)
        preemptions.append(stats["preemptions"])
        assert stats["kv_blocks"] <= num_blocks and stats["kv_blocks_peak"] <= stats["kv_blocks"]
        # Recompute preemption: no token is sampled twice (decode samples all but each first token, as without
        # preemption), and each preempted sequence's kept tokens but the last are prefilled again, once.
        assert stats["decoded_tokens"] == sum(len(g.token_ids) for g in paged) - len(paged)
        assert stats["refilled_tokens"] == stats["preempted_tokens"] - stats["preemptions"]
        blocks = schedulers[-1].blocks
        assert len(blocks.free) == blocks.num_usable and not blocks.prompt_blocks and not blocks.response
    assert preemptions[0] == 0 and min(preemptions[1:]) > 0, preemptions
    assert stats["refilled_tokens"] > 0
    for generation in paged[::5]:  # and against the HF forward pass
        want = hf_logprobs(model, prompts[generation.prompt_index], generation.token_ids)
        assert generation.logprobs == pytest.approx(want.tolist(), abs=1e-4)


def test_freed_slots_point_at_scratch_and_compaction_moves_table_rows(monkeypatch):
    """Greedy with early stops: slots finish and the live ones are compacted into a smaller bucket (table rows
    move, blocks stay); after the call every row of the kept cache points at the scratch block."""
    compactions, plan = [], scheduling.Scheduler.compaction_moves
    monkeypatch.setattr(scheduling.Scheduler, "compaction_moves",
                        lambda self: compactions.append(plan(self)) or compactions[-1])
    model = make_model("llama")
    prompts = [[i + 1, (3 * i) % 50 + 2, (7 * i) % 40 + 3][: 1 + i % 3] for i in range(8)]
    params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=list(range(0, 128, 4)), ignore_eos=True)
    reference = BuiltinBackend(model, sync_every=1).generate(prompts, params)
    engine = BuiltinBackend(model, sync_every=1, kv_cache="paged", kv_block_size=4, release_after_generate=False)
    assert_same_generations(engine.generate(prompts, params), reference)
    assert any(compactions), "no compaction happened"
    assert int(engine.cache.block_table.abs().sum()) == 0


def test_forced_response_lengths_are_kept_on_both_layouts():
    model = make_model("qwen3")
    params = SamplingParams(max_new_tokens=12, temperature=0.8, n=2, seed=4, ignore_eos=True)
    lengths = [1, 12, 5, 7, 2, 9, 3, 11]
    outputs = [BuiltinBackend(model, kv_cache=layout, kv_block_size=4, sync_every=4).generate(
        PROMPTS, params, response_lengths=lengths) for layout in ("contiguous", "paged")]
    assert [len(g.token_ids) for g in outputs[1]] == lengths
    assert_same_generations(outputs[1], outputs[0])
    with pytest.raises(ValueError, match="one length in"):
        BuiltinBackend(model).generate(PROMPTS, params, response_lengths=[13] * 8)


def test_a_sequence_longer_than_the_whole_pool_is_refused_in_one_sentence():
    model = make_model("llama")
    engine = BuiltinBackend(model, kv_cache="paged", kv_block_size=4, kv_cache_memory=memory_for_blocks(model, 6, 4))
    with pytest.raises(ValueError) as error:  # 9 prompt + 20 new tokens: 3 + 5 blocks + scratch > 6
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0))
    message = str(error.value)
    assert "6 KV blocks" in message and "9 that one sequence" in message and "raise kv_cache_memory" in message
    assert message.count(". ") == 0 and "\n" not in message


def test_options_are_validated_and_plumbed_from_the_config():
    from hybridrl.config.loading import load_config
    from hybridrl.config.schema import ConfigError
    from hybridrl.training.components import build_rollout

    model = make_model("llama")
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        BuiltinBackend(model, kv_cache="blocks")
    with pytest.raises(ValueError, match="kv_block_size"):
        BuiltinBackend(model, kv_block_size=0)
    with pytest.raises(ValueError, match="attention=auto"):  # paged brings its own attention
        BuiltinBackend(model, kv_cache="paged", attention="sdpa").generate(PROMPTS, SamplingParams(max_new_tokens=2))
    config = load_config(None, ["rollout.backend=builtin", "rollout.engine.kv_cache=paged",
                                "rollout.engine.kv_block_size=32"])
    engine = build_rollout(config, model, None, torch.device("cpu"))
    assert (engine.options.kv_cache, engine.options.kv_block_size) == ("paged", 32)
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, temperature=0))
    assert engine.last_stats["kv_cache"] == "paged"
    BuiltinBackend(model).generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, temperature=0))
    with pytest.raises(ConfigError, match="rollout.engine.kv_cache must be"):
        load_config(None, ["rollout.engine.kv_cache=blocks"])


# ---- attention ------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_reference_equals_the_contiguous_reference(block_size, dtype):
    """The same keys scattered into shuffled blocks (scratch block random): the gather-based reference equals
    the contiguous one, and the new key/value land where the table says."""
    for seed, shape in enumerate(cases.CASES):
        check_paged(reference_paged_decode_attention, seed, shape, block_size, dtype, cases.TOLERANCE[dtype])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it is optional; the reference covers CPU)")
def test_paged_triton_kernel_matches_the_reference_in_interpret_mode():
    assert "paged kernel cases passed" in cases.run_in_interpreter("paged_attention_cases", "check_kernel_cases",
                                                                   timeout=900)


def on_gpu(test):
    """The marks of a GPU test: `-m gpu`, and skipped without CUDA or triton."""
    for mark in (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
                 pytest.mark.skipif(not HAS_TRITON, reason="needs triton")):
        test = mark(test)
    return test


@on_gpu
@pytest.mark.parametrize("split_keys", [None, 32])  # one program per (slot, head); split-KV over 32-key splits
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_kernel_on_cuda(monkeypatch, split_keys, dtype):
    """The compiled kernel (bf16 included, which the interpreter cannot check) against the contiguous reference.
    Each case compiles a few kernel variants (a minute or so in all on an H200: give the call that)."""
    from hybridrl.rollout.kernels import decode_launch, paged_attention

    monkeypatch.setattr(decode_launch, "SPLIT_KEYS", split_keys or decode_launch.SPLIT_KEYS)
    # (shape, block size): Qwen2-0.5B's heads with an odd block size, Qwen2.5-1.5B's heads at the engine's block size.
    for seed, (shape, block_size) in enumerate([(cases.CASES[0], 5), ((512, 2, 6, 128, 64, 512, 300), 64)]):
        check_paged(paged_attention.triton_paged_decode_attention, seed, shape, block_size, dtype,
                    cases.TOLERANCE[dtype], device="cuda")


@on_gpu
def test_paged_engine_on_cuda(monkeypatch):
    """The engine with CUDA graphs and compiled pieces (float32): paged equals contiguous, with split-KV (8-key
    splits) on uneven lengths, and with preemption forced by 12 blocks of 8 on full-length responses (27 x 20 tokens
    need 27 x 3 response blocks; lengths do not depend on the sampled ids, so the schedule, and with it the
    preemptions, is the CPU's: 23 there), which keep their tokens and continue after them."""
    from hybridrl.rollout.kernels import decode_launch
    from test_decode_attention import assert_same_samples

    model = make_model("qwen2").cuda()
    prompts = [[i + 1, i + 2, i + 3, i + 4][: 1 + i % 4] for i in range(9)]
    uneven = SamplingParams(max_new_tokens=20, temperature=0.9, n=3, seed=5, ignore_eos=True,
                            stop_token_ids=list(range(0, 128, 5)))
    full_length = SamplingParams(max_new_tokens=20, temperature=0.9, n=3, seed=5, ignore_eos=True)
    for params, kv_cache_memory, split_keys in ((uneven, 0.3, 8), (full_length, None, 512)):
        contiguous = BuiltinBackend(model, max_num_seqs=6, sync_every=3).generate(prompts, params)
        if kv_cache_memory is None:  # 12 blocks of 8 tokens at 512 bytes a token, a fraction of what the engine finds
            free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
            kv_cache_memory = (12 * 8 * 512 + 1) / free
        monkeypatch.setattr(decode_launch, "SPLIT_KEYS", split_keys)
        engine = BuiltinBackend(model, kv_cache="paged", kv_block_size=8, sync_every=3, kv_cache_memory=kv_cache_memory)
        paged = engine.generate(prompts, params)
        stats = engine.last_stats
        assert stats["attention"] == "paged-triton" and stats["graphs_captured"] >= 1
        assert_same_samples(paged, contiguous, allowed_boundary_flips=1)  # summation orders differ
        assert stats["decoded_tokens"] == sum(len(g.token_ids) for g in paged) - len(paged)
    assert stats["kv_blocks"] <= 12 and stats["preemptions"] > 0, stats
    assert stats["refilled_tokens"] == stats["preempted_tokens"] - stats["preemptions"] > 0
