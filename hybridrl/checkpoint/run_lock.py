"""One run per output directory: an exclusive lock held for the run's life.

Two runs writing one `trainer.output_dir` interleave their checkpoints, `model/` and `metrics.jsonl`
and both exit 0. The lock is an `flock` on `OUTPUT_DIR/.hybridrl.lock`: the kernel drops it when the
holding process ends however it ends (kill -9 included), so a lock file left by a dead run never blocks
the next one. The file names its holder (pid and host) for the message a second run gets.

In a multi-process run the process that owns the run holds it: the `hybridrl` launcher (its workers,
marked by `HYBRIDRL_WORKER=1`, do not lock again), or rank 0 when the ranks were started some other way.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOCK_NAME = ".hybridrl.lock"


class RunLockError(RuntimeError):
    """The output directory is in use by another run; the message names it."""


def lock_owner(rank: int = 0) -> bool:
    """Whether this process should hold the run's lock: rank 0, unless the hybridrl launcher holds it."""
    return rank == 0 and os.environ.get("HYBRIDRL_WORKER") != "1"


@contextmanager
def output_dir_lock(output_dir: str | Path, enabled: bool = True) -> Iterator[None]:
    """Hold the lock on `output_dir` (created if missing) within the block; refuse a directory in use."""
    if not enabled:
        yield
        return
    try:
        import fcntl
    except ImportError:  # Windows: no flock; runs there are not protected against sharing a directory
        yield
        return
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / LOCK_NAME, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise RunLockError(f"{directory} is in use by another hybridrl run ({holder}); wait for it to finish, "
                               "stop it, or give this run its own trainer.output_dir.") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # closing the descriptor releases the flock
