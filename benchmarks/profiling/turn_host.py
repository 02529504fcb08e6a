"""The host work at multi-turn turn boundaries, on CPU: `benchmarks/multiturn.py`'s episodes (64 prompts x 8, prompt
256, 3 turns x 85 forced tokens, a 50 ms asyncio tool returning 32 ids) on the tiny 2-layer model, whose forward is
cheap, so what the episode loop's phases cost is mostly Python.

    python -m benchmarks.profiling.turn_host [--calls 2] [--loop FILE] [--profile] [--top 25] [benchmark flags]

For the best of `--calls` warm calls (with `--loop`, of the engine's loop and the file's, in alternation) it prints, each
phase's least over the calls, the host milliseconds of the loop's boundary phases (`_harvest` when
it records ended turns, `_collect`, `_resume`, and the runner's `extend` inside `_resume`), in all and per turn
boundary (a boundary: the turns of a batch end, their tools start, their answers are collected and resumed; a
3-turn episode has 3, the last one ending the episode). `--profile` adds one more call with cProfile on inside those
phases only, and its top functions by own and by cumulative time (cProfile slows Python, so read those as shares).
The CPU forward of 512 rows is slow on a shared 2-core machine: `--prompt-len 32 --turn-len 16` keeps the 512 turns
of each boundary and cuts the decode steps. `--stub-runner` replaces the engine's runner with `multiturn_trace.StubRunner` (no model:
every call returns at once, decode steps only count), so a call's wall time is the loop's host work and the tools'
latency alone, steady enough on a loaded machine to compare two loops.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import functools
import inspect
import pstats
import time

from benchmarks import multiturn as bench
from benchmarks.profiling.multiturn_trace import instrument_forwards, parse_and_set_up
from hybridrl.rollout.engine import backend as backend_module
from hybridrl.rollout.engine.runner import ModelRunner
from hybridrl.rollout.engine.scheduler import Scheduler
from hybridrl.rollout.multiturn import EpisodeRun

PHASES = ("_harvest", "_collect", "_resume")
PARTS = ((ModelRunner, "read_progress"), (ModelRunner, "read_outputs"), (ModelRunner, "pause"), (ModelRunner, "free"),
         (Scheduler, "harvest"), (Scheduler, "resume"), (EpisodeRun, "turn_text"), (EpisodeRun, "record_turn"),
         (EpisodeRun, "add_step"))
"""What the boundary phases call, timed inside them (indented in the table)."""
LAST_START = "  harvest -> last tool started"
"""From the start of a harvest that ended turns to the start of its last environment step (part of `_harvest`)."""
FORWARD = "extend forward"
"""The observation prefill's forward inside the runner's `extend` (`multiturn_trace.instrument_forwards`): the model's
work, taken out of the boundary's host time."""


class Phases:
    """Host seconds per wrapped phase; with `profiler` set, that profiler runs inside the boundary phases only (the
    decode steps between them stay out of its table)."""

    def __init__(self) -> None:
        self.totals: collections.Counter = collections.Counter()
        self.profiler: cProfile.Profile | None = None

    def count_tool_starts(self, loop, start: float) -> None:
        """After a harvest that started environment steps: how long after the harvest began the last one started
        (its critical path: the turn boundary waits for that step's answer)."""
        started = [moment for moment in getattr(loop, "started_at", {}).values() if moment >= start]
        if started:
            self.totals[LAST_START] += max(started) - start

    def timed(self, function, name: str):
        """`function` (sync or async) adding its host seconds to `totals[name]`."""
        phases, profiled = self, name in PHASES

        def enter() -> float:
            if profiled and phases.profiler is not None:
                phases.profiler.enable()
            return time.perf_counter()

        def leave(start: float) -> None:
            phases.totals[name] += time.perf_counter() - start
            if profiled and phases.profiler is not None:
                phases.profiler.disable()

        if inspect.iscoroutinefunction(function):
            @functools.wraps(function)
            async def call_async(*args, **kwargs):
                start = enter()
                try:
                    return await function(*args, **kwargs)
                finally:
                    leave(start)
                    if name == "_harvest":
                        phases.count_tool_starts(args[0], start)
            return call_async

        @functools.wraps(function)
        def call(*args, **kwargs):
            start = enter()
            try:
                return function(*args, **kwargs)
            finally:
                leave(start)
        return call


def instrument(engine, phases: Phases, loops: list[type]) -> None:
    for loop in loops:
        for name in PHASES:
            setattr(loop, name, phases.timed(getattr(loop, name), name))
    engine.runner.extend = phases.timed(engine.runner.extend, "runner.extend")
    engine.runner.decode = phases.timed(engine.runner.decode, "runner.decode")
    instrument_forwards(phases.timed)
    for owner, name in PARTS:
        setattr(owner, name, phases.timed(getattr(owner, name), f"  {owner.__name__}.{name}"))


def print_phases(title: str, seconds: float, totals: dict, boundaries: int) -> None:
    totals = dict(totals, **{"boundary host": sum(totals.get(name, 0.0) for name in PHASES) - totals.get(FORWARD, 0.0)})
    print(f"{title}: {seconds:.3f} s")
    for name, value in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {name:32s} {1e3 * value:9.1f} ms  {1e3 * value / boundaries:8.1f} ms per boundary")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    own, args, _, _, prompts, engine, loops = parse_and_set_up(parser, ["--tiny", "--repeats", "1"])
    phases = Phases()
    instrument(engine, phases, list(loops.values()))
    best: dict[str, tuple[float, dict]] = {}
    for _ in range(own.calls):  # the loops in alternation, so that the shared machine's load hits both alike
        for name, loop in loops.items():
            backend_module.EpisodeLoop = loop
            run = bench.run_multiturn(engine, prompts, args, before=phases.totals.clear)  # after the warm-up
            seconds, totals = best.get(name, (run["seconds"], dict(phases.totals)))
            best[name] = (min(seconds, run["seconds"]), {k: min(v, totals.get(k, v)) for k, v in phases.totals.items()})
    print(f"{args.prompts} x {args.n} episodes, prompt {args.prompt_len}, {args.turns} turns x {args.turn_len} tokens, "
          f"tool {args.tool_latency_ms:g} ms, observation {args.observation_len} ids; the best of {own.calls} calls")
    for name, (seconds, totals) in best.items():
        print_phases(name, seconds, totals, args.turns)
    print("(boundary host: _harvest + _collect + _resume less the observation prefill's forward; indented: parts of "
          "those phases)")
    backend_module.EpisodeLoop = loops["engine loop"]
    if own.profile:
        phases.profiler = cProfile.Profile()
        bench.run_multiturn(engine, prompts, args)
        stats = pstats.Stats(phases.profiler)
        stats.sort_stats("tottime").print_stats(own.top)
        stats.sort_stats("cumulative").print_stats(own.top)


if __name__ == "__main__":
    main()
