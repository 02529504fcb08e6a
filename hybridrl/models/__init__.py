"""Models: loading Hugging Face and built-in tiny models, the critic's value head and the reference copy
(`loading.py`), LoRA through peft (`lora.py`) and QLoRA's 4-bit base (`qlora.py`)."""

from hybridrl.models.loading import HFModel, ModelError, load_hf_model

__all__ = ["HFModel", "ModelError", "load_hf_model"]
