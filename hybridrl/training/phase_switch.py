"""The hybrid engine's phase switch: one copy of the actor's weights serves training and generation.

Generation reads the parameters in place, so switching train -> generate moves no weights on one
device. What the switch does is release memory the next phase does not need: before rollout,
optionally move optimizer state to the CPU (`actor.offload_during_rollout`) and drop gradients;
after rollout, free the KV cache and bring optimizer state back. Both directions are timed and
logged as `perf/weight_sync_s`. Cached GPU memory goes back to the driver only when the device is
short of it (`devices.release_cached_memory`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

from hybridrl.devices import release_cached_memory


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of the optimizer's state (Adam moments, step counters) to `device`, except state
    that the optimizer itself keeps in CPU memory (`actor.optimizer_offload`), which stays there."""
    is_offloaded = getattr(optimizer, "is_offloaded", lambda param: False)
    for param, state in optimizer.state.items():
        if is_offloaded(param):
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != torch.device(device):
                state[key] = value.to(device, non_blocking=True)


@contextmanager
def rollout_phase(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                  offload_optimizer: bool, timings: dict[str, float]) -> Iterator[None]:
    """Memory layout for generation inside the block; training layout restored after.

    Adds the seconds spent switching (both directions) to `timings["weight_sync"]`. The allocator's cached
    blocks go back to the driver at a switch when the device is short of memory, so the phase after it (or
    another process) can use what the one before freed.
    """
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)  # gradients are dead between steps; free them for the KV cache
    if offload_optimizer and device.type == "cuda":
        move_optimizer_state(optimizer, "cpu")
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # offloaded to make room: the room goes back whatever is free
    timings["weight_sync"] = timings.get("weight_sync", 0.0) + time.perf_counter() - start
    try:
        yield
    finally:
        start = time.perf_counter()
        if device.type == "cuda":
            release_cached_memory(device)  # the KV cache of the rollout is gone; its blocks back if memory is short
            if offload_optimizer:
                move_optimizer_state(optimizer, device)
            torch.cuda.synchronize(device)
        timings["weight_sync"] += time.perf_counter() - start
