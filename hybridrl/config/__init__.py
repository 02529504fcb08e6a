"""Configuration: typed dataclasses (`schema.py`), building them from YAML, overrides and keyword arguments
(`loading.py`), the checks that name the key at fault (`checks.py`) and `config show --explain` (`explain.py`)."""

from hybridrl.config.loading import load_config
from hybridrl.config.schema import Config, ConfigError, MissingExtra

__all__ = ["Config", "ConfigError", "MissingExtra", "load_config"]
