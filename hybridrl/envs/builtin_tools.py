"""Tools shipped with hybridrl, for the tool demo and as examples of writing one.

A config names a tool by file and function (`env.tools: [path/to/builtin_tools.py:calc]`); `BUILTIN_TOOLS`
gives this file's path so the demo can name it from an installed package. The tool workers import this file by
its path, so it imports nothing from hybridrl and has no import-time side effects.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_TOOLS = Path(__file__).resolve()
"""This file: `f"{BUILTIN_TOOLS}:calc"` is the spec of the calculator tool."""


def calc(a: int, b: int) -> int:
    """Multiply two integers exactly.

    Args:
        a: The first factor.
        b: The second factor.
    """
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int) or not isinstance(b, int):
        raise TypeError(f"calc multiplies integers; got {a!r} and {b!r}.")
    return a * b
