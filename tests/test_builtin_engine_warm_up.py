"""A benchmark's warm-up call builds what its timed call needs: every batch-size bucket, for any slot count.

The long-tail benchmark (`benchmarks/long_tail.py`) warms each layout with one call of forced lengths
(`warm_up_lengths`) before timing it. When that call skips a batch bucket the timed call reaches, the bucket's first
step is warmed up (compiled, a split-KV kernel variant built) and captured inside the timed call: on the H200 the
contiguous layout (180 slots for 512 sequences) spent about a second so at bucket 64, because the old lengths (the
first sequences longest) never thinned its batch below 128 before the last few sequences.
"""

from __future__ import annotations

import collections
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from benchmarks.long_tail import response_lengths, warm_up_lengths
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.runner import steady_pool
from hybridrl.rollout.engine.scheduler import Scheduler, batch_buckets

sys.path.insert(0, str(Path(__file__).parent))
from test_builtin_engine import make_model  # noqa: E402
from test_builtin_engine import engine_with_recorded_graphs  # noqa: E402
from test_paged_kv import memory_for_blocks  # noqa: E402


def buckets_visited(num_slots: int, lengths: list[int], n: int, sync_every: int, cap: int) -> collections.Counter:
    """Decode windows per batch bucket of a `generate` call with forced `lengths`, as the engine's loop schedules
    them (`BuiltinBackend.generate`: admit, decode a window, harvest at the sync, compact), without a model: every
    live sequence grows by the window's steps."""
    scheduler = Scheduler([i // n for i in range(len(lengths))], [8] * (len(lengths) // n), num_slots, None,
                          sync_every, cap, lengths, limits_at_sync=True)
    generated: dict[int, int] = {}
    windows: collections.Counter = collections.Counter()
    while scheduler.has_work:
        generated.update({sequence.slot: 1 for sequence in scheduler.admit()})
        steps = scheduler.steps_until_sync(sync_every, cap)
        windows[scheduler.batch_size()] += 1
        for slot in scheduler.live:
            generated[slot] = min(cap, generated[slot] + steps)
        progress = [generated.get(slot, 0) for slot in range(scheduler.rows_in_use())]
        scheduler.record_progress(progress)
        scheduler.harvest([length >= cap for length in progress], np.zeros((len(progress), cap), dtype=np.int64),
                          set(), None)
        for source, destination in scheduler.compaction_moves():
            generated[destination] = generated.pop(source)
    return windows


@pytest.mark.parametrize("num_sequences", [1, 2, 3, 8, 37, 64, 100, 512])
def test_the_warm_up_lengths_pass_through_every_bucket_at_every_slot_count(num_sequences):
    """For every slot count up to the sequences (the contiguous layout's budget decides it; the paged layout has one
    per sequence), the warm-up call's windows run at every batch bucket the engine can use."""
    lengths = warm_up_lengths(num_sequences, 16, 8192)
    for num_slots in range(1, num_sequences + 1):
        visited = buckets_visited(num_slots, lengths, 1, 16, 8192)
        assert set(batch_buckets(num_slots)) <= set(visited), (num_slots, sorted(visited))


@pytest.mark.parametrize("num_slots", [180, 512])
def test_the_long_tail_warm_up_visits_every_bucket_of_its_timed_call(num_slots):
    """The benchmark's shapes on the H200 (contiguous: 180 slots, paged: 512): the buckets of the timed call (its
    window counts per bucket are the trace's: 206 windows at 180 slots, 74 at 64, ...) are all warmed first. With the
    first sequences longest, the contiguous warm-up ran only buckets 180, 128, 8, 4, 2 and 1."""
    timed = buckets_visited(num_slots, response_lengths(512, 1024, 1.0, 16, 8192), 8, 16, 8192)
    warm = buckets_visited(num_slots, warm_up_lengths(512, 16, 8192), 8, 16, 8192)
    assert set(timed) <= set(warm), (sorted(timed), sorted(warm))
    if num_slots == 180:
        assert timed == {180: 206, 128: 72, 64: 74, 32: 79, 16: 125, 8: 21, 4: 34, 2: 21, 1: 9}
    assert sum(warm.values()) <= 30  # two windows a bucket: a few hundred steps, not the timed call's thousands


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_after_the_warm_up_call_the_timed_call_warms_nothing_up(layout, monkeypatch):
    """The engine itself (CPU, graphs recorded in place of CUDA graphs): fewer slots than sequences (`max_num_seqs`),
    a warm-up call with `warm_up_lengths`, then a call with long-tailed lengths: every step the second call
    captures has a signature the first one warmed, so none runs a warm-up (a compilation or kernel build on a GPU)."""
    model = make_model("qwen2")
    prompts = [[3 + p, 4, 5 + p] for p in range(12)]
    cap, sync_every, n = 32, 2, 4
    params = SamplingParams(max_new_tokens=cap, n=n, temperature=1.0, seed=0, ignore_eos=True)
    engine, graphs = engine_with_recorded_graphs(model, monkeypatch, sync_every=sync_every, keep_runs=False,
                                                 attention="triton", kv_cache=layout, kv_block_size=4,
                                                 max_num_seqs=11)
    engine.generate(prompts, params, response_lengths=warm_up_lengths(len(prompts) * n, sync_every, cap))
    assert engine.last_stats["num_slots"] == 11 and "warm_up" in graphs.events
    graphs.events.clear()
    lengths = response_lengths(len(prompts) * n, 6, 1.0, 1, cap)
    outputs = engine.generate(prompts, params, response_lengths=lengths)
    assert [len(output.token_ids) for output in outputs] == lengths
    assert "warm_up" not in graphs.events and graphs.events.count("capture") >= 4, graphs.events
    assert engine.last_stats["captures_without_warmup"] == engine.last_stats["graphs_captured"]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_thinning_batch_records_each_smaller_buckets_step_ahead(layout, monkeypatch):
    """Sequences finish one a window: each smaller batch bucket's step is recorded while the GPU still runs the window
    before (`Scheduler.next_batch_size`, `capture_decode_ahead`), so only the call's first bucket is recorded when
    due, with the GPU idle (on the H200 each was a dip in the GPU busy share at the bucket changes). Tokens equal the
    engine without graphs. A batch that never thins (every length the same) records nothing ahead."""
    model = make_model("qwen2")
    prompts = [[3 + p, 4, 5 + p] for p in range(5)]
    params = SamplingParams(max_new_tokens=40, n=2, temperature=1.0, seed=3, ignore_eos=True)
    lengths = [4 + 4 * i for i in range(10)]  # a sync every 3 steps (2 and the one ahead): at most one finishes at each
    engine, graphs = engine_with_recorded_graphs(model, monkeypatch, sync_every=2, keep_runs=False,
                                                 attention="triton", kv_cache=layout, kv_block_size=4)
    due, ahead = [], []
    step, capture_ahead = graphs.step, graphs.capture_ahead
    monkeypatch.setattr(graphs, "step", lambda key, *args, **kwargs: (
        due.append(key) if key not in graphs.graphs else None, step(key, *args, **kwargs))[1])
    monkeypatch.setattr(graphs, "capture_ahead", lambda key, *args: (
        ahead.append(key) if key not in graphs.graphs else None, capture_ahead(key, *args))[1])
    engine.generate(prompts, params, response_lengths=lengths)  # warms every bucket's signature
    due.clear(), ahead.clear()
    outputs = engine.generate(prompts, params, response_lengths=lengths)
    assert due == [(10, 0)] and ahead == [(8, 0), (4, 0), (2, 0), (1, 0)], (due, ahead)
    reference = BuiltinBackend(model, sync_every=2, use_cuda_graphs=False, attention="triton", kv_cache=layout,
                               kv_block_size=4).generate(prompts, params, response_lengths=lengths)
    assert [output.token_ids for output in outputs] == [output.token_ids for output in reference]
    due.clear(), ahead.clear()
    engine.generate(prompts, params, response_lengths=[12] * 10)
    assert due == [(10, 0)] and ahead == []


def test_nearby_budgets_give_the_same_paged_pool_and_warm_nothing_up(monkeypatch):
    """The paged pool bound by a budget keeps 6 significant bits of its block count (`steady_pool`), so a fraction
    of free memory that moved a little since the last call gives the same pool shape, and the same step signatures:
    the second call warms nothing up. (On the H200 the paged timed call warmed up every batch bucket: its pool had a
    few blocks fewer than the warm-up call's.)"""
    assert [steady_pool(blocks) for blocks in (1, 63, 64, 65, 127, 128, 130, 23594, 23595)] == \
        [1, 63, 64, 64, 126, 128, 128, 23552, 23552]
    assert all(blocks - steady_pool(blocks) <= blocks / 32 for blocks in range(1, 5000))
    model = make_model("qwen2")
    prompts = [[3 + p, 4, 5 + p] for p in range(6)]
    params = SamplingParams(max_new_tokens=24, n=2, temperature=1.0, seed=0, ignore_eos=True)
    engine, graphs = engine_with_recorded_graphs(model, monkeypatch, sync_every=2, keep_runs=False,
                                                 attention="triton", kv_cache="paged", kv_block_size=2,
                                                 kv_cache_memory=memory_for_blocks(model, 203, 2))
    engine.generate(prompts, params)
    assert engine.last_stats["kv_blocks"] == 200 and "warm_up" in graphs.events
    graphs.events.clear()
    engine.options = replace(engine.options, kv_cache_memory=memory_for_blocks(model, 201, 2))
    engine.runner.options = engine.options
    engine.generate(prompts, params)
    assert engine.last_stats["kv_blocks"] == 200 and "warm_up" not in graphs.events, graphs.events
