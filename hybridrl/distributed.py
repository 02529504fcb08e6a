"""Data parallelism applied from outside the model: process group, FSDP2 sharding, batch splitting.

One process is the special case: `init_from_env()` without `WORLD_SIZE` (or with 1) returns a setup of
world size 1 and starts nothing, and every helper here is then the identity (it returns its input,
often the very same object), so the trainer calls the same functions on a laptop and on a node.

Choices:
- FSDP2 (`fully_shard`) per decoder layer, then the root (embeddings, final norm, LM head, tied or
  not). Works for NCCL on GPU and for gloo on CPU (the CPU tests run it with two gloo processes).
- Gradients are *summed* across ranks, not averaged: every rank keeps the whole (small) rollout batch,
  so the loss normalisers (`num_tokens` of the mini-batch and the like) are already global, and each
  rank's loss over its rows is its exact share of the one-process loss. With gloo and NCCL alike this
  is a plain SUM reduce-scatter (no PreMulSum).
- Rollout (hybrid engine): `gather_for_rollout` all-gathers each layer once, keeps the full weights
  while the rank generates for its share of prompts (no collective inside a forward, so ranks may
  decode different numbers of steps), and frees them afterwards. One full copy plus the shard, never two.
- Work is split by rows balanced on token counts, with the same number of rows on every rank, so every
  rank runs the same number of forward/backward passes (FSDP collectives must line up).
- `heartbeat()` counts progress; `launch.Watchdog` turns a rank whose count stops into an error that
  names the rank.
"""

from __future__ import annotations

import atexit

import dataclasses
import datetime
import functools
import heapq
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn


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


# ----------------------------------------------------------------------------------------------
# Process group


