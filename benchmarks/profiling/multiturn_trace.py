"""Where a multi-turn rollout's time goes: `benchmarks/multiturn.py`'s runs with every runner phase timed on the host
and, through CUDA events in stream order (no extra synchronisation), on the GPU.

    python -m benchmarks.profiling.multiturn_trace [--loop path/to/multiturn.py] [benchmark flags, e.g. --quick]

Runs single turn, then multi-turn with the engine's episode loop (once per `--extend-attention` and episode
definition asked for: `--both-definitions` adds the tool after the last turn), and with `--loop` also an
`EpisodeLoop` loaded from another file (an older version, say) in alternation, so both share the process and the
GPU's clocks. For the
last timed run of each it prints: wall seconds; GPU seconds inside decode blocks, prefills and observation
prefills (`extend`), and their sum's complement (the GPU waiting for the host: syncs, harvests, tool waits,
captures); decode steps and blocks, resume waves, and ms per decode step for each (batch, kv_len) bucket; host
seconds in the loop's harvest, collect and resume and in graph captures; full (generation 2) garbage collections and
their milliseconds; each observation prefill's forward (`llama_forward.extend`), host and GPU ms side by side; and for
each turn boundary the host times of its steps after the turn's last block synchronised (`BOUNDARY_MARKS`). With
$OUT set, every decode block and extend (host start, sizes, GPU ms) goes to $OUT/multiturn_trace.json. Ends with
the benchmark's own table for the engine loop's (last round's) runs.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib.util
import inspect
import json
import os
import time
import types

import numpy
import torch

from benchmarks import multiturn as bench
from hybridrl.rollout.engine import backend as backend_module
from hybridrl.rollout.engine import resume as resume_module
from hybridrl.rollout.engine.backend import BuiltinBackend

RUNNER_PHASES = ("prefill", "extend", "decode")
FORWARD = "extend forward"
"""The observation prefill's forward alone (`resume.forward`, or `resume.replay` for a small wave's CUDA graph), inside
the runner's `extend` (whose rest is sampling and bookkeeping): its host and GPU milliseconds side by side say whether
it is bound by the host's launches."""
LOOP_PHASES = ("_harvest", "_collect", "_resume")


class Recorder:
    """Host seconds and (CUDA) start/end events of each wrapped call, and the full garbage collections, per run."""

    def __init__(self) -> None:
        self.reset()
        self.gc_started: float | None = None
        gc.callbacks.append(self.full_collection)

    def reset(self) -> None:
        self.calls: list[dict] = []
        self.host = collections.Counter()
        self.started = time.perf_counter()
        self.last_sync: float | None = None  # when the latest `read_progress` returned
        self.gc_ms, self.gc_count = 0.0, 0

    def full_collection(self, phase: str, info: dict) -> None:
        """A generation-2 collection stops the host wherever it lands (`gc.callbacks`)."""
        if info.get("generation") != 2:
            return
        if phase == "start":
            self.gc_started = time.perf_counter()
        elif self.gc_started is not None:
            self.gc_ms += 1e3 * (time.perf_counter() - self.gc_started)
            self.gc_count += 1
            self.gc_started = None

    def timed(self, name: str, fn, describe=lambda *a: {}):
        recorder = self

        def event():
            if not torch.cuda.is_available():
                return None
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        if inspect.iscoroutinefunction(fn):
            async def wrapped(*args, **kwargs):
                start = time.perf_counter()
                result = await fn(*args, **kwargs)
                recorder.host[name] += time.perf_counter() - start
                return result
        else:
            def wrapped(*args, **kwargs):
                start, begin = time.perf_counter(), event()
                result = fn(*args, **kwargs)
                took = time.perf_counter() - start
                recorder.host[name] += took
                if name == "sync":
                    recorder.last_sync = start + took
                if name in (*RUNNER_PHASES, FORWARD):
                    recorder.calls.append(dict(name=name, host_ms=1e3 * (start - recorder.started), begin=begin,
                                               end=event(), host_call_ms=1e3 * took, **describe(*args)))
                return result
        return wrapped

    def report(self, wall: float) -> dict:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        gpu = collections.Counter()
        per_bucket: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for call in self.calls:
            call["gpu_ms"] = call.pop("begin").elapsed_time(call.pop("end")) if call.get("begin") else 0.0
            gpu[call["name"]] += call["gpu_ms"] / 1e3
            if call["name"] == "decode":
                bucket = per_bucket[f"{call['batch']}x{call['kv_len']}"]
                bucket[0] += call["gpu_ms"]
                bucket[1] += call["steps"]
        busy = sum(seconds for name, seconds in gpu.items() if name != FORWARD)  # the forward is inside extend
        prefills = [call["host_ms"] for call in self.calls if call["name"] == "prefill"]
        edges = dict(first_prefill_ms=round(prefills[0], 2) if prefills else None,
                     after_last_sync_ms=round(1e3 * (self.started + wall - self.last_sync), 2)
                     if self.last_sync else None)
        return dict(wall_s=wall, gpu_s=dict(gpu), gpu_waiting_s=wall - busy, edges=edges,
                    host_s={k: round(v, 4) for k, v in self.host.items()},
                    ms_per_step={k: round(ms / steps, 3) for k, (ms, steps) in per_bucket.items()},
                    gc_full_ms=round(self.gc_ms, 1), gc_full_collections=self.gc_count,
                    calls=list(self.calls))  # a copy: the next run's warm-up records into the same list


