"""Host-to-device copies that do not stall the GPU: the one helper every layer that stages small index
tensors (rollout engine, packing, optimizer) shares."""

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