def init_from_env(device: torch.device | str = "auto", device_indices: Sequence[int] | None = None,
                  timeout_s: float = 600.0, hang_timeout_s: float | None = 900.0,
                  shard_size: int = 0) -> DistributedSetup:
    """Join the process group that torchrun or the Ray launcher described in the environment.

    `device_indices` are the CUDA devices of the actor's group (see `placement.py`); local rank i
    uses `device_indices[i]` (default: device i). `timeout_s` bounds the rendezvous and every
    collective; `hang_timeout_s` is how long any rank may go without a `heartbeat()` before the run
    is stopped with a message naming it (None disables the watchdog). `shard_size` (0 = all ranks)
    is how many ranks share one copy of the weights: below the world size the mesh is 2-D
    (replicate x shard) and FSDP2 shards within groups of `shard_size` and replicates across them
    (HSDP); 1 replicates everything, like DDP (no weight gathers; gradients all-reduced).
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
    if hang_timeout_s and os.environ.get("HYBRIDRL_WATCHDOG", "1") != "0":
        from hybridrl.launch import Watchdog

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


_progress = 0
_training_thread: int | None = None


def heartbeat() -> None:
    """Mark progress (the trainer calls it at every phase); the watchdog stops runs whose ranks stop beating."""
    global _progress, _training_thread
    _progress += 1
    _training_thread = threading.get_ident()


def progress() -> int:
    return _progress


def waiting_in_collective() -> bool:
    """Whether the thread that last called `heartbeat()` is inside torch.distributed code right now (waiting
    for other ranks), as opposed to computing: how the watchdog tells the rank that hangs from those it holds up."""
    frame = sys._current_frames().get(_training_thread) if _training_thread is not None else None
    while frame is not None:
        if _DISTRIBUTED_CODE in frame.f_code.co_filename.replace(os.sep, "/"):
            return True
        frame = frame.f_back
    return False


_DISTRIBUTED_CODE = "/torch/distributed/"


# ----------------------------------------------------------------------------------------------
# Sharding models


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face model: modules whose class is named in `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    # FSDP2 swaps a sharded module's class for a subclass named FSDP<Name>, so match the whole MRO
    return [module for module in model.modules() if any(cls.__name__ in names for cls in type(module).__mro__)]


def parallelize(model: nn.Module, setup: DistributedSetup, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = torch.float32) -> nn.Module:
    """Shard `model` with FSDP2 across all ranks: each decoder layer, then the root. Returns `model`.

    `param_dtype` (e.g. bfloat16 with float32 parameters) casts weights after the all-gather for
    compute; gradients are reduced in `reduce_dtype`. Build critics and reference copies *before*
    calling this (a deep copy of a sharded model is sharded too).
    """
    if not setup.is_distributed:
        return model
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"cannot shard {type(model).__name__}: no decoder layers found (no module class is "
                         "listed in a `_no_split_modules` attribute); FSDP needs a Hugging Face-style model.")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype if param_dtype else None)
    for layer in layers:
        fully_shard(layer, mesh=setup.mesh, mp_policy=policy, reshard_after_forward=True)
    # A peft model's generate() and forward() both end in the wrapped *ForCausalLM, skipping the PeftModel's
    # own forward; FSDP2 needs its root's forward to run first, so the wrapped model is the root.
    root = model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model
    fully_shard(root, mesh=setup.mesh, mp_policy=policy)
    if hasattr(root, "get_decoder"):
        # logprobs.py runs the decoder and applies the LM head itself (chunked), bypassing the root's
        # forward; registering that call as a forward gathers the root's parameters (embeddings, final
        # norm, head) for it, and the root's gradients are reduced after backward as usual. The method
        # takes the input tensors: FSDP2's root pre-forward on CUDA (torch 2.11) indexes its positional
        # arguments, so registering the argument-less `get_decoder` failed there (seen on 2 x H200).
        from hybridrl.logprobs import decoder_hidden_states

        root.fsdp_hidden_states = functools.partial(decoder_hidden_states, root)
        register_fsdp_forward_method(root, "fsdp_hidden_states")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: losses are normalised by global counts
            module.set_force_sum_reduction_for_comms(True)  # plain SUM, which gloo supports too
    return model


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    if not dist.is_initialized():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


@dataclass
class WeightSync:
    seconds: float = 0.0
    """Wall time of the all-gather before the rollout (`perf/weight_sync_s`)."""


@contextmanager
def gather_for_rollout(model: nn.Module) -> Iterator[WeightSync]:
    """Full weights for generation inside the block, sharded again (and freed) after it.

    Inside, `model`'s parameters are plain tensors, so the built-in engine can read them and HF
    `generate` runs its forwards without collectives. A model that is not sharded passes through.
    """
    sync = WeightSync()
    modules = _fsdp_modules(model)
    if not modules:
        yield sync
        return
    start = time.perf_counter()
    for module in modules[1:]:  # modules[0] is the root, which never reshards after forward
        module.set_reshard_after_forward(False, recurse=False)
    handles = [module.unshard(async_op=True) for module in modules]
    for handle in handles:
        handle.wait()
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    sync.seconds = time.perf_counter() - start
    # HF `generate` sees this flag and syncs every decode step across ranks (`synced_gpus`), which
    # hangs when ranks generate different lengths; with the weights gathered no sync is needed. The flag
    # sits on the FSDP root, which for a peft model is the wrapped model that `generate` runs on.
    flagged = [module for module in model.modules() if "_is_fsdp_managed_module" in module.__dict__] or [model]
    managed = [module.__dict__.get("_is_fsdp_managed_module") for module in flagged]
    for module in flagged:
        module._is_fsdp_managed_module = False
    try:
        yield sync
    finally:
        for module, value in zip(flagged, managed):
            module._is_fsdp_managed_module = value
        for module in modules:
            module.reshard()
        for module in modules[1:]:
            module.set_reshard_after_forward(True, recurse=False)


@contextmanager
def gathered_for_micro_batches(model: nn.Module | None, enabled: bool = True) -> Iterator[None]:
    """Inside the block, an FSDP2 model's weights are all-gathered at the first forward and kept for
    every later micro-batch (forward, recompute and backward), then freed at the end.

    FSDP2's default gathers every layer's weights again in each micro-batch's forward, in the
    recompute of gradient checkpointing and in backward: three all-gathers of the whole model per
    micro-batch. Keeping them costs one full copy of the weights per GPU for the phase (2 bytes per
    parameter in bf16), which a colocated rollout needs anyway. No-op without FSDP or when disabled
    (`trainer.fsdp_reshard_every_micro_batch=true`)."""
    modules = _fsdp_modules(model) if model is not None and enabled else []
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_backward(True, recurse=False)
            if module is not modules[0]:  # the root never reshards after forward (its default)
                module.set_reshard_after_forward(True, recurse=False)


def sync_gradients(model: nn.Module, last_micro_batch: bool, enabled: bool = True) -> None:
    """FSDP2 gradient accumulation: reduce-scatter once, in the backward of a mini-batch's last micro-batch.

    The micro-batches before it accumulate full (unsharded) gradients locally, which costs one full
    gradient copy per GPU instead of one reduce-scatter of the whole model per micro-batch."""
    if not enabled:
        return
    for module in _fsdp_modules(model)[:1]:  # the root; recurse sets every sharded submodule
        module.set_requires_gradient_sync(last_micro_batch)


# ----------------------------------------------------------------------------------------------
# Splitting work across ranks


def balanced_partition(costs: Sequence[int | float], num_parts: int) -> list[list[int]]:
    """Positions 0..len(costs)-1 in `num_parts` groups whose sizes differ by at most one and whose cost
    sums are balanced (longest first, each to the cheapest group that still has room); each group sorted."""
    count = len(costs)
    capacity = [count // num_parts + (part < count % num_parts) for part in range(num_parts)]
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0.0, part) for part in range(num_parts)]  # (cost so far, part) of parts with room
    order = sorted(range(count), key=lambda i: (-costs[i], i))
    for position in order:
        total, part = heapq.heappop(heap)
        parts[part].append(position)
        if len(parts[part]) < capacity[part]:
            heapq.heappush(heap, (total + float(costs[position]), part))
    return [sorted(part) for part in parts]


def shard_rows(rows: torch.Tensor, num_tokens: torch.Tensor, setup: DistributedSetup) -> torch.Tensor:
    """This rank's share of `rows` (indices into a batch), balanced by `num_tokens[rows]`.

    Every rank gets len(rows) / world_size rows (required to divide: FSDP needs the same number of
    forward passes on every rank). With one process, `rows` itself is returned.
    """
    if not setup.is_distributed:
        return rows
    if len(rows) % setup.world_size:
        raise ValueError(f"{len(rows)} sequences cannot be split evenly over {setup.world_size} ranks; make the "
                         "rollout batch and actor.mini_batch_size multiples of trainer.num_gpus.")
    costs = num_tokens[rows.to(num_tokens.device)].tolist()
    mine = balanced_partition(costs, setup.world_size)[setup.rank]
    return rows[torch.tensor(mine, dtype=torch.long, device=rows.device)]


def shard_batch(batch: Any, setup: DistributedSetup) -> Any:
    """This rank's rows of a `RolloutBatch`, balanced by tokens (prompt + response) per row."""
    if not setup.is_distributed:
        return batch
    return batch.select(shard_rows(torch.arange(len(batch)), batch.attention_mask.sum(1), setup))


