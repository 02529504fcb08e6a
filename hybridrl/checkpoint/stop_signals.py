"""Stopping cleanly on SIGINT/SIGTERM: the first signal only sets a flag, the trainer finishes its step, saves
a checkpoint and returns; a second signal acts as usual, so an impatient user can still stop at once.

A run stopped this way ends with exit status 128 + the signal's number (`hybridrl train`, like the launcher),
so a scheduler or script can tell it from a finished run (0) and from an error (1, 2).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from hybridrl.metrics.sinks import print_unless_closed


class StopRequest:
    """Set by SIGINT/SIGTERM; the trainer finishes its step, saves, and returns."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signal_name is not None


@contextmanager
def stop_on_signals(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[StopRequest]:
    """Within the block, the first SIGINT/SIGTERM only sets the flag; a second one acts as usual
    (KeyboardInterrupt / termination)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request  # signal handlers can only be installed from the main thread
        return
    previous = {number: signal.getsignal(number) for number in signals}

    def handler(number: int, frame: Any) -> None:
        request.signal_name, request.signum = signal.Signals(number).name, number
        # Ctrl-C under `| tee` also ends tee: this print must not raise out of the step.
        print_unless_closed(f"received {request.signal_name}: finishing this step, then saving a checkpoint "
                            "(send it again to stop at once)")
        for other, action in previous.items():
            signal.signal(other, action)

    for number in signals:
        signal.signal(number, handler)
    try:
        yield request
    finally:
        for number, action in previous.items():
            signal.signal(number, action)
