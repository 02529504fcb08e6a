"""Where a `generate` call's wall time goes, on the host and on the GPU, without extra synchronisation.

Each mark reads the host clock and, on CUDA, records an event in stream order: the GPU passes the event when it
has finished everything queued before it. So at a mark, `gpu_ms - host_ms` says how far the GPU trails the host:
well above zero, the host is ahead and the GPU stays busy; near zero, the GPU has been waiting for the host (a
host-bound stretch, such as recording the decode graph). The events are read once, at the end of the call, when
the GPU has finished.
"""

from __future__ import annotations

import time

import torch


class Timeline:
    """Marks of one call: `mark(name)` keeps the first occurrence (phases repeat with waves), `mark(name,
    last=True)` the latest (the final sync)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict[str, tuple[float, torch.cuda.Event | None]] = {}
        self.mark("start")

    def mark(self, name: str, last: bool = False) -> None:
        if name in self.marks and not last:
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.pop(name, None)  # re-inserted: the dict keeps the marks in time order
        self.marks[name] = (time.perf_counter(), event)

    def report(self) -> dict[str, dict[str, float]]:
        """{mark: {"host_ms": ..., "gpu_ms": ...}} since "start" ("gpu_ms" only on CUDA); waits for the GPU."""
        start_host, start_event = self.marks["start"]
        if self.cuda:
            next(reversed(self.marks.values()))[1].synchronize()
        report = {}
        for name, (host, event) in self.marks.items():
            report[name] = {"host_ms": round(1e3 * (host - start_host), 2)}
            if event is not None:
                report[name]["gpu_ms"] = round(start_event.elapsed_time(event), 2)
        return report


def phase_seconds(report: dict[str, dict[str, float]]) -> dict[str, float]:
    """A call's three stretches in seconds: `before_decode` (preamble, prefill, recording the decode graph: until
    the first decode step runs), `decode` (to the last sync; later waves' prefills included) and `after_decode`
    (the last harvest, freeing the cache). A mark counts at the later of its two clocks, when both the host and
    the GPU had reached it. Empty when the report lacks those marks (another backend, a call that failed)."""
    first = "replay" if "replay" in report else "decode"  # uncaptured (CPU): the first step follows the prefill
    if not {first, "sync", "released"} <= report.keys():
        return {}

    def at(name: str) -> float:
        return max(report[name]["host_ms"], report[name].get("gpu_ms", 0.0)) / 1e3

    return {"before_decode": at(first), "decode": at("sync") - at(first), "after_decode": at("released") - at("sync")}
