"""Checkpoint -> Hugging Face directory that `AutoModelForCausalLM.from_pretrained` loads.

The actor is rebuilt from the config saved in the checkpoint's `hf/` folder, its tensors are read
back through the same safetensors reader that resume uses (so a sharded checkpoint exports the
same way), and `save_pretrained` writes safetensors, config, generation config and tokenizer.
LoRA runs (peft) are either merged into the base weights (`merge_lora=True`, a plain model) or
written as a peft adapter directory. The LoRA path needs `peft` and is only exercised by the tests
when peft is installed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridrl.checkpoint import CheckpointError, load_tensors_into, model_state, read_trainer_state, resolve_resume
from hybridrl.config import MissingExtra


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, merge_lora: bool = True) -> Path:
    """Write the actor of `checkpoint` (a step_* dir, a checkpoints dir or a run dir) to `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    directory = resolve_resume(str(checkpoint), Path(checkpoint), key="checkpoint")
    if directory is None:
        raise CheckpointError(f"no checkpoint found at {checkpoint}.")
    state = read_trainer_state(directory)
    hf = directory / "hf"
    dtype = getattr(torch, state["actor_dtype"])
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf), dtype=dtype)
    if state.get("peft"):
        model = wrap_lora(model, state["peft"])
    tensors = {f"actor.{name}": tensor for name, tensor in model_state(model).items()}
    load_tensors_into(tensors, directory / "state")
    if state.get("peft") and merge_lora:
        model = model.merge_and_unload()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if (hf / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(hf).save_pretrained(out_dir)
    if (hf / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(hf).save_pretrained(out_dir)
    return out_dir


def wrap_lora(model: torch.nn.Module, adapter: dict) -> torch.nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise MissingExtra("this checkpoint holds a LoRA adapter; exporting it needs peft: "
                          "pip install 'hybridrl[peft]'.") from None
    known = set(LoraConfig.__dataclass_fields__)
    return get_peft_model(model, LoraConfig(**{k: v for k, v in adapter.items() if k in known}))
