"""Recompute preemption on the paged KV cache (`engine/preemption.py`): which context a re-admitted sequence prefills
again; multi-turn first turns preempted mid-turn that continue after their kept tokens, equal to the per-slot
layout's episodes; forced response lengths through preemption; GRPO steps and a LoRA policy on a preempting paged
cache equal to the contiguous ones. (Single-turn engine runs over seeds and pools, with the decoded-token count, are in
test_paged_kv.py.)"""

from __future__ import annotations

import os
import sys

import torch

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine import runner as runner_module
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.preemption import KeptResponse, refill_rows
from hybridrl.rollout.engine.scheduler import SequenceSlot

sys.path.insert(0, os.path.dirname(__file__))
from test_multiturn import IM_END, assert_same_episodes, make_model, one_thread  # noqa: E402,F401
from test_paged_kv import memory_for_blocks  # noqa: E402
from test_paged_multiturn import episodes  # noqa: E402


def kept(tokens: list[int]) -> KeptResponse:
    return KeptResponse(torch.tensor(tokens), torch.zeros(len(tokens)))


def test_refill_rows_feed_the_prompt_only_when_its_blocks_were_taken_anew_and_never_the_last_kept_token():
    prompts = [[11, 12, 13], [21, 22]]
    sequences = [SequenceSlot(0, 0, 3, slot=4, kept=3, fills_entry=False),  # prompt held by a sample: response only
                 SequenceSlot(1, 1, 2, slot=2, kept=2, fills_entry=True),  # prompt taken anew: from position 0
                 SequenceSlot(2, 0, 3, slot=5, kept=1, fills_entry=False),  # nothing to feed
                 SequenceSlot(3, 1, 2, slot=0, kept=1, fills_entry=True)]
    responses = {0: kept([7, 8, 9]), 1: kept([5, 6]), 2: kept([3]), 3: kept([4])}
    writers, readers = refill_rows(sequences, prompts, responses)
    assert writers == [(2, [21, 22, 5], 0), (0, [21, 22], 0)]  # writers first: the readers may read their prompt
    assert readers == [(4, [7, 8], 3)]
    assert refill_rows(sequences[2:3], prompts, responses) == []


def test_preempted_first_turns_continue_after_their_kept_tokens_in_multiturn_episodes(monkeypatch):
    """Turns of up to 16 tokens and a pool of 60 blocks of 4 for 8 episodes: first turns are preempted mid-turn and
    re-admitted with their tokens (the refill runs), and the episodes equal the per-slot layout's."""
    refilled, refill = [], runner_module.refill

    def watched_refill(run, prompts, sequences, *rest):
        refilled.extend(sequences)
        refill(run, prompts, sequences, *rest)
    monkeypatch.setattr(runner_module, "refill", watched_refill)
    model = make_model("llama", seed=0)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=0,
                            stop_token_ids=[IM_END, *range(0, model.config.vocab_size, 29)])
    _, per_slot = episodes(model, params, attention="sdpa")
    stats, paged = episodes(model, params, kv_cache="paged", kv_block_size=4,
                            kv_cache_memory=memory_for_blocks(model, 60, 4))
    assert_same_episodes(paged, per_slot)
    assert refilled and any(sequence.kept > 1 for sequence in refilled)
    assert stats["decoded_tokens"] > 0 and stats["refilled_tokens"] > 0


