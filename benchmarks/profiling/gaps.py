"""GPU idle time from a torch profile: the gaps between consecutive GPU activities (kernels and copies) summed
by size and by the pair of activities around them, and the host operations running during the largest gaps.
Shared by `decode_gaps.py` (a rollout) and `grpo_step.py --gaps` (a training update). Profile with GPU activity
only for the gap sizes: tracing the CPU too stretches them."""

from __future__ import annotations

import collections

GAP_BUCKETS_US = (1, 2, 5, 20, 100, float("inf"))


def gap_report(kernels: list[tuple[float, float, str]], top: int = 12) -> None:
    """Idle time between consecutive kernels (sorted by start; overlaps count as no gap), in µs."""
    if not kernels:
        print("idle between kernels: no GPU activity recorded")
        return
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


def kernel_table(kernels: list[tuple[float, float, str]], per: int = 1, top: int = 30) -> None:
    """GPU time by kernel name (the first 70 characters), largest first: total ms, count, and µs per `per` units
    (e.g. per decode step)."""
    totals, counts = collections.Counter(), collections.Counter()
    for start, end, name in kernels:
        totals[name[:70]] += end - start
        counts[name[:70]] += 1
    print(f"GPU time by kernel ({sum(totals.values()) / 1e3:.1f} ms in all; us per unit: of {per}):")
    for name, total in totals.most_common(top):
        print(f"  {total / 1e3:8.2f} ms {counts[name]:7d} x {total / counts[name]:7.2f} us {total / per:8.1f} us/unit  {name}")


def host_work_in_gaps(kernels: list[tuple[float, float, str]], host: list[tuple[float, float, str]],
                      largest: int = 6, per_gap: int = 6) -> None:
    """For the largest idle gaps, the host operations running during them (the longest overlaps first)."""
    if not kernels:
        return
    gaps, reach = [], kernels[0][1]
    for start, end, _ in kernels[1:]:
        if start > reach:
            gaps.append((start - reach, reach, start))
        reach = max(reach, end)
    for length, begin, end in sorted(gaps, reverse=True)[:largest]:
        overlaps = sorted(((min(e, end) - max(s, begin), name) for s, e, name in host if s < end and e > begin),
                          reverse=True)
        print(f"  gap of {length:,.0f} us: " + "; ".join(f"{name} {us:,.0f}" for us, name in overlaps[:per_gap]))


def cuda_events(prof) -> tuple[list[tuple[float, float, str]], list[tuple[float, float, str]]]:
    """(GPU activities, host operations) of a finished profile as sorted (start us, end us, name) triples."""
    from torch.autograd import DeviceType

    events = prof.events()
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CUDA)
    host = [(e.time_range.start, e.time_range.end, e.name[:50]) for e in events if e.device_type == DeviceType.CPU]
    return gpu, host
