"""The frozen base of QLoRA (`model.load_in_4bit`): a causal LM whose linear layers hold 4-bit NF4 weights.

Choices:
- bitsandbytes is optional (`pip install 'hybridrl[qlora]'`) and imported only here, only when asked for.
- NF4 with double quantization (the QLoRA paper's choice), computing in the model's own dtype.
- The LM head, embeddings and norms stay in the model dtype: the head is one matmul per chunk in
  `logprobs.py`, and quantizing it would round every log-prob the loss and the KL term compare.
- No `peft.prepare_model_for_kbit_training`: it casts every non-quantized parameter (embeddings,
  norms, head) to float32 and turns gradient checkpointing on. Here those parameters are frozen, so
  they stay in the model dtype (for Qwen2.5-7B the cast would add about 2 GiB), and checkpointing is
  `model.gradient_checkpointing`'s choice (non-reentrant, so frozen embeddings need no input grads).
- On CPUs with AVX512-BF16, bitsandbytes repacks a layer's weight into another layout (with bf16
  scales) the first time it runs in eval mode without gradients, and that layout has no backward.
  `quantize_4bit` turns this off for every 4-bit layer, so the rollout, the log-prob passes and the
  update all compute one function, as PPO's ratio assumes.
- Two ways in: `from_pretrained` with `bnb_config` (transformers quantizes shard by shard, never
  holding the full-precision model), and `quantize_4bit` for a model already in memory (the built-in
  tiny models, the benchmark's random init, a model passed in Python).
- The 4-bit weights never change, so checkpoints hold only what trains (adapter and optimizer state);
  the base is rebuilt from `model.path` (`checkpoint.trainable_state`, `export.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridrl.config.schema import MissingExtra


def require_bitsandbytes() -> Any:
    try:
        import bitsandbytes
    except ImportError:
        raise MissingExtra("model.load_in_4bit needs bitsandbytes, which is not installed: pip install "
                          "'hybridrl[qlora]' (or pip install bitsandbytes), or set model.load_in_4bit=false.") from None
    return bitsandbytes


def bnb_config(compute_dtype: torch.dtype) -> Any:
    """The `quantization_config` that makes `from_pretrained` load the linear layers in 4-bit NF4."""
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                              bnb_4bit_use_double_quant=True)


def quantize_4bit(model: nn.Module, compute_dtype: torch.dtype | None = None) -> int:
    """Replace every `nn.Linear` of an in-memory model but the LM head by a frozen bitsandbytes NF4 layer,
    in place, on the device each weight is on; returns how many were replaced (0 if already quantized).
    Every 4-bit layer, new or loaded, keeps one weight layout on CPU (see the module docstring).

    One layer at a time, so the model's peak is its full-precision size plus one layer's 4-bit copy."""
    bnb = require_bitsandbytes()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child is head:  # Linear4bit subclasses nn.Linear: skipped
                continue
            weight = child.weight.detach()
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=compute_dtype or weight.dtype, compress_statistics=True,
                                      quant_type="nf4", device="meta")
            # Params4bit quantizes when it is moved to a device, the same one included.
            layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True,
                                             quant_type="nf4").to(weight.device)
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.detach(), requires_grad=False)
            setattr(parent, name, layer)
            replaced += 1
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return replaced


def holds_4bit_weights(model: nn.Module) -> bool:
    """True if any layer of `model` (a peft wrapper included) keeps bitsandbytes 4-bit weights; by class name,
    so checkpoints and export can ask without importing bitsandbytes."""
    return any(type(module).__name__ == "Linear4bit" for module in model.modules())