def shard_micro_batches(micro_batches: list[torch.Tensor], num_tokens: torch.Tensor,
                        setup: DistributedSetup) -> list[torch.Tensor]:
    """This rank's micro-batches of one mini-batch (given as the one-process micro-batches): the
    mini-batch's rows balanced by `num_tokens` across ranks, cut to the same micro-batch size."""
    if not setup.is_distributed:
        return micro_batches
    return list(shard_rows(torch.cat(micro_batches), num_tokens, setup).split(len(micro_batches[0])))


def match_micro_batch_count(micro_batches: list[torch.Tensor], setup: DistributedSetup) -> list[torch.Tensor]:
    """Split this rank's largest micro-batches until every rank has as many as the rank with the most
    (token-budget grouping may give ranks different counts; FSDP needs equal forward/backward counts).
    Splitting only shrinks micro-batches, so a token budget still holds."""
    if not setup.is_distributed:
        return micro_batches
    count = torch.tensor([len(micro_batches)], device=setup.device)
    target = int(all_reduce(count, setup, op="max").item())
    micro_batches = list(micro_batches)
    while len(micro_batches) < target:
        largest = max(range(len(micro_batches)), key=lambda i: len(micro_batches[i]))
        if len(micro_batches[largest]) < 2:
            raise AssertionError("ranks hold equal row counts, so a split is always possible")
        half = len(micro_batches[largest]) // 2
        micro_batches[largest:largest + 1] = [micro_batches[largest][:half], micro_batches[largest][half:]]
    return micro_batches


