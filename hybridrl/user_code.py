"""User code (rewards, environments, tools): importing it from `path/to/file.py`, and where it failed.

Reward functions (and later tools and environments) are user code called from deep inside hybridrl; a
message that names only the error leaves the user searching. `user_frames` keeps the frames outside the
hybridrl package, the Python installation and site-packages, innermost last, as `file:line in function`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import sysconfig
import traceback
from pathlib import Path
from types import ModuleType

_PACKAGE = Path(__file__).resolve().parent
_LIBRARY_ROOTS = {Path(p).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")
                  if (p := sysconfig.get_paths().get(key))} | {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return not any(path.is_relative_to(root) for root in (_PACKAGE, *_LIBRARY_ROOTS))


def user_frames(error: BaseException, limit: int = 3) -> list[str]:
    """Up to `limit` innermost frames of `error` that are in user files, as "path:line in function"."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if _is_user_file(frame.filename)]
    return [f"{frame.filename}:{frame.lineno} in {frame.name}" for frame in frames[-limit:]]


def where(error: BaseException) -> str:
    """" (at file:line in fn <- ...)" for a message, innermost first; empty when no frame is the user's."""
    frames = user_frames(error)
    return f" (at {' <- '.join(reversed(frames))})" if frames else ""


def import_user_file(file: str, what: str, error: type[Exception]) -> ModuleType:
    """Import the user's `file` (the part of a `path/to/file.py:Name` spec before ':') as a module (`what`:
    "reward", "environment", "tool" for messages); a missing file, one that cannot be imported, or one that
    raises while importing becomes `error` naming the file, with the user's frames."""
    path = Path(file).expanduser()
    if not path.is_file():
        raise error(f"{what} file {file!r} does not exist (looked in {path.resolve().parent}); "
                    "fix the path before ':' in the spec.")
    # A unique module name per file, registered in sys.modules so dataclasses and pickling inside it work.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    module_name = f"hybridrl_user_{what}_{path.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{what} file {str(path)!r} cannot be imported; it must be a Python .py file.")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as cause:
        del sys.modules[module_name]
        raise error(f"importing {what} file {str(path)!r} raised {type(cause).__name__}: {cause}{where(cause)}; "
                    "fix that file (its traceback is chained below).") from cause
    return module