BOUNDARY_MARKS = ("outputs read", "first tool started", "tools started", "harvested", "first answer", "last answer",
                  "answers in", "collected", "extend called", "forward launched", "next decode")
"""A turn boundary on the host, each mark in ms after the harvest's `read_progress` returned (the GPU has finished the
turn's last block there and waits until the forward is launched, tool latency included). "tools started": the last
of them; "first answer" and "last answer": the first and last step's done callback (`EpisodeLoop._answered`), so
"last answer" - "tools started" - the tool's latency is how far the event loop's handling of the answers lagged."""


class BoundaryClock:
    """Host times of each turn boundary's steps (`BOUNDARY_MARKS`), for the last call: where the GPU's wait at a
    boundary goes beyond the tool's latency. A boundary opens at a harvest that started environment steps; the marks
    after the answers came in count only once they have."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.boundaries: list[dict] = []
        self.synced, self.early = 0.0, {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        if name == "outputs read":
            self.early[name] = now
            return
        current = self.boundaries[-1] if self.boundaries else {}
        if "answers in" in current and name not in current:
            current[name] = round(1e3 * (now - current["t0"]), 2)

    def wrap(self, owner, name: str, before: str | None = None, after: str | None = None) -> None:
        function, clock = getattr(owner, name), self

        if inspect.iscoroutinefunction(function):
            async def wrapped(*args, **kwargs):
                result = await function(*args, **kwargs)
                clock.after_phase(name, args[0])
                return result
        else:
            def wrapped(*args, **kwargs):
                if before:
                    clock.mark(before)
                result = function(*args, **kwargs)
                if name == "read_progress":
                    clock.synced, clock.early = time.perf_counter(), {}
                elif name == "_collect" and not args[0].pending and clock.boundaries:
                    # Every answer is in (the last boundary's steps may all be done before any gather).
                    clock.after_phase("_gather_answers", args[0])
                if after:
                    clock.mark(after)
                return result
        setattr(owner, name, wrapped)

    def after_phase(self, name: str, loop) -> None:
        if name == "_harvest":
            started = [moment for moment in loop.started_at.values() if moment >= self.synced]
            if started:
                moments = dict(self.early, **{"first tool started": min(started), "tools started": max(started),
                                              "harvested": time.perf_counter()})
                self.boundaries.append(dict(t0=self.synced, tools=len(started),
                                            **{k: round(1e3 * (v - self.synced), 2) for k, v in moments.items()}))
        elif name == "_gather_answers" and self.boundaries:
            current = self.boundaries[-1]
            current.setdefault("answers in", round(1e3 * (time.perf_counter() - current["t0"]), 2))

    def answered(self) -> None:
        """A started environment step's done callback ran (`EpisodeLoop._answered`)."""
        if self.boundaries and "answers in" not in self.boundaries[-1]:
            current = self.boundaries[-1]
            moment = round(1e3 * (time.perf_counter() - current["t0"]), 2)
            current.setdefault("first answer", moment)
            current["last answer"] = moment

    def report(self) -> list[dict]:
        order = {name: index for index, name in enumerate(BOUNDARY_MARKS)}
        return [dict(sorted(((k, v) for k, v in b.items() if k != "t0"), key=lambda item: order.get(item[0], -1)))
                for b in self.boundaries]


