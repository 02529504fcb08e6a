"""Which kernels a `generate` call of the built-in engine runs on its device: the decode attention path, whether
gate/up are stacked, how many layers of a 4-bit base are dequantized once, and the sampler.

Kept apart from the runner so that each choice is one small function of the user's option and the device, testable
on CPU; the engine reports each choice in `last_stats` under the names given here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hybridrl.rollout.engine.kv_cache import PagedKVCache, PrefixSharedKVCache, SlotKVCache
from hybridrl.rollout.engine.weights import PROJECTIONS, is_packed_4bit, unwrap
from hybridrl.rollout.engine.sampling import SamplerSettings

ATTENTION_OPTIONS = ("auto", "triton", "sdpa")
KV_CACHE_OPTIONS = ("auto", "paged", "contiguous")
SAMPLER_OPTIONS = ("auto", "torch")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class AttentionPath:
    """One decode-attention path: the KV cache layout it reads, the attention function of the prefix-shared
    layout (None for the per-slot layout, whose attention is SDPA inside `decode_logits`) and its name for
    `last_stats`."""

    name: str
    layout: type
    attention: Callable | None = None


def resolve_attention(option: str, device: torch.device) -> str:
    """`auto` -> "triton" on CUDA when triton imports, else "sdpa". On CPU `auto` keeps the per-slot SDPA
    layout (the prefix-shared one would run the slow PyTorch reference); "triton" on CPU means the
    prefix-shared layout with that reference standing in for the kernel (how its logic is tested)."""
    if option not in ATTENTION_OPTIONS:
        raise ValueError(f"attention must be one of {ATTENTION_OPTIONS}; got {option!r}.")
    if option == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if option == "triton" and device.type == "cuda" and not triton_available():
        raise ValueError("attention='triton' needs the triton package on CUDA (pip install triton); "
                         "use rollout.engine.attention=sdpa or auto.")
    return option


def resolve_kv_cache(option: str, attention: str) -> str:
    """`auto` -> "contiguous", today's layout, until the paged path's GPU tests have passed and the grpo-0.5b shape has
    been measured with it too (docs/benchmarks.md, long-tail: paged wins there). "paged" brings its own decode
    attention, so it refuses an explicit attention='sdpa'."""
    if option not in KV_CACHE_OPTIONS:
        raise ValueError(f"kv_cache must be one of {KV_CACHE_OPTIONS}; got {option!r}.")
    if option == "paged" and attention == "sdpa":
        raise ValueError("rollout.engine.kv_cache=paged reads keys through a block table with its own attention, "
                         "not SDPA; set rollout.engine.attention=auto (or kv_cache=contiguous to keep sdpa).")
    return "contiguous" if option == "auto" else option


def paged_path(device: torch.device) -> AttentionPath:
    """The paged layout: its Triton kernel on CUDA (triton required), its gather-based PyTorch reference on CPU."""
    from hybridrl.rollout.kernels import paged_attention

    if device.type != "cuda":
        return AttentionPath("paged-reference", PagedKVCache, paged_attention.reference_paged_decode_attention)
    if not triton_available():
        raise ValueError("rollout.engine.kv_cache=paged needs the triton package on CUDA (pip install triton); "
                         "use rollout.engine.kv_cache=contiguous.")
    return AttentionPath("paged-triton", PagedKVCache, paged_attention.triton_paged_decode_attention)


def attention_path(option: str, device: torch.device, kv_cache: str = "contiguous") -> AttentionPath:
    """The attention path for the user's `option` (and `kv_cache` option) on `device`. The kernels' modules are
    imported only here, so the per-slot path never imports triton."""
    if resolve_kv_cache(kv_cache, option) == "paged":
        return paged_path(device)
    if resolve_attention(option, device) == "sdpa":
        return AttentionPath("sdpa", SlotKVCache)
    from hybridrl.rollout.kernels import decode_attention

    if device.type == "cuda":
        return AttentionPath("triton", PrefixSharedKVCache, decode_attention.triton_decode_attention)
    return AttentionPath("reference", PrefixSharedKVCache, decode_attention.reference_decode_attention)


AUTO_COMPILE_MIN_NEW_TOKENS = 64
"""`rollout.engine.compile=auto` compiles the engine for responses of at least this many tokens."""


def auto_compiles(max_new_tokens: int, device: torch.device) -> bool:
    """Whether `rollout.engine.compile=auto` compiles the engine's pieces: on CUDA, for responses of at least
    `AUTO_COMPILE_MIN_NEW_TOKENS`. Compiling costs seconds once per process (the first rollout traces and builds
    every piece) and saves a share of each decode step after it; a rollout of short responses takes few decode
    steps, so those savings repay the compilation only after very many rollouts, while CUDA graphs of the
    uncompiled step are ready at once. Both compute the same tokens (`tests/test_builtin_engine.py`)."""
    return device.type == "cuda" and max_new_tokens >= AUTO_COMPILE_MIN_NEW_TOKENS


LIGHT_MAX_PROMPT_TOKENS = 128
"""A light rollout's prompts are at most this long (see `light_rollout`)."""


