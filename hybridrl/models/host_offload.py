"""Weights that wait in host memory between uses, so a colocated judge gives its device memory back to the actor
between reward calls.

Each parameter's and buffer's storage is freed in place (resized to zero bytes) and refilled from a host copy before
use. The module, its tied weights and every view of them stay the same tensor objects, so nothing that holds a
reference (a rollout engine, a tied head) has to be told. The weights are read-only here (a judge is never
trained): offloading writes nothing back, and refilling is one host-to-device copy per storage, from pinned memory
when CUDA is present.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage, for copying it as raw bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class HostOffload:
    """Keeps a host copy of `module`'s weights and frees or refills their device storage on request; starts
    offloaded. `on_device()` is the usual way in: the weights are on the device inside the block only."""

    def __init__(self, module: torch.nn.Module) -> None:
        unique: dict[int, torch.UntypedStorage] = {}  # tied weights share one storage: free and refill it once
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            storage = tensor.untyped_storage()
            unique.setdefault(storage.data_ptr(), storage)
        self.storages = list(unique.values())
        pin = torch.cuda.is_available()
        self.host = [torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin).copy_(_bytes_of(s))
                     for s in self.storages]
        self.offload()

    @property
    def device_bytes(self) -> int:
        """Bytes the weights hold on their device now (0 while offloaded)."""
        return sum(storage.nbytes() for storage in self.storages)

    def offload(self) -> None:
        for storage in self.storages:
            storage.resize_(0)

    def onload(self) -> None:
        for storage, host in zip(self.storages, self.host):
            if storage.nbytes() == 0:
                storage.resize_(host.numel())
                _bytes_of(storage).copy_(host, non_blocking=True)

    @contextmanager
    def on_device(self) -> Iterator[None]:
        self.onload()
        try:
            yield
        finally:
            if self.storages and self.storages[0].device.type == "cuda":
                torch.cuda.current_stream(self.storages[0].device).synchronize()  # work still reading them
            self.offload()
