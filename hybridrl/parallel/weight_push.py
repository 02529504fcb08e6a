"""Weight pushes from a training process to a rollout process, and batches back, through torch.distributed.

Split placement puts the rollout worker in a process (and on devices) of its own. After an update the trainer
broadcasts its weights to it in buckets: the tensors of a bucket are packed into one flat buffer of their dtype,
broadcast (NCCL on GPUs, gloo on CPUs), and copied on the receiving side straight into the worker model's own
tensors, the ones its rollout engine reads at every `generate`; so no second copy of the model is made there,
and a bucket of a few hundred MiB keeps the number of collectives small without a second full model in flight.
Both sides walk the same model structure in the same order (`push_tensors`), and tied weights travel once.

Batches go the other way as pickled objects (`send_object` / `receive_object`). A worker that died makes the
trainer's receive fail at once (the connection closes); one that hangs is caught by the watchdog, which names
its rank (`parallel/watchdog.py`). `RolloutPeerError` names the worker's rank either way.

Where: over torch.distributed's default group (`group=None`, or one made by `dist.new_group`), or over a `Link`:
two-rank groups of their own between the rollout process and one training process, made from a store on a port of
their own. A run with several training processes already uses the default group for its ranks (FSDP), and a
process has only one default group, so the link to the rollout worker is a group apart from it; the trainer's
other ranks never take part in it. Which backend a link uses follows from the two sides' devices (`push_backend`):
NCCL when they sit on different GPUs, so that a bucket goes from the trainer's GPU straight into the worker's,
never through the CPU; gloo otherwise, staged through the CPU: on the CPU, and on one GPU shared by both
processes, because NCCL refuses two ranks on one GPU. Pickled batches always travel over gloo.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.parallel import fsdp
from hybridrl.parallel.process_group import DistributedSetup

DEFAULT_BUCKET_BYTES = 256 * 2**20
"""Bytes per broadcast: large enough that the count of collectives does not matter, small next to a model."""


class RolloutPeerError(RuntimeError):
    """The other side of a split trainer/rollout run failed or went away; the message names its rank."""


class Link:
    """One two-rank group outside torch.distributed's default group (see the module docstring): `rank` is this
    side's (0 or 1). Build with `connect`."""

    def __init__(self, group: Any, rank: int, device: torch.device | None = torch.device("cpu")):
        self.group, self.rank = group, rank
        self.device = device
        """Where a bucket travels: the CPU over gloo, this side's GPU over NCCL (None: the tensors' own device)."""

    def close(self) -> None:
        """After the peer ended: abort an NCCL communicator, which also releases a side still blocked in a collective
        with it (gloo's calls fail by themselves once the peer is gone, and its group needs no ending)."""
        if self.device is not None and self.device.type == "cuda" and hasattr(self.group, "abort"):
            self.group.abort()

    def broadcast(self, tensor: torch.Tensor, source: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = source
        self.group.broadcast([tensor], options).wait()

    def send(self, tensor: torch.Tensor, destination: int) -> None:
        self.group.send([tensor], destination, 0).wait()

    def receive(self, tensor: torch.Tensor, source: int) -> None:
        self.group.recv([tensor], source, 0).wait()

    def barrier(self) -> None:
        self.group.barrier(dist.BarrierOptions()).wait()


class DefaultGroup(Link):
    """The same calls over torch.distributed's default group or a group of it (`group=None` everywhere here)."""

    def __init__(self, group: Any = None):
        super().__init__(group, dist.get_rank(group), device=None)

    def broadcast(self, tensor: torch.Tensor, source: int) -> None:
        dist.broadcast(tensor, src=source, group=self.group)

    def send(self, tensor: torch.Tensor, destination: int) -> None:
        dist.send(tensor, dst=destination, group=self.group)

    def receive(self, tensor: torch.Tensor, source: int) -> None:
        dist.recv(tensor, src=source, group=self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)


PUSH_BACKENDS = {
    "two GPUs": ("nccl", "the trainer and the rollout process sit on different GPUs: buckets go from GPU to GPU over "
                         "NCCL, with no CPU staging"),
    "one GPU": ("gloo", "the trainer and the rollout process share one GPU, and NCCL refuses two ranks on one GPU: "
                        "buckets are staged through the CPU over gloo"),
    "CPU": ("gloo", "the trainer or the rollout process runs on the CPU: buckets travel over gloo"),
}
"""Where the two sides sit -> (the weights link's backend, why); `push_backend` picks the row."""
NO_NCCL = ("gloo", "the GPUs differ, but this torch build has no NCCL: buckets are staged through the CPU over gloo")


def push_backend(trainer_device: torch.device, worker_device: torch.device,
                 nccl_available: bool = True) -> tuple[str, str]:
    """The backend of the weights link between the trainer's process and the rollout process, and a sentence on why
    (logged when the rollout process starts). CUDA devices carry their index (`cuda:1`, not `cuda`)."""
    if trainer_device.type != "cuda" or worker_device.type != "cuda":
        placement = "CPU"
    else:
        assert None not in (trainer_device.index, worker_device.index), "CUDA devices need their index here"
        placement = "one GPU" if trainer_device.index == worker_device.index else "two GPUs"
    backend, why = PUSH_BACKENDS[placement]
    return NO_NCCL if backend == "nccl" and not nccl_available else (backend, why)


def new_backend(backend: str, store: Any, rank: int, timeout: datetime.timedelta, device: torch.device,
                size: int = 2) -> Link:
    """One link of `backend` over `store` (two ranks; one in a test): NCCL's communicator is made now, on `device`
    (this side's GPU, made current first), so that a refusal shows when the run starts rather than at its first push."""
    if backend == "gloo":
        return Link(dist.ProcessGroupGloo(store, rank, size, timeout), rank)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(store, rank, size, options)
    group._set_sequence_number_for_group()  # as torch's own `new_group` does; both sides call it, through the store
    torch.cuda.set_device(device)
    if hasattr(group, "eager_connect_single_device"):
        group.eager_connect_single_device(device)
    return Link(group, rank, device)


def connect(port: int, rank: int, timeout_s: float, backends: dict[str, str],
            device: torch.device = torch.device("cpu")) -> dict[str, Link]:
    """Links between rank 0 (which hosts the store on `port` of 127.0.0.1) and rank 1, one per name of `backends`
    (name -> "gloo" or "nccl"), so that traffic on one (weights) never waits behind another's (batches); `device` is
    this side's GPU for an NCCL link."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
    return {name: new_backend(backend, dist.PrefixStore(name, store), rank, timeout, device)
            for name, backend in backends.items()}


def as_link(group: Any) -> Link:
    return group if isinstance(group, Link) else DefaultGroup(group)


def full_weights(model: torch.nn.Module, setup: DistributedSetup) -> dict[str, torch.Tensor] | None:
    """What a push sends: the model's whole `state_dict` on rank 0 (its own tensors with one process; gathered from
    the FSDP shards, on the CPU, with several, where every rank must call it), None on the other ranks."""
    return fsdp.full_state_dict(model, setup)


def unsharded_copy(model: torch.nn.Module, setup: DistributedSetup) -> torch.nn.Module | None:
    """A plain copy of `model` on rank 0 (None elsewhere; every rank must call it), for a rollout worker to own: a
    deep copy with one process; with several, the model's Hugging Face class built from its config and given
    the gathered weights (a deep copy of an FSDP model would be sharded too) and the model's own buffers (not
    sharded; non-persistent ones such as rotary frequencies are in no state_dict)."""
    weights = full_weights(model, setup)
    if not setup.is_distributed:
        return copy.deepcopy(model)
    if weights is None:
        return None
    from torch.distributed.fsdp import FSDPModule

    plain_class = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # FSDP2 subclasses it
    plain = plain_class(model.config)
    plain.load_state_dict(weights, assign=True)  # the gathered tensors themselves, dtypes kept
    if getattr(model.config, "tie_word_embeddings", False):
        plain.tie_weights()
    for name, buffer in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        plain.get_submodule(owner)._buffers[leaf] = buffer.detach().to("cpu", copy=True)
    return plain


def push_names(model: torch.nn.Module) -> list[str]:
    """The `state_dict` names of what a push moves, in order: parameters and buffers, each storage once (tied
    embeddings travel once)."""
    seen: set[tuple[int, int]] = set()
    names = []
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            names.append(name)
    return names


def push_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of `push_names`, the model's own (a receiver's push writes into them)."""
    state = model.state_dict()
    return [state[name] for name in push_names(model)]


