"""`hybridrl config show --explain`: the resolved config as YAML, each key with its documentation.

The documentation is the docstring written under each field of the config dataclasses in
`config.py` (one place, as STYLE.md asks); Python does not keep those at runtime, so they are read
from the module's source with `ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any

import yaml

from hybridrl.config import schema as config_module


def field_docs() -> dict[str, dict[str, str]]:
    """{dataclass name: {field name: docstring}} for every dataclass in `config.py`."""
    tree = ast.parse(inspect.getsource(config_module))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        for statement, following in zip(node.body, node.body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                fields[statement.target.id] = inspect.cleandoc(following.value.value)
        docs[node.name] = fields
    return docs


def explained_yaml(config: config_module.Config, width: int = 100) -> str:
    """YAML of `config` with each section's keys preceded by their documentation as comments."""
    docs = field_docs()
    lines: list[str] = []
    for section in dataclasses.fields(config):
        lines.append(f"{section.name}:")
        lines.extend(_section_lines(getattr(config, section.name), docs, "  ", width))
        lines.append("")
    return "\n".join(lines)


def _section_lines(value: Any, docs: dict[str, dict[str, str]], indent: str, width: int) -> list[str]:
    """The documented keys of one section; a nested section (e.g. `rollout.engine`) is indented under its key."""
    lines = []
    for item in dataclasses.fields(value):
        doc = docs.get(type(value).__name__, {}).get(item.name, "")
        for line in textwrap.wrap(" ".join(doc.split()), width - len(indent) - 2):
            lines.append(f"{indent}# {line}")
        child = getattr(value, item.name)
        if dataclasses.is_dataclass(child):
            lines.append(f"{indent}{item.name}:")
            lines.extend(_section_lines(child, docs, indent + "  ", width))
        else:
            lines.append(f"{indent}{item.name}: {_dump(child)}")
    return lines


def _dump(value: Any) -> str:
    """One value in YAML flow style, on one line."""
    text = yaml.safe_dump(value, sort_keys=False, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").strip()
