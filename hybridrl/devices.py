"""Host-to-device copies that do not stall the GPU: the one helper every layer that stages small index
tensors (rollout engine, packing, optimizer) shares; and when a phase switch hands cached GPU memory back."""

from __future__ import annotations

import torch


def host_to_device(values: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor (indices, layouts) on `device` without waiting for the device: through pinned memory,
    non-blocking. A plain `.to("cuda")` from pageable memory synchronizes the stream, and every such wait
    leaves the GPU idle while the host queues the next kernels (a packed micro-batch stages several)."""
    device = torch.device(device)
    if device.type != "cuda" or values.device.type != "cpu":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)  # the pinned block is kept until the copy is done


SPARE_MEMORY_SHARE = 0.25
"""`release_cached_memory` hands the allocator's unused blocks back only when less than this share of the device is
free to the driver without them."""


def release_cached_memory(device: torch.device | str) -> bool:
    """At a switch between phases (rollout, training), hand the caching allocator's unused blocks back to the driver
    (`torch.cuda.empty_cache`) when the device is short of memory; returns whether it did. With room to spare they
    stay: handed back, the next phase takes each segment again with a cudaMalloc, host time that short steps notice
    (docs/benchmarks.md, the update at short sequences), while kept, another process still finds a quarter of the
    device free, and this one, should it run short, has the allocator free them and retry before failing."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    if free >= SPARE_MEMORY_SHARE * total:
        return False
    torch.cuda.empty_cache()
    return True