def buckets(sizes_bytes: list[int], dtypes: list[Any], bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensor indices grouped into buckets of one dtype and at most `bucket_bytes` (a larger tensor
    travels alone)."""
    groups: list[list[int]] = []
    used = 0
    for index, (size, dtype) in enumerate(zip(sizes_bytes, dtypes)):
        if groups and dtypes[groups[-1][0]] == dtype and used + size <= bucket_bytes:
            groups[-1].append(index)
            used += size
        else:
            groups.append([index])
            used = size
    return groups


def push_weights(model: torch.nn.Module, source: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 group: Any = None) -> dict[str, float]:
    """Every rank of `group` calls this with the same model structure: rank `source` sends its tensors, the
    others receive them into their model's own tensors. Returns `perf/weight_push_s` and the GiB moved."""
    return broadcast_tensors(push_tensors(model), source, bucket_bytes, group)


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], source: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      group: Any = None) -> dict[str, float]:
    """`push_weights` over a list of tensors (the sender may pass a snapshot of its model's, in push order)."""
    start = time.perf_counter()
    link = as_link(group)
    sending = link.rank == source
    total, device = 0, tensors[0].device if tensors else torch.device("cpu")
    staging = link.device or device  # gloo stages on the CPU, NCCL on this side's GPU, the default group in place
    for indices in buckets([t.numel() * t.element_size() for t in tensors], [t.dtype for t in tensors], bucket_bytes):
        parts = [tensors[i] for i in indices]
        if sending:
            flat = torch.cat([part.reshape(-1).to(staging) for part in parts])
        else:
            flat = torch.empty(sum(part.numel() for part in parts), dtype=parts[0].dtype, device=staging)
        link.broadcast(flat, source)
        if not sending:
            offset = 0
            for part in parts:
                part.copy_(flat[offset:offset + part.numel()].view_as(part))
                offset += part.numel()
        total += flat.numel() * flat.element_size()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"perf/weight_push_s": time.perf_counter() - start, "perf/weight_push_gib": total / 2**30}


