"""Where each role runs: `device_mesh` maps actor, critic, ref and reward (and the asynchronous pipeline's rollout
worker) to CUDA device indices.

Checked before any model loads (`resolve_placement`), with messages naming the key:
- indices must be visible; the message lists the visible devices and `CUDA_VISIBLE_DEVICES`, which
  renumbers them (index 0 is the first device *listed* there, not physical GPU 0);
- the actor's group is the data-parallel group: its size is the number of processes
  (`trainer.num_gpus`), and process i uses `actor[i]`;
- two roles either share exactly the same devices (colocated: the critic and reference are sharded
  over the same processes as the actor, and each process scores with its own reward model) or none.
  A partial overlap is refused: the shared device would hold one role's shard and another role's
  whole model, and the processes that own each group would disagree about it;
- the reward model may have devices of its own with any number of training processes: process i scores
  on `reward[i % len(reward)]` (one copy of the reward model per process; with 6 processes on 2 reward
  GPUs, 3 per GPU), so at most one reward device per process. The critic and reference, which are
  sharded with the actor, may have devices of their own only in a one-process run (the actor on one
  device). Separate process groups per role are not built.

- `rollout` places the rollout worker of the asynchronous pipeline (`trainer.max_staleness` > 0): one device,
  apart from the training processes' (e.g. {actor: [0], rollout: [1]}: generation on GPU 1 while GPU 0 trains),
  or shared with the reward model's. Left out, the worker's copy of the actor lives on the trainer's device. The
  synchronous loop generates with the actor's own weights, in place, so it has no rollout role (`config/checks.py`
  refuses one there).

Default: every role on the actor's devices, and the actor on devices 0..num_gpus-1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from hybridrl.config.schema import ConfigError

ROLES = ("actor", "critic", "ref", "reward")
"""The roles of the training processes' models; `rollout` (the asynchronous worker's) is placed apart from them."""


@dataclass(frozen=True)
class Placement:
    """Device indices per role, validated."""

    actor: tuple[int, ...]
    critic: tuple[int, ...]
    ref: tuple[int, ...]
    reward: tuple[int, ...]
    rollout: tuple[int, ...] = ()
    """The asynchronous rollout worker's device; () when not given: the trainer's own."""
    device_type: str = "cuda"

    def device(self, role: str, local_rank: int = 0) -> torch.device:
        """The device process `local_rank` uses for `role`: its own device when colocated, else the role's
        devices taken in turn (a reward model apart from several processes)."""
        group = getattr(self, role)
        if self.device_type != "cuda":
            return torch.device(self.device_type)
        return torch.device("cuda", group[local_rank % len(group)])

    @property
    def colocated(self) -> bool:
        return all(getattr(self, role) == self.actor for role in ROLES)


def visible_devices_text(count: int) -> str:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    listed = (f"only {count} CUDA device(s) are visible ({', '.join(map(str, range(count)))})" if count
              else "no CUDA device is visible")
    where = (f"CUDA_VISIBLE_DEVICES={env!r}, so index i is the i-th GPU listed there" if env is not None
             else "CUDA_VISIBLE_DEVICES is not set, so every GPU of the machine is visible")
    return f"{listed}; {where}"


def _indices(role: str, value: Any) -> tuple[int, ...]:
    key = f"trainer.device_mesh.{role}"
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{key} must be a non-empty list of CUDA device indices, e.g. [0, 1]; got {value!r}.")
    for index in value:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ConfigError(f"{key} must list device indices (integers >= 0); got {value!r}.")
    if len(set(value)) != len(value):
        raise ConfigError(f"{key} lists a device twice: {list(value)}; list each device once.")
    return tuple(value)


def resolve_placement(device_mesh: Mapping[str, Any] | None, num_gpus: int = 1, device_type: str = "cuda",
                      num_visible: int | None = None) -> Placement:
    """Validate `device_mesh` (None or {} means colocated on devices 0..num_gpus-1) against the devices
    this process can see; `num_visible` defaults to `torch.cuda.device_count()`."""
    device_mesh = dict(device_mesh or {})
    unknown = sorted(set(device_mesh) - {*ROLES, "rollout"})
    if unknown:
        raise ConfigError(f"trainer.device_mesh has unknown role {unknown[0]!r}; the roles are {', '.join(ROLES)} "
                          "and rollout.")
    if device_type != "cuda":
        if device_mesh:
            raise ConfigError(f"trainer.device_mesh places roles on CUDA devices, but trainer.device is "
                              f"{device_type}; remove trainer.device_mesh to run every role on the CPU.")
        return Placement((), (), (), (), device_type=device_type)
    visible = torch.cuda.device_count() if num_visible is None else num_visible
    groups = {role: _indices(role, device_mesh[role]) for role in ROLES if role in device_mesh}
    actor = groups.get("actor", tuple(range(num_gpus)))
    groups = {role: groups.get(role, actor) for role in ROLES}
    rollout = _indices("rollout", device_mesh["rollout"]) if "rollout" in device_mesh else ()
    for role, group in {**groups, "rollout": rollout}.items():
        bad = [index for index in group if index >= visible]
        if bad:
            key = f"trainer.device_mesh.{role}" if role in device_mesh else (
                "trainer.num_gpus" if role == "actor" else f"trainer.device_mesh.{role} (defaults to the actor's)")
            raise ConfigError(f"{key} uses CUDA device {bad[0]}, but {visible_devices_text(visible)}; "
                              f"use indices below {visible} or change CUDA_VISIBLE_DEVICES.")
    if "actor" in device_mesh and len(actor) != num_gpus:
        raise ConfigError(f"trainer.device_mesh.actor lists {len(actor)} device(s) {list(actor)} but trainer.num_gpus="
                          f"{num_gpus}; the actor's devices are the training processes, so set trainer.num_gpus="
                          f"{len(actor)}.")
    _check_sharing(groups, device_mesh)
    if rollout:
        _check_rollout(rollout, groups)
    return Placement(**groups, rollout=rollout, device_type="cuda")


def _check_rollout(rollout: tuple[int, ...], groups: dict[str, tuple[int, ...]]) -> None:
    if len(rollout) != 1:
        raise ConfigError(f"trainer.device_mesh.rollout lists {len(rollout)} devices {list(rollout)}; the rollout "
                          "worker runs on one device. List one index, e.g. rollout: [1].")
    for role in ("actor", "critic", "ref"):
        if set(rollout) & set(groups[role]):
            raise ConfigError(f"trainer.device_mesh.rollout={list(rollout)} shares a device with {role}="
                              f"{list(groups[role])}; the rollout worker keeps a copy of the actor and generates "
                              "while the training processes update, so give it a device of its own (or leave "
                              "rollout out to keep the copy on the trainer's device).")


def rollout_device(device_mesh: Mapping[str, Any] | None) -> str:
    """`trainer.device_mesh.rollout` as a device name ("cuda:1"), or "" when it is not given (checked by
    `resolve_placement`)."""
    index = (device_mesh or {}).get("rollout")
    if index is None:
        return ""
    return f"cuda:{index[0] if isinstance(index, (list, tuple)) else index}"


def _check_sharing(groups: dict[str, tuple[int, ...]], given: Mapping[str, Any]) -> None:
    for i, first in enumerate(ROLES):
        for second in ROLES[i + 1:]:
            a, b = set(groups[first]), set(groups[second])
            if a & b and a != b:
                raise ConfigError(
                    f"trainer.device_mesh.{first}={list(groups[first])} and trainer.device_mesh.{second}="
                    f"{list(groups[second])} share device(s) {sorted(a & b)} but are not the same group; roles that "
                    "share devices must list exactly the same devices (colocated) and roles on their own devices "
                    "must share none.")
    actor, reward = groups["actor"], groups["reward"]
    if reward != actor and len(reward) > len(actor):
        raise ConfigError(f"trainer.device_mesh.reward lists {len(reward)} devices {list(reward)} for {len(actor)} "
                          f"training process(es); process i scores on reward[i % {len(reward)}], so devices beyond "
                          f"the first {len(actor)} would stay idle. List at most {len(actor)}.")
    for role in ("critic", "ref"):
        if len(actor) > 1 and groups[role] != actor:
            raise ConfigError(
                f"trainer.device_mesh.{role}={list(groups[role])} is apart from the actor's {len(actor)} devices "
                f"{list(actor)}; with several training processes the {role} is sharded over the actor's devices. "
                f"Put {role} on {list(actor)}, or train the actor on one device to give {role} devices of its own.")
        if len(groups[role]) > 1 and groups[role] != actor:
            raise ConfigError(f"trainer.device_mesh.{role} lists {len(groups[role])} devices apart from the actor; a "
                              f"role on its own devices runs on one device. List one index for {role}.")