def instrument_boundaries(engine: BuiltinBackend, clock: BoundaryClock, loops: list[type]) -> None:
    runner = engine.runner
    clock.wrap(runner, "read_progress")
    clock.wrap(runner, "read_outputs", after="outputs read")
    clock.wrap(runner, "extend", before="extend called")
    clock.wrap(runner, "decode", before="next decode")
    clock.wrap(resume_module, "forward", before="forward launched")
    for loop in loops:
        clock.wrap(loop, "_harvest")
        clock.wrap(loop, "_gather_answers")
        clock.wrap(loop, "_collect", after="collected")
        answered = loop._answered
        loop._answered = lambda self, task, answered=answered: (clock.answered(), answered(self, task))[1]


def instrument(engine: BuiltinBackend, recorder: Recorder, loops: list[type]) -> None:
    runner = engine.runner
    runner.decode = recorder.timed("decode", runner.decode, lambda b, k, s: dict(batch=b, kv_len=k, steps=s))
    runner.extend = recorder.timed("extend", runner.extend, lambda r: dict(rows=len(r)))
    instrument_forwards(lambda function, name: recorder.timed(name, function, describe_forward))
    runner.prefill = recorder.timed("prefill", runner.prefill, lambda p, a: dict(rows=len(a)))
    runner.read_progress = recorder.timed("sync", runner.read_progress)
    if hasattr(runner, "graphs"):  # not on `turn_host.StubRunner`
        runner.graphs.capture = recorder.timed("capture", runner.graphs.capture)
    for loop in loops:
        for name in LOOP_PHASES:
            setattr(loop, name, recorder.timed(name, getattr(loop, name)))