def weights_checksum(model: torch.nn.Module) -> str:
    """sha256 of every pushed tensor's bytes, in push order: equal on two ranks exactly when the weights are."""
    digest = hashlib.sha256()
    for tensor in push_tensors(model):
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def send_object(value: Any, destination: int, group: Any = None) -> None:
    """A picklable object (a scored batch) to rank `destination`: its length, then its bytes."""
    if not isinstance(group, Link):
        dist.send_object_list([value], dst=destination, group=group)
        return
    link = group
    payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    link.send(torch.tensor([payload.numel()], dtype=torch.long), destination)
    link.send(payload, destination)


def receive_object(source: int, what: str, group: Any = None) -> Any:
    """The next object rank `source` sends; a peer that died raises `RolloutPeerError` naming it and `what`."""
    box: list[Any] = [None]
    try:
        if not isinstance(group, Link):
            dist.recv_object_list(box, src=source, group=group)
            return box[0]
        size = torch.zeros(1, dtype=torch.long)
        group.receive(size, source)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        group.receive(payload, source)
    except RuntimeError as error:
        raise RolloutPeerError(f"the rollout worker (rank {source}) went away while the trainer waited for {what}: "
                               f"{error}; stopping the run") from error
    return pickle.loads(payload.numpy().tobytes())
