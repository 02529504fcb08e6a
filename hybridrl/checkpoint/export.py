"""Checkpoint -> Hugging Face directory that `AutoModelForCausalLM.from_pretrained` loads.

The actor is rebuilt from the config saved in the checkpoint's `hf/` folder, its tensors are read
back through the same safetensors reader that resume uses (so a sharded checkpoint exports the
same way), and `save_pretrained` writes safetensors, config, generation config and tokenizer.
LoRA runs (peft) are either merged into the base weights (`merge_lora=True`, a plain model) or
written as a peft adapter directory. The LoRA path needs `peft` and is only exercised by the tests
when peft is installed.

QLoRA checkpoints (`model.load_in_4bit`) hold only the adapter: the base is loaded again from the run's
`model.path` in full precision (not 4-bit), so merging adds the adapter to the original weights, as
QLoRA's authors do; merging into the NF4 weights would write their rounding error into every layer.
The merged model then differs from the trained policy by that rounding error, and the export says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from hybridrl.checkpoint.store import (
    CheckpointError,
    load_tensors_into,
    model_state,
    read_trainer_state,
    resolve_resume,
    trainable_state,
)
from hybridrl.config.schema import MissingExtra
from hybridrl.models.loading import load_hf_model
from hybridrl.models.lora import with_adapter

logger = logging.getLogger(__name__)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, merge_lora: bool = True) -> Path:
    """Write the actor of `checkpoint` (a step_* dir, a checkpoints dir or a run dir) to `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    directory = resolve_resume(str(checkpoint), Path(checkpoint), key="checkpoint")
    if directory is None:
        raise CheckpointError(f"no checkpoint found at {checkpoint}.")
    state = read_trainer_state(directory)
    hf = directory / "hf"
    dtype = getattr(torch, state["actor_dtype"])
    four_bit = state["config"]["model"].get("load_in_4bit", False)
    if four_bit:
        model = full_precision_base(state, AutoConfig.from_pretrained(hf), dtype)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf), dtype=dtype)
    if state.get("peft"):
        model = wrap_lora(model, state["peft"])
    saved = model_state(model)
    tensors = {f"actor.{name}": tensor for name, tensor in
               (trainable_state(model, saved) if four_bit else saved).items()}
    load_tensors_into(tensors, directory / "state")
    if state.get("peft") and merge_lora:
        model = model.merge_and_unload()
        if four_bit:
            logger.warning("the adapter was trained on the 4-bit base and is merged into the full-precision weights "
                           "of %s, so the merged model differs from the trained policy by the 4-bit rounding error; "
                           "export with --adapter to keep the adapter separate.", state["config"]["model"]["path"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if (hf / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(hf).save_pretrained(out_dir)
    if (hf / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(hf).save_pretrained(out_dir)
    return out_dir


def full_precision_base(state: dict, saved_config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """A QLoRA run's base, loaded again from its `model.path` without quantization; refused when its shape
    differs from the checkpoint's (e.g. the actor was passed in Python and model.path names another model)."""
    model, trainer = state["config"]["model"], state["config"]["trainer"]
    base = load_hf_model(model["path"], dtype=dtype, trust_remote_code=model["trust_remote_code"],
                         tokenizer_path=model["tokenizer_path"], seed=trainer["seed"]).model
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
    if any(getattr(base.config, key, None) != getattr(saved_config, key, None) for key in keys):
        raise CheckpointError(f"this QLoRA checkpoint holds only the adapter, and its base model.path="
                              f"{model['path']!r} does not have the checkpoint's shape ({', '.join(keys)}); "
                              "export from a run whose model.path names the model it trained.")
    return base


def wrap_lora(model: torch.nn.Module, adapter: dict) -> torch.nn.Module:
    try:
        from peft import LoraConfig
    except ImportError:
        raise MissingExtra("this checkpoint holds a LoRA adapter; exporting it needs peft: "
                          "pip install 'hybridrl[peft]'.") from None
    known = set(LoraConfig.__dataclass_fields__)
    return with_adapter(model, LoraConfig(**{k: v for k, v in adapter.items() if k in known}))