class StubRunner:
    """The runner's interface as the episode loop (and `generate`) use it, with no model: prefills and resumes put a
    slot's turn at its first token, decode steps add to the live slots' counts (up to `max_new_tokens`, where a slot
    reads as done), outputs are fixed ids and log-probs. Turns end at their length limit (the benchmark's forced
    lengths), so no stop token is needed. The device is a clock: each launch keeps it busy for the time the H200 took
    for it (`STUB_DEVICE_MS`: a decode step at 512 rows, a prompt token, an observation token) after the later of its
    launch and the previous work's end, and `read_progress` sleeps until it is idle, so the host's work overlaps the
    device's as on the GPU and the loop's waves form as they do there (with free decode steps, its waits would be
    judged against a block of no length)."""

    def __init__(self, device_ms: dict[str, float] | None = None) -> None:
        self.device_ms = dict(STUB_DEVICE_MS, **(device_ms or {}))
        self.run = types.SimpleNamespace(stats=types.SimpleNamespace(idle_s=0.0))
        self.idle_at = 0.0

    def _busy(self, milliseconds: float) -> None:
        self.idle_at = max(self.idle_at, time.perf_counter()) + milliseconds / 1e3

    def begin(self, prompts, params, stop_ids, num_sequences=None, max_len=None, keep=False) -> int:
        self.run.stats = types.SimpleNamespace(idle_s=0.0, decode_steps=0)
        slots, self.max_new_tokens = num_sequences or len(prompts) * params.n, params.max_new_tokens
        self.generated, self.live = [0] * slots, set()
        self.tokens = numpy.full((slots, params.max_new_tokens), 7, dtype=numpy.int64)
        self.logprobs = numpy.full((slots, params.max_new_tokens), -1.0, dtype=numpy.float32)
        return slots

    def prefill(self, prompts, admitted) -> None:
        self._busy(self.device_ms["prompt token"] * sum(len(prompts[s.prompt_index]) for s in
                                                         {s.prompt_index: s for s in admitted}.values()))
        self._start([sequence.slot for sequence in admitted])

    def extend(self, resumes) -> None:
        self._busy(self.device_ms["observation token"] * sum(len(ids) for _, ids, _, _ in resumes))
        self._start([slot for slot, _, _, _ in resumes])

    def _start(self, slots) -> None:
        for slot in slots:
            self.generated[slot] = 1
        self.live.update(slots)

    def decode(self, batch: int, kv_len: int, steps: int) -> None:
        self._busy(self.device_ms["decode step"] * steps)
        self.run.stats.decode_steps += steps
        for slot in self.live:
            self.generated[slot] = min(self.generated[slot] + steps, self.max_new_tokens)

    def read_progress(self, rows: int):
        time.sleep(max(0.0, self.idle_at - time.perf_counter()))
        return [int(count >= self.max_new_tokens) for count in self.generated[:rows]], self.generated[:rows]

    def read_outputs(self, rows: int, columns: int | None = None, slots: list[int] | None = None):
        return self.tokens[:rows, :columns], self.logprobs[:rows, :columns]  # indexed by slot, whatever `slots`

    def pause(self, slots) -> None:
        self.live.difference_update(slots)

    free = pause

    def move(self, moves) -> None:
        for source, destination in moves:
            self.generated[destination] = self.generated[source]
            if source in self.live:
                self.live.discard(source)
                self.live.add(destination)

    def end(self, finished: bool, release: bool, keep: bool = False) -> dict:
        time.sleep(max(0.0, self.idle_at - time.perf_counter()))
        return dict(vars(self.run.stats))

    def block_allocator(self):
        return None

    def kv_len(self, furthest: int) -> int:
        return furthest

    def capture_decode_ahead(self, batch: int, kv_len: int) -> None:
        pass

    def preempt(self, sequences) -> None:
        pass

    def write_blocks(self, writes, evicted=()) -> None:
        pass

    def record_scheduling(self, scheduler) -> None:
        pass


STUB_DEVICE_MS = {"decode step": 3.45, "prompt token": 35.0 / 16384, "observation token": 35.0 / 16896}
"""What `StubRunner` takes the device to be busy for, from an H200 trace of the benchmark (0.5B shape): a decode step
of 512 rows at ~500 keys; a prompt token (64 prompts x 256 in 35 ms); an observation token (the Triton extend's wave
of 512 x 33 in ~35 ms)."""


