"""Tools shipped with hybridrl, for the tool demo and as examples of writing one.

A config names a tool by file and function (`env.tools: [path/to/builtin_tools.py:calc]`); `BUILTIN_TOOLS`
gives this file's path so the demo can name it from an installed package. The tool workers import this file by
its path, so it imports nothing from hybridrl and has no import-time side effects.
"""

from __future__ import annotations

import operator
import re
from pathlib import Path

BUILTIN_TOOLS = Path(__file__).resolve()
"""This file: `f"{BUILTIN_TOOLS}:calc"` is the spec of the calculator tool."""

_EXPRESSION = re.compile(r"\s*(?P<a>-?\d{1,100})\s*(?P<operator>[-+*])\s*(?P<b>-?\d{1,100})\s*")
_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def calc(expr: str) -> int:
    """Compute one operation of two integers exactly, such as 123*45.

    Args:
        expr: Two integers with +, - or * between them, e.g. 123*45.
    """
    match = _EXPRESSION.fullmatch(expr) if isinstance(expr, str) else None
    if match is None:
        raise ValueError(f"calc takes two integers with +, - or * between them, such as 123*45; got {expr!r}.")
    return _OPERATIONS[match["operator"]](int(match["a"]), int(match["b"]))
