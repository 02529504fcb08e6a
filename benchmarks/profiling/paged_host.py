"""The paged KV cache's scheduling work on the host, without a model: what `Scheduler.admit` and `Scheduler.reserve`
cost for one rollout call's batch (default: grpo-0.5b's 64 prompts x 8, prompt 256, 256 new tokens, a sync every 16
steps, blocks of 64, a pool that holds every sequence at full length, so nothing is preempted).

    python -m benchmarks.profiling.paged_host [--prompts 64] [--n 8] [--prompt-len 256] [--response-len 256]
    python -m benchmarks.profiling.paged_host --long-tail      # long_tail.py's batch, every sync's host work
    python -m benchmarks.profiling.paged_host --resumes        # multi-turn: a wave of resumes of every sequence

`--resumes` admits the batch, pauses every sequence at the end of its turn (`--response-len` tokens) and resumes
each after a 32-token observation, for 3 turns: `Scheduler.resume` per wave of resumes (the pool holds them all).

`--long-tail` replays the long-tail rollout's syncs instead (`benchmarks/long_tail.py`: 64 x 8, prompt 512, forced
lengths drawn log-normal, median 1,024, cap 8,192; blocks of 64, a pool of the benchmark's 23,595 blocks): at each
sync the device's progress as the engine would read it (every live sequence `steps` further), then the engine's host
work in its order: `record_progress`, the at-limit check, `Scheduler.harvest` (on token rows of zeros: no stop
token), the freeing of finished slots, `compaction_moves`, `reserve`, `admit`, `take_writes`, `steps_until_sync`,
`furthest_position`, `batch_size`. It prints ms per sync of each, and their sum over the call: host time the GPU waits
for at the syncs (the device reads and copies are not in it).

At each sync the host has just read the device's progress and the GPU waits until the next decode steps are
launched, so this time adds to the rollout's. The run replays the call's syncs: every sequence advances by a window,
then `reserve` grows its blocks. It prints the least over `--repeats` runs of: admitting every sequence, `reserve`
per sync and in all, and the block-table writes made.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from hybridrl.rollout.engine.blocks import BlockAllocator, blocks_for
from hybridrl.rollout.engine.scheduler import Scheduler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profiling.paged_host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long-tail", action="store_true", help="replay long_tail.py's batch (see above)")
    parser.add_argument("--resumes", action="store_true", help="time waves of multi-turn resumes (see above)")
    return parser.parse_args(argv)


def one_call(args) -> dict:
    """Admit the whole batch, then replay its syncs; host seconds of each part."""
    num_sequences = args.prompts * args.n
    columns = blocks_for(args.prompt_len, args.block_size)
    pool = 1 + args.prompts * columns + num_sequences * blocks_for(args.response_len, args.block_size)
    blocks = BlockAllocator(pool, args.block_size, columns)
    scheduler = Scheduler([i // args.n for i in range(num_sequences)], [args.prompt_len] * args.prompts,
                          num_sequences, blocks, args.sync_every, args.response_len)
    start = time.perf_counter()
    admitted = scheduler.admit()
    admit_s = time.perf_counter() - start
    assert len(admitted) == num_sequences, "the pool holds every sequence"
    writes, reserve_s, syncs = len(blocks.take_writes()), 0.0, 0
    for generated in range(1 + args.sync_every, args.response_len, args.sync_every):
        scheduler.record_progress([generated] * num_sequences)
        start = time.perf_counter()
        scheduler.reserve()
        reserve_s += time.perf_counter() - start
        writes += len(blocks.take_writes())
        syncs += 1
    return dict(admit_s=admit_s, reserve_s=reserve_s, syncs=syncs, writes=writes)


LONG_TAIL_POOL = 23595
"""Blocks of 64 the long-tail benchmark's budget holds on an H200 (its table in docs/benchmarks.md)."""


