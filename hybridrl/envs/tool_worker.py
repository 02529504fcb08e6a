"""The process a tool call runs in: started by `tools.ToolWorker` as a script, by its path, so it imports only
the standard library and the user's tool files (no torch, no hybridrl), and starts in a fraction of a second.

Why a process: a Python function that hangs cannot be stopped from a thread; a process can be killed (with its
whole process group) at the call's timeout, and the next call gets a fresh one.

Protocol, one JSON object per line: argv[1] is `[[file, function], ...]`; the worker answers `{"ready": true}`
or `{"load_error": "..."}`, then reads `{"name": ..., "arguments": {...}}` requests from stdin and answers each
with `{"ok": text}` or `{"error": "Type: message", "where": [[file, line, function], ...]}` (the user's frames,
innermost first). The tool's own prints
go to stderr and its stdin is empty, so it cannot corrupt the protocol.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import json
import os
import sys
import traceback


def load_tools(specs: list[list[str]]) -> tuple[dict, set[str]]:
    tools, files = {}, set()
    for file, name in specs:
        path = os.path.abspath(file)
        files.add(path)
        module_name = f"hybridrl_user_tools_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        tools[name] = getattr(module, name)
    return tools, files


def render(value: object) -> str:
    """A tool's return value as observation text: strings as they are, else JSON, else `str()`."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def user_where(error: BaseException, files: set[str]) -> list[list]:
    """The frames of the user's tool files in the traceback, [file, line, function], innermost first (three at most)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) in files]
    return [[f.filename, f.lineno, f.name] for f in reversed(frames[-3:])]


def answer(request: dict, tools: dict, files: set[str]) -> dict:
    try:
        value = tools[request["name"]](**request["arguments"])
        if inspect.isawaitable(value):
            value = asyncio.run(value)
        return {"ok": render(value)}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "where": user_where(error, files)}


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    requests = os.fdopen(os.dup(0), "r")
    os.dup2(2, 1)  # the tool's prints go to stderr, never into the protocol
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # and a tool that reads input gets none, not our requests
    specs = json.loads(sys.argv[1])
    # Not this script's folder (hybridrl/envs/): its base.py or tools.py must not shadow a user's `import tools`.
    del sys.path[0]
    try:
        tools, files = load_tools(specs)
    except Exception as error:
        print(json.dumps({"load_error": f"{type(error).__name__}: {error}"}), file=protocol)
        return
    print(json.dumps({"ready": True}), file=protocol)
    for line in requests:
        print(json.dumps(answer(json.loads(line), tools, files)), file=protocol)


if __name__ == "__main__":
    main()
