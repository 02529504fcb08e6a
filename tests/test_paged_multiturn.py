"""Multi-turn episodes on the paged KV cache: the observation prefill (`extend`) writes and reads through the block
table; when blocks run out, first turns start over and paused episodes are evicted and prefilled again on resume.
Held to the per-slot (contiguous) layout: same tokens, masks and log-probs in float32 over seeds, uneven turns and
tight pools, and every block back in the free list after the call."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hybridrl.envs.base import StepResult
from hybridrl.envs.rendering import ObservationRenderer
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.blocks import BlockAllocator
from hybridrl.rollout.engine.kv_cache import CacheGeometry, PagedKVCache
from hybridrl.rollout.engine.llama_forward import extend, rope_table
from hybridrl.rollout.engine.scheduler import Scheduler
from hybridrl.rollout.engine.weights import resolve_weights
from hybridrl.rollout.kernels.paged_attention import reference_paged_decode_attention
from hybridrl.rollout.multiturn import EpisodeBudget, make_sessions

sys.path.insert(0, os.path.dirname(__file__))
from test_multiturn import IM_END, TOKENIZER, assert_same_episodes, make_model, one_thread  # noqa: E402,F401
from test_paged_kv import memory_for_blocks, watch_schedulers  # noqa: E402


class Uneven:
    """Turns per episode and observation lengths differ by row and step, so episodes grow unevenly."""

    def __init__(self, row):
        self.row, self.steps = row, 0

    def reset(self):
        return [{"role": "user", "content": self.row["prompt"]}]

    def step(self, text):
        self.steps += 1
        if self.steps >= self.row["turns"]:
            return StepResult(reward=float(self.steps), done=True)
        return StepResult([{"role": "tool", "name": "t", "content": "x " * (self.row["obs"] * self.steps % 7)}])


ROWS = [{"prompt": "p" * (1 + 3 * i), "turns": 2 + i % 3, "obs": 2 + i} for i in range(4)]
BUDGET = EpisodeBudget(max_turns=4, max_episode_tokens=200)


def episodes(model, params, **engine_options):
    engine = BuiltinBackend(model, tokenizer=TOKENIZER, sync_every=3, **engine_options)
    result = engine.generate_episodes(make_sessions(Uneven, ROWS, n=2, name="test_paged_multiturn.py:Uneven"),
                                      ObservationRenderer(TOKENIZER), params, BUDGET)
    return engine.last_stats, result


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_episodes_equal_the_per_slot_ones_and_return_every_block(seed, monkeypatch):
    """Sampled (a ninth of the vocabulary stops a turn), uneven turns and observations: a roomy pool, pools so tight
    that first turns are preempted and paused episodes evicted (recomputed on resume), and fewer slots than episodes
    (compaction moves table rows) all give the per-slot layout's episodes, with the KV reused across turns when
    nothing is evicted (the same prefill tokens), and every block comes back."""
    model = make_model("qwen2" if seed % 2 else "llama", seed=seed)
    params = SamplingParams(max_new_tokens=7, temperature=1.0, seed=seed,
                            stop_token_ids=[IM_END, *range(seed, model.config.vocab_size, 9)])
    per_slot_stats, per_slot = episodes(model, params, attention="sdpa")
    assert len({len(e.token_ids) for e in per_slot}) > 3 and len({e.num_turns for e in per_slot}) > 1
    assert len({s.end - s.start for e in per_slot for s in e.spans if s.kind == "assistant"}) > 2  # uneven turns
    schedulers = watch_schedulers(monkeypatch)
    preemptions = []
    for num_blocks, block_size, max_num_seqs in ((1000, 4, 1024), (60, 4, 1024), (30, 8, 1024), (200, 4, 3)):
        stats, paged = episodes(model, params, kv_cache="paged", kv_block_size=block_size, max_num_seqs=max_num_seqs,
                                kv_cache_memory=memory_for_blocks(model, num_blocks, block_size))
        assert stats["kv_cache"] == "paged" and stats["attention"] == "paged-reference"
        assert_same_episodes(paged, per_slot)
        if num_blocks == 1000:  # all admitted at once, as per slot (later admissions prefill a prompt again)
            assert stats["prefill_tokens"] == per_slot_stats["prefill_tokens"]  # no context is computed again
        assert stats["observation_prefills"] == per_slot_stats["observation_prefills"] > 0
        assert stats["kv_blocks_peak"] <= stats["kv_blocks"] <= num_blocks
        preemptions.append(stats["preemptions"])
        blocks = schedulers[-1].blocks
        assert len(blocks.free) == blocks.num_usable and not blocks.prompt_blocks and not blocks.response
    assert preemptions[0] == preemptions[3] == 0 and min(preemptions[1:3]) > 0, preemptions  # evictions too


def test_evicted_episodes_give_back_their_prompts_blocks_and_prefill_from_the_start(monkeypatch):
    """Six distinct long prompts and a pool of 40 blocks (one episode needs 35): paused episodes must give back their
    prompt's blocks too, and then prefill their whole episode again on resume; the episodes equal the per-slot ones."""
    model = make_model("llama")
    rows = [{"prompt": "q" * (20 + 2 * i), "turns": 4, "obs": 3 + i} for i in range(6)]
    budget = EpisodeBudget(max_turns=4, max_episode_tokens=120)
    params = SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True)
    found = {}
    for name, options in (("per_slot", dict(attention="sdpa")),
                          ("paged", dict(kv_cache="paged", kv_block_size=4,
                                         kv_cache_memory=memory_for_blocks(model, 40, 4)))):
        engine = BuiltinBackend(model, tokenizer=TOKENIZER, sync_every=3, **options)
        found[name] = engine.generate_episodes(make_sessions(Uneven, rows, n=1, name="test_paged_multiturn.py:Uneven"),
                                               ObservationRenderer(TOKENIZER), params, budget)
    assert_same_episodes(found["paged"], found["per_slot"])
    assert engine.last_stats["preemptions"] > 0 and min(e.num_turns for e in found["paged"]) >= 2