def long_tail_call(sync_every: int = 16, block_size: int = 64) -> dict:
    """Replay `benchmarks/long_tail.py`'s call on the host (see the module docstring): seconds per phase, syncs."""
    from benchmarks.long_tail import response_lengths

    prompts, n, prompt_len, cap = 64, 8, 512, 8192
    lengths = response_lengths(prompts * n, 1024, 1.0, 16, cap)
    blocks = BlockAllocator(LONG_TAIL_POOL, block_size, blocks_for(prompt_len, block_size))
    scheduler = Scheduler([i // n for i in range(prompts * n)], [prompt_len] * prompts, prompts * n, blocks,
                          sync_every, cap, lengths, limits_at_sync=True)
    phases: dict[str, float] = defaultdict(float)

    def timed(phase: str, function, *args):
        start = time.perf_counter()
        result = function(*args)
        phases[phase] += time.perf_counter() - start
        return result

    gen_len, done, syncs = np.zeros(prompts * n, dtype=np.int64), [0] * (prompts * n), 0
    tokens = np.zeros((prompts * n, cap), dtype=np.int64)
    while scheduler.has_work:
        timed("reserve", scheduler.reserve)
        for sequence in timed("admit", scheduler.admit):
            gen_len[sequence.slot] = sequence.generated
        timed("take_writes", blocks.take_writes)
        steps = timed("steps_until_sync", scheduler.steps_until_sync, sync_every, cap)
        timed("furthest_position", scheduler.furthest_position)
        batch = timed("batch_size", scheduler.batch_size)
        live = np.fromiter(scheduler.live, dtype=np.int64)
        gen_len[live] += steps  # the device: every live slot samples `steps` tokens
        syncs += 1
        rows = scheduler.rows_in_use()
        progress = gen_len[:rows].tolist()
        timed("record_progress", scheduler.record_progress, progress)
        at_limit = timed("at_limit", lambda: any(s.limit is not None and s.generated >= s.limit
                                                for s in scheduler.live.values()))
        if at_limit:
            finished = timed("harvest", scheduler.harvest, done, tokens, set(), None)
            for item in finished:
                gen_len[item.slot] = 0
        for source, destination in timed("compaction_moves", scheduler.compaction_moves):
            gen_len[destination], gen_len[source] = gen_len[source], 0
        assert batch >= rows
    return dict(phases=dict(phases), syncs=syncs)


def main_long_tail(args) -> None:
    calls = [long_tail_call(args.sync_every, args.block_size) for _ in range(args.repeats)]
    phases = {phase: min(call["phases"][phase] for call in calls) for phase in calls[0]["phases"]}
    syncs = calls[0]["syncs"]
    print(f"long-tail batch (64 x 8, prompt 512, forced lengths), a sync every {args.sync_every} steps, blocks of "
          f"{args.block_size}: {syncs} syncs; least of {args.repeats} calls, ms per sync (ms in all):")
    for phase, seconds in sorted(phases.items(), key=lambda item: -item[1]):
        print(f"  {phase:<18} {seconds * 1e3 / syncs:8.3f}  ({seconds * 1e3:8.1f})")
    total = sum(phases.values())
    print(f"  {'all':<18} {total * 1e3 / syncs:8.3f}  ({total * 1e3:8.1f})")


def resume_waves(args, turns: int = 3, observation: int = 32) -> list[float]:
    """Seconds of each wave of `Scheduler.resume` calls, one per sequence (see the module docstring)."""
    num_sequences = args.prompts * args.n
    columns = blocks_for(args.prompt_len, args.block_size)
    episode = turns * (args.response_len + observation)
    pool = 1 + args.prompts * columns + num_sequences * blocks_for(episode, args.block_size)
    scheduler = Scheduler([i // args.n for i in range(num_sequences)], [args.prompt_len] * args.prompts,
                          num_sequences, BlockAllocator(pool, args.block_size, columns), args.sync_every,
                          args.response_len)
    scheduler.admit()
    context, waves = args.prompt_len, []
    for _ in range(turns - 1):
        context += args.response_len + observation
        for slot in list(scheduler.live):
            scheduler.pause(slot)
        start = time.perf_counter()
        for slot in list(scheduler.paused):
            resumed, preempted = scheduler.resume(slot, context, args.response_len)
            assert resumed and not preempted, "the pool holds every episode"
        waves.append(time.perf_counter() - start)
    return waves


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.long_tail:
        main_long_tail(args)
        return
    if args.resumes:
        waves = min((resume_waves(args) for _ in range(args.repeats)), key=sum)
        print(f"{args.prompts} x {args.n} episodes, prompt {args.prompt_len}, turns of {args.response_len} tokens; "
              f"least of {args.repeats} calls: a wave of resumes " + ", ".join(f"{w * 1e3:.1f}" for w in waves) + " ms")
        return
    calls = [one_call(args) for _ in range(args.repeats)]
    best = {key: min(call[key] for call in calls) for key in ("admit_s", "reserve_s")}
    print(f"{args.prompts} x {args.n} sequences, prompt {args.prompt_len}, {args.response_len} new tokens, a sync "
          f"every {args.sync_every} steps, blocks of {args.block_size}; least of {args.repeats} calls:")
    print(f"  admit every sequence  {best['admit_s'] * 1e3:8.2f} ms")
    print(f"  reserve, per sync     {best['reserve_s'] * 1e3 / calls[0]['syncs']:8.2f} ms  ({calls[0]['syncs']} syncs)")
    print(f"  reserve, in all       {best['reserve_s'] * 1e3:8.2f} ms")
    print(f"  block-table writes    {calls[0]['writes']:8d}")


if __name__ == "__main__":
    main()
