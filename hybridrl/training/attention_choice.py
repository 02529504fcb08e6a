"""Which SDPA kernels a trainer's steps may use: PyTorch's order (cuDNN's first on recent GPUs) or the
precompiled ones only (flash, memory-efficient, math).

Why: cuDNN builds its attention kernels at run time. Each process compiles a plan for every shape it meets, and on
a machine whose CUDA cache (`~/.nv/ComputeCache`) does not hold them yet the driver also compiles their PTX: a
one-off cost in the first step, paid again in every new process and every new shape. At short sequences attention
is a sliver of a step's work, so there that cost buys nothing; the flash and memory-efficient kernels ship compiled
in PyTorch and serve at once. Longer sequences keep PyTorch's order, where cuDNN's kernels can be the fastest.
`trainer.cudnn_attention` chooses; `auto` leaves cuDNN out for light runs (`kernel_choices.light_rollout`: short
prompts and responses).

The choice is PyTorch's process-wide switch, set for the duration of each step (the rollout and the update; a CUDA
graph captured inside keeps the kernels it recorded), and restored after it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridrl.config.schema import Config
from hybridrl.rollout.engine.kernel_choices import light_rollout

PRECOMPILED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA's backends whose kernels ship compiled in PyTorch, in PyTorch's order of preference."""


def uses_cudnn_attention(config: Config, device: torch.device) -> bool:
    """Whether the steps may use cuDNN's attention: `trainer.cudnn_attention`, `auto` meaning all but light runs."""
    choice = config.trainer.cudnn_attention
    if choice == "auto":
        return not light_rollout(config.rollout.max_new_tokens, config.data.max_prompt_length, device)
    return bool(choice)


def step_attention(config: Config, device: torch.device) -> Callable[[], ContextManager]:
    """A context to run each step in: PyTorch's own SDPA choice, or every backend but cuDNN's."""
    if uses_cudnn_attention(config, device):
        return contextlib.nullcontext
    return lambda: sdpa_kernel(PRECOMPILED_BACKENDS)
