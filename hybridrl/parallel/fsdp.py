"""FSDP2 applied from outside the model, and the hybrid engine's view of sharded weights.

- FSDP2 (`fully_shard`) per decoder layer, then the root (embeddings, final norm, LM head, tied or
  not). Works for NCCL on GPU and for gloo on CPU (the CPU tests run it with two gloo processes).
- Gradients are *summed* across ranks, not averaged: every rank keeps the whole (small) rollout batch,
  so the loss normalisers (`num_tokens` of the mini-batch and the like) are already global, and each
  rank's loss over its rows is its exact share of the one-process loss. With gloo and NCCL alike this
  is a plain SUM reduce-scatter (no PreMulSum).
- Rollout: `gather_for_rollout` all-gathers each layer once, keeps the full weights while the rank
  generates for its share of prompts (no collective inside a forward, so ranks may decode different
  numbers of steps), and frees them afterwards. One full copy plus the shard, never two.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from hybridrl.models.loading import decoder_hidden_states, decoder_layers
from hybridrl.parallel.process_group import DistributedSetup


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
        # takes the input tensors: FSDP2's root pre-forward on CUDA indexes its positional arguments, so
        # an argument-less method (such as `get_decoder`) cannot be registered.
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


def full_state_dict(model: nn.Module, setup: DistributedSetup) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on the CPU on rank 0 (None elsewhere), for `save_pretrained(state_dict=...)`.
    Every rank must call it (the shards are gathered)."""
    if not _fsdp_modules(model):
        return model.state_dict() if setup.is_main else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if setup.is_main else None


