"""The process group: who this process is, starting and leaving the group, and the few collectives the
trainer calls directly.

One process is the special case: `init_from_env()` without `WORLD_SIZE` (or with 1) returns a setup of
world size 1 and starts nothing, and every helper in `parallel/` is then the identity (it returns its
input, often the very same object), so the trainer calls the same functions on a laptop and on a node.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hybridrl.parallel.watchdog import Watchdog, collective_timeout_s


@dataclass
class DistributedSetup:
    """Who this process is in the run; `mesh` is None with one process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    mesh: Any = None
    """The `DeviceMesh` FSDP2 shards over when world_size > 1: 1-D over all ranks, or 2-D (replicate, shard)
    when `trainer.fsdp_shard_size` is smaller than the world size."""
    watchdog: Any = None
    """The `launch.Watchdog` thread supervising the other ranks, if one was started."""

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, metrics and checkpoints."""
        return self.rank == 0


def init_from_env(device: torch.device | str = "auto", device_indices: Sequence[int] | None = None,
                  timeout_s: float = 600.0, hang_timeout_s: float | None = 900.0,
                  shard_size: int = 0) -> DistributedSetup:
    """Join the process group that torchrun or the Ray launcher described in the environment.

    `device_indices` are the CUDA devices of the actor's group (see `placement.py`); local rank i
    uses `device_indices[i]` (default: device i). `timeout_s` bounds the rendezvous and every
    collective; `hang_timeout_s` is how long any rank may go without a `heartbeat()` before the run
    is stopped with a message naming it (None disables the watchdog); the collective timeout is then
    raised above the watchdog's bounds (`watchdog.collective_timeout_s`), so the watchdog fires first.
    `shard_size` (0 = all ranks) is how many ranks share one copy of the weights: below the world size
    the mesh is 2-D (replicate x shard) and FSDP2 shards within groups of `shard_size` and replicates
    across them (HSDP); 1 replicates everything, like DDP (no weight gathers; gradients all-reduced).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = _resolve_device(device)
    if world_size <= 1:
        return DistributedSetup(device=device)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.type == "cuda":
        index = device_indices[local_rank] if device_indices else local_rank
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if hang_timeout_s:  # the watchdog (here, or the Ray driver's) must fire first: it names the rank that stopped
        timeout_s = collective_timeout_s(hang_timeout_s, at_least=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh

    if shard_size in (0, world_size):
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("data",))
    else:
        if shard_size < 0 or world_size % shard_size:
            raise ValueError(f"trainer.fsdp_shard_size={shard_size} must divide the number of processes ({world_size}); "
                             "use 0 (shard over all), 1 (replicate) or a divisor.")
        mesh = init_device_mesh(device.type, (world_size // shard_size, shard_size),
                                mesh_dim_names=("replicate", "shard"))
    setup = DistributedSetup(rank=rank, world_size=world_size, local_rank=local_rank, device=device, mesh=mesh)
    if hang_timeout_s and os.environ.get("HYBRIDRL_WATCHDOG", "1") != "0":  # 0: the Ray driver supervises
        setup.watchdog = Watchdog.from_env(rank, world_size, hang_timeout_s)
        setup.watchdog.start()
        atexit.register(setup.watchdog.stop)  # also when the run ends with an error: see `Watchdog.stop`
    return setup


def shutdown(setup: DistributedSetup) -> None:
    """Stop the watchdog (and wait for its thread: see `Watchdog.stop`) and leave the process group (a no-op
    with one process). Called at the end of a run that went well: the ranks first wait for each other (rank
    0 may still be saving the model), so none tears its connections down under a peer that still uses them."""
    if setup.watchdog is not None:
        setup.watchdog.stop()
    if setup.is_distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _resolve_device(device: torch.device | str) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def all_reduce(tensor: torch.Tensor, setup: DistributedSetup, op: str = "sum") -> torch.Tensor:
    """Sum (or mean, max) of `tensor` over ranks, in place; the identity with one process."""
    if not setup.is_distributed:
        return tensor
    reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    dist.all_reduce(tensor, op=reduce_op)
    if op == "mean":
        tensor /= setup.world_size
    return tensor


def reduce_metrics(metrics: dict[str, Any], setup: DistributedSetup, sum_keys: Sequence[str] = ()) -> dict[str, float]:
    """Average each metric over ranks in one collective; keys in `sum_keys` are summed instead (a loss
    whose per-rank parts are already normalised by global counts). Every rank must pass the same keys."""
    if not setup.is_distributed:
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[key]) for key in keys], dtype=torch.float64, device=setup.device)
    all_reduce(values, setup)
    return {key: value if key in sum_keys else value / setup.world_size for key, value in zip(keys, values.tolist())}


def barrier(setup: DistributedSetup) -> None:
    """Wait for every rank; nothing with one process."""
    if setup.is_distributed:
        dist.barrier()


def broadcast_object(value: Any, setup: DistributedSetup, source: int = 0) -> Any:
    """`value` from rank `source` on every rank (e.g. a decision only rank 0 can make)."""
    if not setup.is_distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=source)
    return box[0]
