"""The paged KV cache's scheduling work on the host, without a model: what `Scheduler.admit` and `Scheduler.reserve`
cost for one rollout call's batch (default: grpo-0.5b's 64 prompts x 8, prompt 256, 256 new tokens, a sync every 16
steps, blocks of 64, a pool that holds every sequence at full length, so nothing is preempted).

    python -m benchmarks.profiling.paged_host [--prompts 64] [--n 8] [--prompt-len 256] [--response-len 256]

At each sync the host has just read the device's progress and the GPU waits until the next decode steps are
launched, so this time adds to the rollout's. The run replays the call's syncs: every sequence advances by a window,
then `reserve` grows its blocks. It prints the least over `--repeats` runs of: admitting every sequence, `reserve`
per sync and in all, and the block-table writes made.
"""

from __future__ import annotations

import argparse
import time

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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