def gather_rows(values: torch.Tensor, rows: torch.Tensor, num_rows: int, setup: DistributedSetup) -> torch.Tensor:
    """Reassemble a (num_rows, ...) tensor from every rank's `values` for its `rows` (from `shard_rows`)."""
    if not setup.is_distributed:
        return values
    rows = rows.to(values.device)
    all_values = [torch.empty_like(values) for _ in range(setup.world_size)]
    all_rows = [torch.empty_like(rows) for _ in range(setup.world_size)]
    dist.all_gather(all_values, values.contiguous())
    dist.all_gather(all_rows, rows.contiguous())
    full = values.new_empty((num_rows, *values.shape[1:]))
    full[torch.cat(all_rows)] = torch.cat(all_values)
    return full


def generate_sharded(backend: Any, prompts: list[list[int]], params: Any, setup: DistributedSetup,
                     decode: Callable[[list[Any]], list[str]] | None = None) -> list[Any]:
    """Each rank samples for a contiguous share of `prompts`; every rank returns all generations,
    prompt-major with global `prompt_index`, as `backend.generate(prompts, params)` would.
    `decode(generations) -> texts`: each rank decodes its own share into `Generation.text` before the
    gather, so no rank decodes the whole batch (the tokenizer's time then shrinks with the ranks too).

    Ranks draw from different seeds (seed + rank), so a multi-rank rollout is a different sample
    from a one-process rollout with the same seed, not the same one.
    """
    def with_texts(generations: list[Any]) -> list[Any]:
        if decode is not None and generations:
            for generation, text in zip(generations, decode(generations), strict=True):
                generation.text = text
        return generations

    if not setup.is_distributed:
        return with_texts(backend.generate(prompts, params))
    bounds = [len(prompts) * r // setup.world_size for r in range(setup.world_size + 1)]
    start, stop = bounds[setup.rank], bounds[setup.rank + 1]
    seed = None if params.seed is None else params.seed + 1_000_003 * setup.rank
    local = with_texts(backend.generate(prompts[start:stop], dataclasses.replace(params, seed=seed))
                       if stop > start else [])
    for generation in local:
        generation.prompt_index += start
    gathered: list[Any] = [None] * setup.world_size
    dist.all_gather_object(gathered, local)
    return [generation for part in gathered for generation in part]


def score_sharded(score: Any, prompts: list[str], completions: list[str], columns: dict[str, list], group_size: int,
                  setup: DistributedSetup) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """`score(prompts, completions, columns, first_index)` (a `RewardSet.score`) over the batch, each rank
    scoring a contiguous share of whole groups of `group_size` (the samples of one prompt stay together);
    every rank returns the whole batch's scores. A reward error on any rank is raised on every rank, so
    no process waits for one that failed."""
    from hybridrl.rewards import RewardError

    if not setup.is_distributed:
        return score(prompts, completions, columns)
    groups, world = len(completions) // group_size, setup.world_size
    start, stop = (groups * r // world * group_size for r in (setup.rank, setup.rank + 1))
    if setup.rank == world - 1:
        stop = len(completions)  # a partial last group (not made by the trainer) stays with the last rank
    try:
        if stop > start:
            total, per_function = score(prompts[start:stop], completions[start:stop],
                                        {key: values[start:stop] for key, values in columns.items()}, start)
            outcome: Any = (total.tolist(), per_function)
        else:
            outcome = ([], {})
    except RewardError as error:
        outcome = str(error)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, outcome)
    failures = [part for part in gathered if isinstance(part, str)]
    if failures:
        raise RewardError(failures[0])
    per_function: dict[str, list[float]] = {}
    for _, part in gathered:
        for name, values in part.items():
            per_function.setdefault(name, []).extend(values)
    return torch.tensor([value for total, _ in gathered for value in total], dtype=torch.float32), per_function


def full_state_dict(model: nn.Module, setup: DistributedSetup) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on the CPU on rank 0 (None elsewhere), for `save_pretrained(state_dict=...)`.
    Every rank must call it (the shards are gathered)."""
    if not _fsdp_modules(model):
        return model.state_dict() if setup.is_main else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if setup.is_main else None


# ----------------------------------------------------------------------------------------------
# Reductions


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
