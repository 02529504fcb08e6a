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
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 * 2**20
"""Bytes per broadcast: large enough that the count of collectives does not matter, small next to a model."""


class RolloutPeerError(RuntimeError):
    """The other side of a split trainer/rollout run failed or went away; the message names its rank."""


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
    sending = dist.get_rank() == source
    total, device = 0, tensors[0].device if tensors else torch.device("cpu")
    for indices in buckets([t.numel() * t.element_size() for t in tensors], [t.dtype for t in tensors], bucket_bytes):
        parts = [tensors[i] for i in indices]
        if sending:
            flat = torch.cat([part.reshape(-1) for part in parts])
        else:
            flat = torch.empty(sum(part.numel() for part in parts), dtype=parts[0].dtype, device=parts[0].device)
        dist.broadcast(flat, src=source, group=group)
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
    """A picklable object (a scored batch) to rank `destination`."""
    dist.send_object_list([value], dst=destination, group=group)


def receive_object(source: int, what: str, group: Any = None) -> Any:
    """The next object rank `source` sends; a peer that died raises `RolloutPeerError` naming it and `what`."""
    box = [None]
    try:
        dist.recv_object_list(box, src=source, group=group)
    except RuntimeError as error:
        raise RolloutPeerError(f"the rollout worker (rank {source}) went away while the trainer waited for {what}: "
                               f"{error}; stopping the run") from error
    return box[0]
