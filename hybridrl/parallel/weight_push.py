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


def push_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers in `state_dict` order, each storage once (tied embeddings)."""
    seen: set[tuple[int, int]] = set()
    tensors = []
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            tensors.append(tensor)
    return tensors


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


@torch.no_grad()
def push_weights(model: torch.nn.Module, source: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 group: Any = None) -> dict[str, float]:
    """Every rank of `group` calls this with the same model structure: rank `source` sends its tensors, the
    others receive them into their model's own tensors. Returns `perf/weight_push_s` and the bytes moved."""
    start = time.perf_counter()
    tensors = push_tensors(model)
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
