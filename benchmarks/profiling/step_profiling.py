"""Where a `grpo_step.py` step's time and memory go: a profiled step (top kernels, host operations, idle gaps,
a Chrome trace), a profiled update's gap report (`gaps.py`), counters of what makes a step slower than the
next, and the GPU memory still held after several steps."""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from pathlib import Path

from benchmarks.profiling.gaps import cuda_events, gap_report, host_work_in_gaps


def update_with_gap_report(update, name: str, with_host: bool):
    """`trainer.update` profiled once: where its GPU idle time goes (`gaps.py`), by gap size and by the GPU
    activities around each gap; `with_host` also traces the CPU, which stretches the gaps but names the host
    operations running during the largest ones."""
    from torch.profiler import ProfilerActivity, profile

    def traced(batch):
        import torch

        gpu = torch.cuda.is_available()  # without one (the CPU test) the profile records host work only
        activities = ([ProfilerActivity.CUDA] if gpu else []) + ([ProfilerActivity.CPU] if with_host or not gpu else [])
        with profile(activities=activities) as prof:
            metrics = update(batch)
            if gpu:
                torch.cuda.synchronize()
        gpu, host = cuda_events(prof)
        if with_host:
            print(f"{name}: host operations during the update's largest GPU gaps (us of overlap, CPU traced too):")
            host_work_in_gaps(gpu, host)
        else:
            print(f"{name}: the update's GPU idle time (GPU activity only):")
            gap_report(gpu)
        return metrics

    return traced


_GC_MS = {"total": 0.0, "started": None}


def _time_full_collections(phase: str, info: dict) -> None:
    if info.get("generation") != 2:
        return
    if phase == "start":
        _GC_MS["started"] = time.perf_counter()
    elif _GC_MS["started"] is not None:
        _GC_MS["total"] += 1e3 * (time.perf_counter() - _GC_MS["started"])
        _GC_MS["started"] = None


def warm_up_counters(device: str) -> dict:
    """Totals so far of what makes a step slower than the next: frames compiled by dynamo (a recompile adds
    one), cudaMalloc retries (the caching allocator freeing its cache to satisfy a request), cudaMalloc calls
    (segments the allocator took from the driver: a step that still grows the cache pays for them) and
    milliseconds in Python's full (generation 2) garbage collections, which stop the host wherever they happen."""
    import torch

    if _time_full_collections not in gc.callbacks:
        gc.callbacks.append(_time_full_collections)
    counters = {"diag/compiled_frames": float(torch._dynamo.utils.counters["frames"]["ok"]),
                "diag/gc_full_ms": round(_GC_MS["total"], 1)}
    if device == "cuda":
        stats = torch.cuda.memory_stats()
        counters["diag/alloc_retries"] = float(stats.get("num_alloc_retries", 0))
        counters["diag/cuda_mallocs"] = float(stats.get("segment.all.allocated", 0))
    return counters