def load_loop(path: str) -> type:
    spec = importlib.util.spec_from_file_location("other_multiturn_loop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EpisodeLoop


def parse_and_set_up(parser: argparse.ArgumentParser, fixed: list[str] = ()) -> tuple:
    """This script's own flags (`parser`, with --loop added), the benchmark's from the rest (after `fixed`), its
    device, model, prompts and engine, and the episode loops to run: the engine's own, and with --loop another
    file's (in alternation, so that both share the process, the machine's load and the GPU's clocks)."""
    parser.add_argument("--loop", help="a file whose EpisodeLoop runs in alternation with the engine's own (before "
                                       "and after a change)")
    parser.add_argument("--stub-runner", action="store_true",
                        help="`StubRunner` in place of the engine's runner: the loop's host work alone, no model")
    own, rest = parser.parse_known_args()
    args = bench.parse_args([*fixed, *rest])
    device, model, prompts, engine = bench.set_up(args)
    if own.stub_runner:
        engine.runner = StubRunner()
    loops = {"engine loop": backend_module.EpisodeLoop}
    if own.loop:
        loops["--loop"] = load_loop(own.loop)
    return own, args, device, model, prompts, engine, loops


def describe_forward(run, batch, kv_end, count, *graphs) -> dict:
    """What the trace records of an observation prefill's forward (`resume.forward`, or `resume.replay` of a graph):
    its real rows, its (padded) ids per row, its key length."""
    return dict(rows=count, length=batch.input_ids.shape[1], kv_end=kv_end, graph=bool(graphs))


def instrument_forwards(wrap) -> None:
    """`wrap(function, name)` around the observation prefill's forward, uncaptured and replayed (the rest of the
    runner's `extend` is sampling and bookkeeping)."""
    resume_module.forward = wrap(resume_module.forward, FORWARD)
    resume_module.replay = wrap(resume_module.replay, FORWARD)


def summary_line(name: str, run: dict, report: dict) -> str:
    stats = run["stats"]
    keys = ("decode_steps", "decode_blocks", "resume_waves", "observation_prefills", "prefill_tokens", "idle_s")
    counts = ", ".join(f"{k} {stats.get(k)}" for k in keys if k in stats)
    gpu = ", ".join(f"{k} {v:.3f}" for k, v in report["gpu_s"].items())
    forwards = [f"{c['rows']}x{c['length']} (kv {c['kv_end']}{', graph' if c['graph'] else ''}): host "
                f"{c['host_call_ms']:.1f} GPU {c['gpu_ms']:.1f}" for c in report["calls"] if c["name"] == FORWARD]
    return (f"{name}: wall {report['wall_s']:.3f} s ({run['tokens_per_s']:,.0f} tok/s); GPU busy: {gpu}; GPU waiting "
            f"{report['gpu_waiting_s']:.3f} s; {counts}\n    host s {report['host_s']}\n    ms/step by batch x "
            f"kv_len {report['ms_per_step']}\n    full GC: {report['gc_full_collections']} collections, "
            f"{report['gc_full_ms']} ms; extend forwards, ms: {forwards}\n    first prefill launched "
            f"{report['edges']['first_prefill_ms']} ms after the call began; last sync to the call's end "
            f"{report['edges']['after_last_sync_ms']} ms"
            + "".join(f"\n    boundary {i}, ms after the sync: {boundary}" for i, boundary in
                      enumerate(report.get("boundaries", []))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    own, args, device, model, prompts, engine, loops = parse_and_set_up(parser)
    recorder, clock = Recorder(), BoundaryClock()
    instrument(engine, recorder, list(loops.values()))
    instrument_boundaries(engine, clock, list(loops.values()))
    reports = []  # the trace of each timed run; the last one of each call is kept

    def before() -> None:
        recorder.reset()
        clock.reset()
    hooks = dict(before=before,
                 after=lambda seconds: reports.append(dict(recorder.report(seconds), boundaries=clock.report())))
    results = {}
    single = bench.run_single(engine, prompts, args, **hooks)
    results["single turn"] = (single, reports[-1])
    table = []  # the engine loop's runs of the last round
    for round_index in range(2 if own.loop else 1):
        for name, loop in loops.items():
            backend_module.EpisodeLoop = loop

            def traced(run, title=f"{name}, round {round_index}"):
                results[f"{run['name']}, {title}"] = (run, reports[-1])
                print(summary_line(f"{run['name']}, {title}", run, reports[-1]), flush=True)
            runs = bench.multiturn_runs(engine, prompts, args, on_run=traced, **hooks)
            if name == "engine loop":
                table = runs
    print()
    for name, (run, report) in results.items():
        print(summary_line(name, run, report))
    bench.print_table(bench.summary(model, args, device, single, table))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "multiturn_trace.json"), "w") as handle:
            json.dump({name: dict(stats=run["stats"], **report) for name, (run, report) in results.items()}, handle,
                      default=str)


if __name__ == "__main__":
    main()
