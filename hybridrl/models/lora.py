"""LoRA through peft: adapters on the actor, and the reference as the same model with adapters off.

Choices:
- peft is optional (`pip install 'hybridrl[peft]'`) and imported only here, only when LoRA is asked for.
- No second model for the KL term: `AdapterDisabled` wraps the actor and runs it inside
  `disable_adapter()`, which is exactly the frozen base, at the cost of no memory.
- LoRA dropout defaults to 0: PPO's ratio compares two evaluations of one function, and dropout would
  make them differ even before any update.
- Rollout: the `hf` backend runs a peft model as it is. The built-in engine applies the default
  adapter in place (x W^T + s (x A^T) B^T, no merge, so the base weights are never rounded); tested
  against peft on CPU and, compiled with CUDA graphs, on a GPU (`tests/test_builtin_engine_gpu.py`),
  so `rollout.backend=auto` runs LoRA models on it on GPU (see `docs/rollout.md`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from hybridrl.config.schema import MissingExtra


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise MissingExtra("model.lora_rank > 0 needs peft, which is not installed: pip install 'hybridrl[peft]'"
                          " (or pip install peft), or set model.lora_rank=0 to train all parameters.") from None
    return peft


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
               target_modules: list[str] | str = "all-linear") -> nn.Module:
    """Wrap a causal LM with fresh LoRA adapters (B = 0, so it starts as the base model); only adapters train."""
    peft = require_peft()
    if isinstance(target_modules, list) and target_modules == ["all-linear"]:
        target_modules = "all-linear"
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                             task_type="CAUSAL_LM", bias="none")
    return with_adapter(model, config)


def with_adapter(model: nn.Module, config: Any) -> nn.Module:
    """`peft.get_peft_model`, without the FutureWarning it triggers in transformers 5.2x (it asks the model's
    deprecated `is_gradient_checkpointing`) on every run."""
    peft = require_peft()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
        return peft.get_peft_model(model, config)


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


class AdapterDisabled(nn.Module):
    """The reference policy of a LoRA run: the actor's own modules with every adapter switched off.

    It registers no parameters (they belong to the actor), so `.to()` / `.eval()` on it touch nothing.
    `logprobs.response_logprobs` recognises it through `adapter_disabled_model`.
    """

    def __init__(self, peft_model: nn.Module):
        super().__init__()
        if not is_peft_model(peft_model):
            raise TypeError("AdapterDisabled needs a peft model (one made by apply_lora).")
        object.__setattr__(self, "adapter_disabled_model", peft_model)  # not a submodule: no shared parameters

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.adapter_disabled_model
        with model.disable_adapter(), torch.no_grad():
            return model(*args, **kwargs)