def test_extend_through_the_block_table_equals_extend_on_the_per_slot_cache():
    """The same contexts held per slot and in scattered blocks (prompt blocks shared by two slots): the observation
    prefill gives the same logits, and its K/V lands at the same positions of each sequence."""
    torch.manual_seed(0)
    model = make_model("qwen2")
    w = resolve_weights(model, fuse_qkv=False, fuse_gate_up=False)
    layers, heads, dim = len(w.layers), w.num_kv_heads, w.head_dim
    block_size, prompt_lens, contexts = 4, [6, 6, 9], [13, 7, 10]  # slots 0 and 1 share prompt 0
    geometry = CacheGeometry(layers, heads, dim, 4, max(prompt_lens), 24, 2)
    paged = PagedKVCache(geometry, 3, 40, block_size, "cpu", torch.float32, reference_paged_decode_attention)
    per_slot = torch.zeros(layers, 2, 3, heads, 48, dim)
    per_slot[:, :, :, :, :16] = torch.randn(layers, 2, 3, heads, 16, dim)
    per_slot[:, :, 1, :, :6] = per_slot[:, :, 0, :, :6]  # the shared prompt
    order = torch.randperm(39).tolist()
    rows = {0: [1, 2], 1: [1, 2], 2: [3, 4, 5]}  # prompt blocks (columns 0-2); responses from column 3
    shuffled = {0: order[:2], 2: order[2:5]}
    table = torch.zeros(3, paged.block_table.shape[1], dtype=torch.long)
    for slot, prompt in ((0, 0), (1, 0), (2, 2)):
        table[slot, :len(rows[slot])] = torch.tensor(shuffled[prompt]) + 1
        table[slot, paged.prompt_columns:paged.prompt_columns + 6] = torch.tensor(order[5 + 6 * slot:11 + 6 * slot]) + 1
    paged.block_table.copy_(table)
    paged.begin_sequences(torch.arange(3), torch.tensor(prompt_lens))
    access_all = paged.extend_access(torch.arange(3), 48)
    positions = torch.arange(16).expand(3, 16)
    write, _ = access_all(positions, torch.tensor([16, 16, 16]))
    for layer in range(layers):  # fill the blocks with the per-slot contents (slot 1 rewrites the shared prompt)
        write(layer, per_slot[layer, :, :, :, :16].permute(0, 1, 3, 2, 4))
    cos, sin = rope_table(model, 48, "cpu", torch.float32)
    slots, starts = torch.tensor([2, 0, 1]), torch.tensor([contexts[2], contexts[0], contexts[1]])
    input_ids, lengths = torch.randint(1, 100, (3, 5)), torch.tensor([5, 2, 4])
    want = extend(w, per_slot, cos, sin, input_ids, lengths, starts, slots, 32)
    got = extend(w, None, cos, sin, input_ids, lengths, starts, slots, 32, access=paged.extend_access(slots, 32))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    _, read = access_all(positions, torch.tensor([16, 16, 16]))
    for slot, start, length in zip(slots.tolist(), starts.tolist(), lengths.tolist()):
        end = start + length
        for layer in range(layers):
            torch.testing.assert_close(read(layer)[:, slot, :, :end], per_slot[layer, :, slot, :, :end])


