"""Which kernels a `generate` call of the built-in engine runs on its device: the decode attention's layout and
implementation, whether gate/up are stacked, whether a 4-bit base is dequantized once, and the sampler. Kept apart from `builtin.py`, which runs the phases;
the engine reports each choice in `last_stats` under the names given here."""

from __future__ import annotations

from typing import Callable

import torch

from hybridrl.rollout.engine.llama_forward import PROJECTIONS, is_packed_4bit, unwrap
from hybridrl.rollout.engine.sampling import SamplerSettings

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
    from hybridrl.rollout.kernels import decode_attention, stacked_attention

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


AUTO_DEQUANTIZE_MAX_FREE_FRACTION = 0.5
"""`dequantize_4bit="auto"` copies 4-bit layers at full precision while the copies take at most this share of the
GPU's free memory (what is left goes to the KV cache, sized after the copies, and the step's activations)."""


def dequantized_layer_bytes(model) -> list[int]:
    """Per decoder layer, the bytes of a full-precision copy of its bitsandbytes 4-bit projection weights (0 where
    none is packed)."""
    sizes = []
    for layer in unwrap(model).model.layers:
        size = 0
        for path in PROJECTIONS.values():
            module = layer.get_submodule(path)
            weight = getattr(module, "base_layer", module).weight
            if is_packed_4bit(weight):
                size += weight.quant_state.shape.numel() * weight.quant_state.dtype.itemsize
        sizes.append(size)
    return sizes


def layers_within(sizes: list[int], budget: float) -> int:
    """How many layers, from the first, fit in `budget` bytes together."""
    total = 0
    for count, size in enumerate(sizes):
        total += size
        if total > budget:
            return count
    return len(sizes)


def auto_dequantized_layers(model) -> int:
    """How many decoder layers, from the first, `dequantize_4bit="auto"` copies at full precision for a `generate`:
    on CUDA, as many as fit in `AUTO_DEQUANTIZE_MAX_FREE_FRACTION` of the free memory (the allocator's unused cache
    counts as free); the others are dequantized as they run, at every step. All of them (13 GB for a 7B model) on an
    H200: the rollout then runs as for a bf16 base, CUDA graphs included (`docs/benchmarks.md`); part of them on a
    24 GB card. None on CPU, or without 4-bit weights."""
    weight = next(model.parameters())
    sizes = dequantized_layer_bytes(model)
    if weight.device.type != "cuda" or not any(sizes):
        return 0
    free, _ = torch.cuda.mem_get_info(weight.device)
    free += torch.cuda.memory_reserved(weight.device) - torch.cuda.memory_allocated(weight.device)
    return layers_within(sizes, AUTO_DEQUANTIZE_MAX_FREE_FRACTION * free)


def sampler_name(sampling_kernel: bool, settings: SamplerSettings, device: torch.device, vocab: int) -> str:
    """Which sampler a call's decode steps run: "triton" (`sampling_kernels.py`) or "torch" (the compiled or eager
    `sample_and_record`); `sampling_kernels.with_sampling_kernel` decides the same way."""
    if not (sampling_kernel and device.type == "cuda" and triton_available()):
        return "torch"
    from hybridrl.rollout.kernels.sampling_kernels import sampling_kernel_applies

    return "triton" if sampling_kernel_applies(settings, vocab) else "torch"
