"""The default CUDA generator while the engine captures a graph in one thread and other threads go on.

PyTorch registers the current device's default generator with every graph it captures and marks that generator
as capturing from `capture_begin` to `capture_end`. Any other thread that draws from it
meanwhile (dropout in the trainer's forward, `torch.rand` in user code) fails with "Offset increment outside graph
capture encountered unexpectedly", and a graph replayed in another thread fails the same way. The thread rollout
worker captures while the trainer's thread trains on the same GPU, so both can happen. (So in torch up to 2.12,
the GPU machines' 2.11 included; 2.13 keeps a generator's capture state per capture and registers it only when a
captured op draws, so there nothing below is needed, and it changes nothing.)

So each capture registers a generator of the engine's own in place of the default one (`begin_capture`): the
default generator's state is swapped for the engine's just around `capture_begin` and swapped back before the
recording goes on, so the default generator is never marked as capturing beyond that call, and no graph of the
engine ever names it (replays touch only the engine's generator). The engine's graphs draw no random numbers
(`sampling.py` takes its uniforms from outside the graph), so which generator they name changes no token.

What remains is the swap itself: a draw from another thread inside `capture_begin` would land on the engine's
generator while it is marked. `CAPTURE_LOCK` is held across the swap; a thread that draws from the default
generator of the engine's device while a capture may run holds it around its drawing work. The trainer does
this when its models draw at all (`draws_random_numbers`: dropout left on, e.g. a LoRA adapter's `lora_dropout`;
hybridrl turns the models' own dropout off) and the thread worker shares its GPU (`async_pipeline.py`).
"""

from __future__ import annotations

import threading

import torch

CAPTURE_LOCK = threading.RLock()
"""Held across the generator swap around `capture_begin`, and by a thread that draws from the default CUDA generator
of that device while the engine may capture (see the module docstring); reentrant, so that a thread holding it may
capture itself."""


def begin_capture(graph: torch.cuda.CUDAGraph, pool, generator: torch.Generator) -> None:
    """`graph.capture_begin` (thread-local error mode) with `generator` (a CUDA generator of the current device, the
    engine's own) registered in place of the default generator, which is left as it was."""
    default = torch.cuda.default_generators[torch.cuda.current_device()]
    with CAPTURE_LOCK:
        shared = default.graphsafe_get_state()
        default.graphsafe_set_state(generator)
        try:
            # thread_local: a thread rollout worker captures while the trainer's thread goes on with its own
            # CUDA work (a host sync there would otherwise invalidate this capture)
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        finally:
            default.graphsafe_set_state(shared)


def draws_random_numbers(model: torch.nn.Module) -> bool:
    """Whether a training forward of `model` draws from torch's default generator: a dropout module with p > 0 or an
    attention's `attention_dropout` above 0 (how Hugging Face attention reads it)."""
    return any((isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0)
               or (isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0)
               for module in model.modules())