def test_a_resume_preempts_first_turns_then_evicts_paused_episodes_or_waits():
    """A resuming episode takes the blocks of its prefill and whole turn: from live sequences in their first turn
    (they start over from the prompt), then from paused episodes (evicted: their blocks, their prompt's too when no
    sample holds it, are taken and their context is prefilled again when they resume), never from a live one past
    its first turn; when that is not enough it stays paused, unchanged."""
    allocator = BlockAllocator(num_blocks=1 + 8, block_size=4, prompt_columns=1)
    scheduler = Scheduler([0, 1, 2], [4, 4, 4], num_slots=3, blocks=allocator, window=4, max_new_tokens=4)
    first, second, third = scheduler.admit()  # a prompt block and a window's block each: 6 of 8
    scheduler.record_progress([4, 4, 4])
    scheduler.pause(0)
    scheduler.pause(1)
    resumed, preempted = scheduler.resume(0, context_len=4 + 13, limit=4)  # 13 + 3 rows: 4 blocks, 3 more
    assert resumed and preempted == [third] and scheduler.waiting[0] is third and first.context == 13
    assert len(allocator.response[0].blocks) == 4 and allocator.in_use == 7 and 1 in scheduler.paused
    assert scheduler.resume(1, context_len=4 + 13, limit=4) == (False, [])  # only a live later turn holds blocks
    assert (second.prompt_len, second.generated, second.context) == (4, 4, 0) and 1 in scheduler.paused
    scheduler.pause(0)
    assert scheduler.resume(1, context_len=4 + 13, limit=4) == (True, [])
    assert first.needs_context and scheduler.evicted == [0] and 0 not in allocator.response
    assert allocator.in_use == 1 + 4 and scheduler.preemptions == 2  # its prompt's block went too (no sample held it)
    scheduler.pause(1)
    assert scheduler.resume(0, context_len=4 + 13, limit=4) == (True, [])  # evicts the other paused episode
    assert first.fills_entry and allocator.in_use == 1 + 4 and scheduler.evicted == [0, 1]  # its prompt taken anew



def test_a_resume_that_fits_does_not_sort_the_live_sequences(monkeypatch):
    """A wave of resumes with blocks to spare sorts nothing: the queue of possible victims (every live sequence by
    age) is made only when the pool is short, or a wave of 512 resumes sorted 512 sequences 512 times. The pool
    then runs short and the next resume sorts once and preempts the youngest first turn, as the test above."""
    from hybridrl.rollout.engine import scheduler as scheduler_module

    sorts = []  # the lengths of the lists sorted, but for the empty ones (`_requeue` of no preempted sequence)

    def counting_sorted(items, **kwargs):
        items = list(items)
        if items:
            sorts.append(len(items))
        return sorted(items, **kwargs)

    monkeypatch.setattr(scheduler_module, "sorted", counting_sorted, raising=False)
    allocator = BlockAllocator(num_blocks=1 + 20, block_size=4, prompt_columns=1)
    scheduler = Scheduler([0] * 6, [4], num_slots=6, blocks=allocator, window=4, max_new_tokens=4)
    sequences = scheduler.admit()  # one shared prompt block and a window's block each: 7 of 20
    scheduler.record_progress([4] * 6)
    for slot in range(4):
        scheduler.pause(slot)
    for slot in range(4):  # 9 + 3 rows: 3 blocks, 2 more each: 15 of 20
        assert scheduler.resume(slot, context_len=4 + 9, limit=4) == (True, [])
    assert sorts == [] and allocator.in_use == 15
    scheduler.pause(0)
    resumed, preempted = scheduler.resume(0, context_len=4 + 30, limit=4)  # 6 more blocks: the youngest gives one
    assert resumed and preempted == [sequences[5]] and sorts[0] == 5  # the other live and paused-then-live ones

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_episodes_on_cuda_equal_the_per_slot_ones(monkeypatch):
    """Unrun where this was written (no GPU): the Triton paged kernel, compiled pieces and CUDA graphs read the
    slots' prompt lengths and the blocks the resumes wrote in place; greedy float32 episodes equal the per-slot
    layout's, with a roomy pool and one of 40 blocks of 8 (episodes wait for blocks), all blocks returned."""
    model = make_model("qwen2").cuda()
    params = SamplingParams(max_new_tokens=7, temperature=0, stop_token_ids=[IM_END])
    _, per_slot = episodes(model, params, attention="sdpa")
    config = model.config
    token_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    schedulers = watch_schedulers(monkeypatch)
    for kv_cache_memory in (0.3, (40 * 8 * token_bytes + 1) / free):
        stats, paged = episodes(model, params, kv_cache="paged", kv_block_size=8, kv_cache_memory=kv_cache_memory)
        assert stats["attention"] == "paged-triton" and stats["graphs_captured"] >= 1 and stats["compiled"]
        assert stats["observation_prefills"] > 0
        assert_same_episodes(paged, per_slot, atol=1e-4)
        blocks = schedulers[-1].blocks
        assert len(blocks.free) == blocks.num_usable and not blocks.prompt_blocks and not blocks.response
