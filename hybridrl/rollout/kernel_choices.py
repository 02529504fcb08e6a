"""Which kernels a `generate` call of the built-in engine runs on its device: the decode attention's layout and
implementation, whether gate/up are stacked and the sampler. Kept apart from `builtin.py`, which runs the phases;
the engine reports each choice in `last_stats` under the names given here."""

from __future__ import annotations

from typing import Callable

import torch

from hybridrl.rollout.llama_forward import unwrap
from hybridrl.rollout.sampling import SamplerSettings

ATTENTION_OPTIONS = ("auto", "triton", "triton-stacked", "sdpa")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention(option: str, device: torch.device) -> str:
    """`auto` -> "triton" on CUDA when triton imports, else "sdpa". On CPU `auto` keeps the per-slot SDPA
    layout (the prefix-shared one would run the slow PyTorch reference); "triton" on CPU means the
    prefix-shared layout with that reference standing in for the kernel (how its logic is tested).
    "triton-stacked" (opt-in, never chosen by `auto`: 2% faster than "triton" in its one H200 run, inside
    run-to-run variation) is the same layout with the two stacked kernels; on CPU their PyTorch two-phase
    reference."""
    if option == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if option in ("triton", "triton-stacked") and device.type == "cuda" and not triton_available():
        raise ValueError(f"attention={option!r} needs the triton package on CUDA (pip install triton); "
                         "use attention='sdpa' (rollout.attention=sdpa) or 'auto'.")
    return option


def decode_attention_function(attention: str, device: torch.device) -> tuple[str, Callable]:
    """The prefix-shared attention (`triton` or `triton-stacked`) for this device, and its name for
    `last_stats`. Imported here so that the per-slot path never imports triton."""
    from hybridrl.rollout import decode_attention, stacked_attention

    if attention == "triton-stacked":
        if device.type == "cuda":
            return "triton-stacked", stacked_attention.stacked_decode_attention
        return "stacked-reference", stacked_attention.stacked_reference_attention
    if device.type == "cuda":
        return "triton", decode_attention.triton_decode_attention
    return "reference", decode_attention.reference_decode_attention


AUTO_FUSE_GATE_UP_MAX_FRACTION = 0.05
"""`fuse_gate_up="auto"` stacks gate/up when the copy takes at most this share of the GPU's memory."""


def auto_fuses_gate_up(model) -> bool:
    """Whether `fuse_gate_up="auto"` stacks each layer's gate and up weights for the rollout: on CUDA, when
    the copy is at most `AUTO_FUSE_GATE_UP_MAX_FRACTION` of the device's memory. The stacked matmul made the
    grpo-0.5b rollout 4% faster on an H200 (0.625 -> 0.598 s, `docs/benchmarks.md`); the copy is 0.4 GB for
    Qwen2-0.5B (on for any card of 8 GB or more), 1.5 GB for Qwen2.5-1.5B (on for an H200, off for a 24 GB
    card) and 7.6 GB for Qwen2.5-7B (off for both). On CPU the plain projections are kept."""
    weight = next(model.parameters())
    if weight.device.type != "cuda":
        return False
    layers = unwrap(model).model.layers
    copy_bytes = sum((layer.mlp.gate_proj.weight.numel() + layer.mlp.up_proj.weight.numel())
                     * layer.mlp.gate_proj.weight.element_size() for layer in layers)
    return copy_bytes <= AUTO_FUSE_GATE_UP_MAX_FRACTION * torch.cuda.get_device_properties(weight.device).total_memory


def sampler_name(sampling_kernel: bool, settings: SamplerSettings, device: torch.device, vocab: int) -> str:
    """Which sampler a call's decode steps run: "triton" (`sampling_kernels.py`) or "torch" (the compiled or eager
    `sample_and_record`); `sampling_kernels.with_sampling_kernel` decides the same way."""
    if not (sampling_kernel and device.type == "cuda" and triton_available()):
        return "torch"
    from hybridrl.rollout.sampling_kernels import sampling_kernel_applies

    return "triton" if sampling_kernel_applies(settings, vocab) else "torch"
