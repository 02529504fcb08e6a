"""Building a `Config`: YAML file + dotted `key=value` overrides + keyword arguments -> typed dataclasses.

Type checks happen here, field by field, naming the dotted key; ranges and cross-field rules are in
`checks.py`, applied to the built config.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from hybridrl.config.checks import validate
from hybridrl.config.schema import Config, ConfigError


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, **kwargs: Any) -> Config:
    """Read a YAML file (optional), apply `key=value` overrides, then keyword arguments, and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(path)
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    for key, value in kwargs.items():
        set_dotted(raw, key.replace("__", "."), value)
    return build_config(raw)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML file.")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(raw).__name__}.")
    return raw


def parse_override(item: str) -> tuple[str, Any]:
    """`rollout.temperature=0.8` -> ("rollout.temperature", 0.8); values are parsed as YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. trainer.total_steps=200).")
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key!r}: {part!r} is a value, not a section.")
        node = child
    node[parts[-1]] = value


def build_config(raw: dict[str, Any]) -> Config:
    raw = dict(raw)
    # Shorthand from the Python API: algorithm="grpo" means algorithm.name="grpo".
    if isinstance(raw.get("algorithm"), str):
        raw["algorithm"] = {"name": raw["algorithm"]}
    if "device_mesh" in raw:  # Python API: device_mesh={...} means trainer.device_mesh
        raw["trainer"] = {**raw.get("trainer", {}), "device_mesh": raw.pop("device_mesh")}
    if "use_gradient_checkpointing" in raw:  # Python API spelling of model.gradient_checkpointing
        raw["model"] = {**raw.get("model", {}), "gradient_checkpointing": raw.pop("use_gradient_checkpointing")}
    config = _build_dataclass(Config, raw, prefix="")
    validate(config)
    return config


def _build_dataclass(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {raw!r}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in names:
            moved = getattr(cls, "moved_keys", {})  # a section's ClassVar: old key -> its new place
            if key in moved:
                raise ConfigError(f"'{prefix}{key}' is now '{prefix}{moved[key]}'; set that key instead.")
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean '{prefix}{close[0]}'?" if close else f" Known keys: {', '.join(names)}."
            raise ConfigError(f"unknown config key '{prefix}{key}'.{hint}")
        values[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**values)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    """Check `value` against the annotation `hint`, converting only where lossless (int -> float)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build_dataclass(hint, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, key)
            except ConfigError as error:
                errors.append(error)
        if len(errors) == 1:
            raise errors[0]
        wanted = [str(error).removeprefix(f"{key} must be ").split("; got ")[0] for error in errors]
        raise ConfigError(f"{key} must be {' or '.join(wanted)}; got {value!r}.")
    if origin is Literal:
        if value not in args:
            allowed = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{key} must be one of {allowed}; got {value!r}.")
        return value
    if origin is list:
        if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
            if isinstance(value, str) and args and args[0] is str:
                value = [value]
            else:
                raise ConfigError(f"{key} must be a list; got {value!r}.")
        return [_coerce(args[0], item, f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping; got {value!r}.")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false; got {value!r}.")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer; got {value!r}.")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 2e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number; got {value!r}.")
        return float(value)
    if hint is str:
        if isinstance(value, bool):  # YAML 1.1 reads off/on/no/yes as booleans (trainer.resume=off)
            value = "on" if value else "off"
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string; got {value!r}.")
        return value
    raise AssertionError(f"unhandled annotation {hint} for {key}")
