"""Hang detection: each rank counts its progress (`heartbeat()`), and a `Watchdog` thread turns a rank whose
count stops into an error that names it.

A stalled rank that is computing (not waiting inside a torch.distributed call) is the one to blame;
ranks waiting in a collective are only held up by it (`find_stalled`). A rank whose whole process stopped
(SIGSTOP, frozen) last reported whatever it was doing, possibly "waiting"; its watchdog thread stopped too,
so it stops publishing, and that silence names it. Under Ray the driver runs the same
check over the actors' counts (`launch.py`).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Any, Callable

_progress = 0


_training_thread: int | None = None


def heartbeat() -> None:
    """Mark progress (the trainer calls it at every phase); the watchdog stops runs whose ranks stop beating."""
    global _progress, _training_thread
    _progress += 1
    _training_thread = threading.get_ident()


def progress() -> int:
    return _progress


def waiting_in_collective() -> bool:
    """Whether the thread that last called `heartbeat()` is inside torch.distributed code right now (waiting
    for other ranks), as opposed to computing: how the watchdog tells the rank that hangs from those it holds up."""
    frame = sys._current_frames().get(_training_thread) if _training_thread is not None else None
    while frame is not None:
        if _DISTRIBUTED_CODE in frame.f_code.co_filename.replace(os.sep, "/"):
            return True
        frame = frame.f_back
    return False


_DISTRIBUTED_CODE = "/torch/distributed/"


STALL_EXIT_CODE = 75
"""Exit status of a worker whose watchdog stopped the run."""

STARTUP_GRACE_S = 600.0
"""How long a rank may take to its first heartbeat (loading the model) while no rank has made one."""

COLLECTIVE_MARGIN_S = 60.0
"""How far the process group's collective timeout stays above the watchdog's bounds (`collective_timeout_s`)."""


def collective_timeout_s(hang_timeout_s: float, startup_grace_s: float = STARTUP_GRACE_S,
                         at_least: float = 0.0) -> float:
    """The process group's timeout for collectives when a watchdog runs: above both bounds the watchdog applies
    (`hang_timeout_s`, and `startup_grace_s` before the first heartbeat) by `COLLECTIVE_MARGIN_S`, so a hang is
    always reported by the watchdog, which names the rank that stopped, and never first by a collective timing
    out on a rank that was only waiting for it."""
    return max(at_least, max(hang_timeout_s, startup_grace_s) + COLLECTIVE_MARGIN_S)


def first_heartbeat_clock(started: float, startup_grace_s: float, first_progress_at: float | None) -> float:
    """Where the stall clock of a rank without a heartbeat starts: after the start-up grace, or as soon as any
    rank has made its first heartbeat, whichever is earlier. Ranks load their models together and pass
    collectives before the first step, so once one rank is training the others have `timeout_s` to follow;
    a rank stopped before its first heartbeat is then named within the hang timeout, not after the grace."""
    end_of_grace = started + startup_grace_s
    return end_of_grace if first_progress_at is None else min(end_of_grace, first_progress_at)


def find_stalled(counts: dict[int, int], changed_at: dict[int, float], now: float, timeout_s: float,
                 waiting: dict[int, bool] | None = None, silent: set[int] | None = None,
                 silent_after_s: float = 0.0) -> str | None:
    """Which rank holds the run up, if any. A rank is stalled when its heartbeat count has not changed
    for `timeout_s`; a stalled rank that is computing (not waiting inside a torch.distributed call) is
    the one to blame, while stalled ranks waiting in a collective are only held up by it. A rank in `silent`
    (its process stopped answering the supervisor: stopped by SIGSTOP, frozen) is to blame whatever its last
    report said: a rank stopped inside a collective last reported waiting, like the ranks it holds up. So the
    verdict that every rank waits (a deadlock, or a rank that died inside a collective) is given only once the
    stall has lasted `silent_after_s` longer, the time a stopped rank takes to fall silent."""
    waiting, silent = waiting or {}, silent or set()
    stalled = [r for r in sorted(counts) if now - changed_at[r] > timeout_s]
    culprits = [r for r in stalled if r in silent or not waiting.get(r, False)]
    if culprits:
        idle = max(now - changed_at[r] for r in culprits)
        names = ", ".join(str(r) for r in culprits)
        held = [r for r in stalled if r not in culprits]
        also = f"; rank {', '.join(map(str, held))} wait(s) for it in a collective" if held else ""
        beat = min(counts[r] for r in culprits)
        where = f"stuck after heartbeat {beat}" if beat else "before its first heartbeat"
        how = ("its process stopped answering: stopped (SIGSTOP) or frozen" if all(r in silent for r in culprits)
               else "outside any collective")
        return f"rank {names} made no progress for {idle:.0f} s ({where}, {how}){also}"
    idle = min((now - changed_at[r] for r in stalled), default=0.0)
    if stalled and len(stalled) == len(counts) and idle > timeout_s + silent_after_s:
        where = ", ".join(f"rank {r} at heartbeat {counts[r]}" for r in stalled)
        return (f"every rank has waited in a collective for {idle:.0f} s ({where}): a rank died inside it, or "
                "the ranks called different collectives")
    return None


SILENT_AFTER_POLLS = 3
SILENT_AFTER_AT_LEAST_S = 10.0


def silence_bound_s(interval_s: float) -> float:
    """How long a supervisor may hear nothing new from a rank (its watchdog's publication count, the Ray driver's
    progress probe) before that rank counts as stopped (`find_stalled`'s `silent`): `SILENT_AFTER_POLLS` polling
    intervals, and at least `SILENT_AFTER_AT_LEAST_S` so a loaded machine's late thread is not taken for a stopped
    one. A rank's own watchdog thread publishes every interval whatever its training thread does, so only a
    stopped or frozen process stays silent that long."""
    return max(SILENT_AFTER_POLLS * interval_s, SILENT_AFTER_AT_LEAST_S)


class Watchdog(threading.Thread):
    """Publishes this rank's heartbeat count to the rendezvous store and reads every rank's; when
    `find_stalled` names a rank, calls `on_stall(message)` (default: print it and exit the process)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float, interval_s: float | None = None,
                 on_stall: Callable[[str], None] | None = None, startup_grace_s: float = STARTUP_GRACE_S):
        super().__init__(name="hybridrl-watchdog", daemon=True)
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.startup_grace_s = startup_grace_s
        """Extra time before a rank's first heartbeat (model loading), until any rank has made one
        (`first_heartbeat_clock`)."""
        self.interval_s = interval_s or min(10.0, max(0.5, timeout_s / 5))
        self.on_stall = on_stall or _exit_with_message
        self._stop_event = threading.Event()

    @classmethod
    def from_env(cls, rank: int, world_size: int, timeout_s: float, **kwargs: Any) -> Watchdog:
        import torch.distributed as dist

        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=datetime.timedelta(seconds=max(30.0, timeout_s)))
        return cls(dist.PrefixStore("hybridrl/heartbeat/", client), rank, world_size, timeout_s, **kwargs)

    def stop(self, wait_s: float = 10.0) -> None:
        """Stop and wait for the thread to finish the store call it may be in. A daemon thread still running
        when the interpreter finalizes is ended with pthread_exit as it re-takes the GIL after a store call;
        unwinding through the binding's noexcept GIL guard then aborts the process ("terminate called without
        an active exception": 2-process CPU runs in CI that had otherwise finished). Runs at exit too."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(wait_s)

    def run(self) -> None:
        counts: dict[int, int] = {}
        waiting: dict[int, bool] = {}
        changed_at: dict[int, float] = {}
        publications: dict[int, int] = {}  # rank -> its watchdog's publication count: it stops when its process does
        heard_at: dict[int, float] = {}
        started = time.monotonic()
        first_progress_at: float | None = None
        published = 0
        while not self._stop_event.wait(self.interval_s):
            try:
                published += 1
                self.store.set(str(self.rank), f"{progress()} {int(waiting_in_collective())} {published}")
                for rank in range(self.world_size):
                    text = self.store.get(str(rank)).decode() if self.store.check([str(rank)]) else "0 0 0"
                    count, waiting[rank], publication = parse_report(text)
                    now = time.monotonic()
                    if counts.get(rank) != count:
                        counts[rank], changed_at[rank] = count, now
                    if publications.get(rank) != publication:
                        publications[rank], heard_at[rank] = publication, now
            except Exception as error:  # the store lives in rank 0's process (or torchrun's agent)
                if self._stop_event.is_set():
                    return
                self.on_stall(f"rank {self.rank} lost the rendezvous store ({type(error).__name__}: {error}); "
                              "rank 0 or the launcher probably died")
                return
            if first_progress_at is None and any(counts.get(rank, 0) for rank in range(self.world_size)):
                first_progress_at = time.monotonic()
            for rank in range(self.world_size):
                if counts.get(rank, 0) == 0:
                    changed_at[rank] = first_heartbeat_clock(started, self.startup_grace_s, first_progress_at)
            now = time.monotonic()
            silent = {rank for rank, at in heard_at.items()  # (a rank that never published may not have started yet)
                      if publications[rank] and now - at > silence_bound_s(self.interval_s)}
            message = find_stalled(counts, changed_at, now, self.timeout_s, waiting, silent,
                                   silence_bound_s(self.interval_s))
            if message:
                self.on_stall(message)
                return


def parse_report(text: str) -> tuple[int, bool, int]:
    """A rank's published "<heartbeats> <waiting 0|1> <publications>"."""
    count, waiting, publication = text.split()
    return int(count), waiting == "1", int(publication)


def _exit_with_message(message: str) -> None:
    print(f"hybridrl: {message}; stopping the run (trainer.hang_timeout_s).", file=sys.stderr, flush=True)
    os._exit(STALL_EXIT_CODE)