def test_forced_lengths_survive_preemption():
    """Forced response lengths (noticed at the syncs, as benchmarks force them) in a pool of 10 blocks of 4 (the step
    launched ahead at each sync has the scheduler admit fewer, so 12 no longer preempts): sequences are preempted and
    re-admitted, every response still has its length, and tokens and log-probs equal the contiguous cache's."""
    from test_paged_kv import assert_same_generations

    model = make_model("qwen2", seed=3)
    prompts = [[i + 1, 2 * i + 3, 5][: 1 + i % 3] for i in range(6)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, n=2, seed=3, ignore_eos=True)
    lengths = [16, 3, 9, 14, 1, 16, 7, 12, 5, 16, 10, 2]
    contiguous = BuiltinBackend(model, sync_every=3).generate(prompts, params, response_lengths=lengths)
    engine = BuiltinBackend(model, kv_cache="paged", kv_block_size=4, sync_every=3,
                            kv_cache_memory=memory_for_blocks(model, 10, 4))
    paged = engine.generate(prompts, params, response_lengths=lengths)
    assert [len(g.token_ids) for g in paged] == lengths
    assert_same_generations(paged, contiguous)
    assert engine.last_stats["preemptions"] > 0


def test_grpo_steps_on_a_preempting_paged_cache_equal_the_contiguous_ones(tmp_path):
    """Readiness for `auto`: two GRPO steps whose rollouts are preempted (24-token responses, a sync every 16 steps,
    a pool of 34 blocks of 4 for 32 sequences) log the same responses and rewards as on the contiguous cache, and
    losses equal to float32 rounding."""
    from conftest import contains_seven, tiny_actor, toy_prompts

    from hybridrl.data.datasets import PromptDataset
    from hybridrl.training.trainer import RLTrainer

    settings = dict(rollout__max_new_tokens=24, rollout__num_samples_per_prompt=4, trainer__prompts_per_step=8,
                    actor__micro_batch_size=32, trainer__device="cpu", logging__sinks=["jsonl"],
                    trainer__save_model=False, trainer__total_steps=2, actor__lr=1e-3, rollout__backend="builtin",
                    rollout__temperature=1.0)
    histories, engines = {}, {}
    for layout in ("contiguous", "paged"):
        actor = tiny_actor()
        memory = memory_for_blocks(actor.model, 34, 4) if layout == "paged" else 0.3
        trainer = RLTrainer(actor=actor, reward_fn=contains_seven,
                            dataset=PromptDataset(toy_prompts(), actor.tokenizer, max_length=16),
                            trainer__output_dir=str(tmp_path / layout), rollout__engine__kv_cache=layout,
                            rollout__engine__kv_block_size=4, rollout__kv_cache_memory=memory, **settings)
        histories[layout], engines[layout] = trainer.train(), trainer.parts.rollout
    assert engines["paged"].last_stats["kv_cache"] == "paged" and engines["paged"].last_stats["preemptions"] > 0
    assert histories["paged"][-1]["rollout/preemptions"] == engines["paged"].last_stats["preemptions"]
    assert histories["paged"][-1]["rollout/refilled_tokens"] > 0
    assert "rollout/preemptions" not in histories["contiguous"][0]  # logged for the paged layout only
    for contiguous, paged in zip(histories["contiguous"], histories["paged"]):
        for key in ("rollout/response_length_mean", "reward/mean"):
            assert paged[key] == contiguous[key], key
        assert abs(paged["actor/policy_loss"] - contiguous["actor/policy_loss"]) < 1e-5


def test_a_lora_policy_on_a_preempting_paged_cache_samples_the_contiguous_tokens():
    """Readiness for `auto`: a LoRA adapter (read in place by decode, prefill and the refill's `extend`), sampled, with
    a pool of 10 blocks of 4: preempted and refilled sequences give the contiguous cache's tokens and log-probs."""
    from test_builtin_engine import PROMPTS, make_lora_model
    from test_paged_kv import assert_same_generations

    model = make_lora_model("qwen2")
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=1, ignore_eos=True)
    contiguous = BuiltinBackend(model, sync_every=3).generate(PROMPTS, params)
    engine = BuiltinBackend(model, kv_cache="paged", kv_block_size=4, sync_every=3,
                            kv_cache_memory=memory_for_blocks(model, 10, 4))
    assert_same_generations(engine.generate(PROMPTS, params), contiguous)
    assert engine.last_stats["preemptions"] > 0 and engine.last_stats["refilled_tokens"] > 0
