"""hybridrl: reinforcement-learning post-training for language models, fast and lean on small GPU budgets."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "RLTrainer": "hybridrl.training.trainer",
    "PromptDataset": "hybridrl.data.datasets",
    "SFTDataset": "hybridrl.data.datasets",
    "load_hf_model": "hybridrl.models.loading",
    "load_config": "hybridrl.config.schema",
    "Config": "hybridrl.config.schema",
    "RewardComposer": "hybridrl.rewards",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    """Import on first use, so `import hybridrl` stays fast and light (no torch until needed)."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridrl' has no attribute {name!r}")