@contextlib.contextmanager
def profiled(name: str, top: int = 25):
    """Profile the enclosed step (the last one; it is then not a clean timing) and print its top CUDA kernels."""
    from torch.profiler import ProfilerActivity, profile

    # Operator shapes too: `trace_report.py` turns them into each matrix product's achieved TFLOP/s.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        yield
    print(f"{name}: top kernels of the profiled step (self CUDA time)")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=70))
    print(f"{name}: top operators of the profiled step (self CPU time; a host-bound phase shows up here)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    print_gpu_idle(prof, name)
    if os.environ.get("OUT") and os.environ.get("RANK", "0") in ("0", ""):
        save_trace(prof, Path(os.environ["OUT"]) / f"trace_{name.replace(' ', '_')}.json.gz")


def save_trace(prof, path: Path) -> None:
    """The profiled step as a gzipped Chrome trace (chrome://tracing, Perfetto), with Python call stacks off:
    a few MB that come back from a device call, so where the GPU waits can be read later without the GPU."""
    import gzip

    with tempfile.NamedTemporaryFile(suffix=".json") as raw:
        prof.export_chrome_trace(raw.name)
        with open(raw.name, "rb") as source, gzip.open(path, "wb") as target:
            target.write(source.read())
    print(f"trace of the profiled step: {path} ({path.stat().st_size / 2**20:.1f} MiB)", flush=True)


def print_gpu_idle(prof, name: str, top: int = 8) -> None:
    """Per phase of the profiled step: wall time, time some kernel was running, kernel count, and the
    longest idle gaps with the kernels around them: where the host, not the GPU, sets the pace."""
    from torch.autograd import DeviceType

    events = prof.events()
    annotations = {e.name for e in events if getattr(e, "is_user_annotation", False) or e.name.startswith("phase:")}
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA and e.name not in annotations
                     and not e.name.startswith(("Optimizer.", "ProfilerStep", "Memcpy")))
    copies = [(e.time_range.start, e.time_range.end) for e in events
              if e.device_type == DeviceType.CUDA and e.name.startswith("Memcpy")]
    phases = [(e.name, e.time_range.start, e.time_range.end) for e in events
              if e.name.startswith("phase:") and e.device_type == DeviceType.CPU]
    host_ops = [(e.time_range.start, e.time_range.end, e.name) for e in events
                if e.device_type == DeviceType.CPU and not e.name.startswith(("phase:", "ProfilerStep"))]
    for phase, start, end in sorted(phases, key=lambda p: p[1]):
        inside = [k for k in kernels if start <= k[0] < end]
        busy, gaps, reach = 0.0, [], start
        for k_start, k_end, k_name in inside:
            if k_start > reach:
                gaps.append((k_start - reach, k_name, reach))
            busy += max(0.0, k_end - max(k_start, reach))
            reach = max(reach, k_end)
        copied = sum(c_end - c_start for c_start, c_end in copies if start <= c_start < end)
        print(f"{name} {phase}: wall {(end - start) / 1e3:.1f} ms, kernels running {busy / 1e3:.1f} ms "
              f"({len(inside)} kernels; memcpy {copied / 1e3:.1f} ms), "
              f"idle gaps > 50 us: {sum(g for g, *_ in gaps if g > 50) / 1e3:.1f} ms in {sum(g > 50 for g, *_ in gaps)}")
        for gap, before, gap_start in sorted(gaps, reverse=True)[:top]:
            print(f"    gap {gap / 1e3:8.2f} ms before {before[:90]}")
            print(f"        host meanwhile: {host_during(host_ops, gap_start, gap_start + gap)}")


def host_during(host_ops: list[tuple[float, float, str]], start: float, end: float, top: int = 4) -> str:
    """The host operations that overlap [start, end) the most (time inside the interval, nested ones
    included): what the CPU was doing while the GPU sat idle."""
    overlap: dict[str, float] = {}
    for op_start, op_end, name in host_ops:
        inside = min(op_end, end) - max(op_start, start)
        if inside > 0:
            overlap[name] = overlap.get(name, 0.0) + inside
    ranked = sorted(overlap.items(), key=lambda item: -item[1])[:top]
    return ", ".join(f"{name[:50]} {us / 1e3:.1f} ms" for name, us in ranked) or "nothing traced"


def live_blocks() -> dict[int, int]:
    """Address -> size of every allocated block of PyTorch's CUDA allocator."""
    import torch

    blocks = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                blocks[address] = block["size"]
            address += block["size"]
    return blocks


def print_memory_growth(name: str, before: dict[int, int], after: dict[int, int], steps: int, top: int = 12) -> None:
    """Blocks allocated after `before` and still held at `after` (a steady run holds nothing new), each with
    the Python tensors that point into it and what refers to those: where memory that grows every step lives.
    Blocks no Python tensor reaches are held by C++ (autograd graphs, compiled-code caches, CUDA graphs)."""
    import gc

    import torch

    new = {address: size for address, size in after.items() if before.get(address) != size}
    total = sum(new.values())
    print(f"{name}: {total / 2**20:.1f} MiB in {len(new)} blocks allocated over {steps} steps and still held "
          f"({total / 2**20 / max(steps, 1):.1f} MiB per step)")
    owners: dict[int, list] = {}
    starts = sorted(new)
    for obj in gc.get_objects():
        try:
            if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
                continue
            pointer = obj.untyped_storage().data_ptr()
        except Exception:  # fake, meta or otherwise storage-less tensors
            continue
        for address in starts:
            if address <= pointer < address + new[address]:
                owners.setdefault(address, []).append(obj)
                break
    ours = {id(found) for found in owners.values()}
    for address, size in sorted(new.items(), key=lambda item: -item[1])[:top]:
        tensors = owners.get(address, [])
        described = "; ".join(
            f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} held by "
            + ", ".join(sorted({type(r).__name__ + (f"[{next((k for k, v in r.items() if v is t), '?')}]"
                                                    if isinstance(r, dict) else "")
                                for r in gc.get_referrers(t) if id(r) not in ours})[:4])
            for t in tensors[:3]) or "no Python tensor (held by C++)"
        print(f"    {size / 2**20:8.2f} MiB  {described}")
