"""Where user code failed: the frames of an exception's traceback that lie in the user's own files.

Reward functions (and later tools and environments) are user code called from deep inside hybridrl; a
message that names only the error leaves the user searching. `user_frames` keeps the frames outside the
hybridrl package, the Python installation and site-packages, innermost last, as `file:line in function`.
"""

from __future__ import annotations

import sys
import sysconfig
import traceback
from pathlib import Path

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
