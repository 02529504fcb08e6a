"""Offloaded optimizer state of sharded parameters, in and out of checkpoints.

With several processes and `actor.optimizer_offload=true`, LeanAdamW keeps each offloaded FSDP2 parameter's
moments as this rank's shard in (pinned) CPU memory (the others', with `actor.optimizer_offload_fraction`
< 1, stay DTensors on the device): plain tensors, not DTensors, so
`torch.distributed.checkpoint.state_dict` cannot gather them as it gathers the weights. Here each moment
is wrapped as a DTensor sharded like its parameter and gathered one at a time (at most one full moment
is on the device at once); on resume each rank cuts its own shard out of the full tensor that every rank
has read, with no communication. The checkpoint's layout is the one-process layout (full tensors named
`<role>_optim.<parameter>.<slot>`), so it resumes on any number of processes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def offloaded_shards(optimizer: Any, distributed: bool) -> bool:
    """True when the optimizer's state is per-rank shards that only this module can gather."""
    return distributed and getattr(optimizer, "offload", False)


def gather_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool
                           ) -> dict[str, Any]:
    """`{"state": {name: {slot: full CPU tensor or number}}, "param_groups": [...]}`, the shape
    `get_state_dict` gives, on the main rank (state empty elsewhere). Every rank must call it."""
    from torch.distributed.tensor import DTensor

    names = {param: name for name, param in model.named_parameters()}
    state: dict[str, dict[str, Any]] = {}
    for param, name in names.items():
        slots = optimizer.state.get(param)
        if not slots:
            continue
        gathered = {}
        for slot, value in slots.items():
            if isinstance(value, DTensor):  # kept on the device (actor.optimizer_offload_fraction < 1)
                value = value.full_tensor()
            elif isinstance(value, torch.Tensor) and isinstance(param, DTensor):
                local = param.to_local()
                value = DTensor.from_local(value.to(local.device).view(local.shape), param.device_mesh,
                                           param.placements, shape=param.shape, stride=param.stride()).full_tensor()
            gathered[slot] = value.cpu() if isinstance(value, torch.Tensor) and is_main else value
        if is_main:  # every rank took part in the gathers; only the main rank keeps (and copies out) the result
            state[name] = gathered
    groups = [{**{key: value for key, value in group.items() if key != "params"},
               "params": [names[param] for param in group["params"]]} for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def scatter_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, slots: dict[str, dict[str, Any]],
                            param_groups: list[dict[str, Any]]) -> None:
    """Put the saved full moments (`slots`: parameter name -> slot -> full tensor or number, read by every
    rank) back as this rank's offloaded shards, and the saved hyper-parameters into the param groups."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        state = optimizer.state[param]
        for slot, value in slots.get(name, {}).items():
            if isinstance(value, torch.Tensor):
                resident = not optimizer.slot_on_host(param, slot)  # offload_fraction < 1, or a master copy
                if isinstance(param, DTensor):  # every rank has the full tensor: cut the shard, no communication
                    value = distribute_tensor(value.to(param.to_local().device, torch.float32), param.device_mesh,
                                              param.placements, src_data_rank=None)
                    if resident:
                        state[slot] = value  # a DTensor moment like the parameter, as LeanAdamW makes it
                        continue
                    value = value.to_local()
                if resident:
                    state[slot] = value.to(param.device, torch.float32, copy=True)
                    continue
                value = value.to("cpu", torch.float32).contiguous()
                state[slot] = value.pin_memory() if param.is_cuda else value
            else:
                state[slot] = value
    for group, saved_group in zip(optimizer.param_groups, param_groups):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