def light_rollout(max_new_tokens: int, max_prompt_length: int, device: torch.device) -> bool:
    """Whether a trainer's rollouts are light: on CUDA, responses too short for `auto_compiles` and prompts of at
    most `LIGHT_MAX_PROMPT_TOKENS`. Few decode steps over short contexts gain little from the Triton kernels (the
    prefix-shared attention, the sampling kernels) or from sharing each prompt's KV, while each kernel is compiled,
    and a C launcher built for it, at its first run in a process unless Triton's cache holds them: seconds of the
    first rollout. So the engine's `auto` kernel choices take SDPA and the PyTorch sampler for them."""
    return not auto_compiles(max_new_tokens, device) and device.type == "cuda" \
        and max_prompt_length <= LIGHT_MAX_PROMPT_TOKENS


AUTO_FUSE_GATE_UP_MAX_FRACTION = 0.05
"""`fuse_gate_up="auto"` stacks gate/up when the copy takes at most this share of the GPU's memory."""


def auto_fuses_gate_up(model) -> bool:
    """Whether `fuse_gate_up="auto"` stacks each layer's gate and up weights for the rollout: on CUDA, when the copy
    is at most `AUTO_FUSE_GATE_UP_MAX_FRACTION` of the device's memory (one matmul fewer per layer and step is worth
    a small copy, not a large one next to the KV cache). On CPU the plain projections are kept."""
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
    counts as free); the others are dequantized as they run, at every step. With all of them copied the rollout runs
    as for a bf16 base, CUDA graphs included. None on CPU, or without 4-bit weights."""
    weight = next(model.parameters())
    sizes = dequantized_layer_bytes(model)
    if weight.device.type != "cuda" or not any(sizes):
        return 0
    free, _ = torch.cuda.mem_get_info(weight.device)
    free += torch.cuda.memory_reserved(weight.device) - torch.cuda.memory_allocated(weight.device)
    return layers_within(sizes, AUTO_DEQUANTIZE_MAX_FREE_FRACTION * free)


def sampling_kernels_on(sampler: str, device: torch.device) -> bool:
    """Whether the Triton sampling kernels may run: `sampler="auto"` on CUDA with triton installed."""
    return sampler == "auto" and device.type == "cuda" and triton_available()


def small_batch_projections_on(device: torch.device, compiled: bool) -> bool:
    """Whether narrow decode batches run their projections through the skinny-batch kernel (`small_batch.py`): on
    CUDA with triton installed, for a compiled step. An uncompiled one is the light rollout's (`light_rollout`), which
    avoids building kernels in its first call; the skinny kernel would be built there for every narrow batch."""
    return compiled and device.type == "cuda" and triton_available()


def sampler_name(sampler: str, settings: SamplerSettings, device: torch.device, vocab: int) -> str:
    """Which sampler a call's decode steps run: "triton" (`sampling_kernels.py`) or "torch" (the compiled or eager
    `sample_and_record`); `sampling_kernels.with_sampling_kernel` decides the same way."""
    if not sampling_kernels_on(sampler, device):
        return "torch"
    from hybridrl.rollout.kernels.sampling_kernels import sampling_kernel_applies

    return "triton" if sampling_kernel_applies(settings, vocab) else "torch"
