"""Where a rollout's GPU idle time goes: the engine (fused q/k/v and gate/up, RoPE in the attention kernel) on
the grpo-0.5b shape of `rollout.py`, timed with several `sync_every` values (decode steps between host checks
for finished sequences; while the host checks, the GPU waits), then one profiled run whose idle gaps between
kernels are summed by size and by the pair of kernels around them.

    python3 benchmarks/decode_gaps.py [--sync-every 16,64,256] [--response-len 256]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout import build_model, time_engine  # noqa: E402

from hybridrl.rollout.base import SamplingParams  # noqa: E402
from hybridrl.rollout.builtin import BuiltinBackend  # noqa: E402

GAP_BUCKETS_US = (1, 2, 5, 20, 100, float("inf"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--sync-every", default="16,64,256", help="values to time, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    return parser.parse_args()


def gap_report(kernels: list[tuple[float, float, str]], top: int = 12) -> None:
    """Idle time between consecutive kernels (sorted by start; overlaps count as no gap), in µs."""
    by_size = collections.Counter()
    count_by_size = collections.Counter()
    by_pair = collections.defaultdict(lambda: [0.0, 0])
    reach, previous = kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        gap = start - reach
        if gap > 0:
            bucket = next(b for b in GAP_BUCKETS_US if gap < b)
            by_size[bucket] += gap
            count_by_size[bucket] += 1
            pair = by_pair[(previous[:38], name[:38])]
            pair[0] += gap
            pair[1] += 1
        if end >= reach:
            reach, previous = end, name
    total = sum(by_size.values())
    print(f"idle between kernels: {total / 1e3:.1f} ms in {sum(count_by_size.values())} gaps")
    low = 0
    for bucket in GAP_BUCKETS_US:
        print(f"  gaps {low:>4}-{bucket:<4} us: {by_size[bucket] / 1e3:7.1f} ms in {count_by_size[bucket]:6d}")
        low = bucket
    print("  largest totals by the kernels before -> after the gap:")
    for (before, after), (gap, count) in sorted(by_pair.items(), key=lambda item: -item[1][0])[:top]:
        print(f"    {gap / 1e3:7.1f} ms {count:6d} x {gap / count:6.1f} us  {before:<38} -> {after}")


def host_work_in_gaps(kernels: list[tuple[float, float, str]], host: list[tuple[float, float, str]],
                      largest: int = 6, per_gap: int = 6) -> None:
    """For the largest idle gaps, the host operations running during them (the longest overlaps first)."""
    gaps, reach = [], kernels[0][1]
    for start, end, _ in kernels[1:]:
        if start > reach:
            gaps.append((start - reach, reach, start))
        reach = max(reach, end)
    for length, begin, end in sorted(gaps, reverse=True)[:largest]:
        overlaps = sorted(((min(e, end) - max(s, begin), name) for s, e, name in host if s < end and e > begin),
                          reverse=True)
        print(f"  gap of {length:,.0f} us: " + "; ".join(f"{name} {us:,.0f}" for us, name in overlaps[:per_gap]))


def profile_gaps(engine: BuiltinBackend, prompts, params) -> None:
    """Two profiled runs: GPU activity only for the gap sizes (tracing the CPU too stretches the gaps), then
    both, to name the host operations running during the largest gaps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def kernels_of(events):
        return sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CUDA)

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    gap_report(kernels_of(prof.events()))
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    events = prof.events()
    host = [(e.time_range.start, e.time_range.end, e.name[:50]) for e in events if e.device_type == DeviceType.CPU]
    print("host operations during the largest gaps of a run traced on the CPU too (us of overlap):")
    host_work_in_gaps(kernels_of(events), host)


def main() -> None:
    args = parse_args()
    model = build_model("cuda")
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (args.prompts, args.prompt_len), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=args.response_len, temperature=1.0, n=args.n, seed=0, ignore_eos=True)
    rows = []
    engine = None
    for sync_every in (int(value) for value in args.sync_every.split(",")):
        engine = BuiltinBackend(model, attention="triton", fuse_qkv=True, fuse_gate_up=True, sync_every=sync_every)
        result = time_engine(engine, prompts, params, args.repeats)
        rows.append((sync_every, result["seconds"], result["tokens_per_s"]))
        print(f"sync_every {sync_every}: {result['seconds']:.3f} s, {result['tokens_per_s']:,.0f} tok/s", flush=True)
        if sync_every == int(args.sync_every.split(",")[0]):
            profile_gaps(engine, prompts, params)
    print(f"\n{'sync_every':>10} {'seconds':>8} {'tok/s':>10}")
    for sync_every, seconds, tokens_per_s in rows:
        print(f"{sync_every:>10} {seconds:>8.3f} {tokens_per_s:>10,.0f}")


if __name__ == "__main__":
    main()
