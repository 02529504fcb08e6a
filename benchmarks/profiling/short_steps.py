"""Where the time of short GRPO steps goes: the time-to-accuracy run's first step (engine set-up) and its fixed cost
per step, on the TTA's model shape and settings.

    python -m benchmarks.profiling.short_steps                      # one GPU: 8 steps, profiles, cold compile caches
    python -m benchmarks.profiling.short_steps --profile none       # the same, without the profiler's overhead
    python -m benchmarks.profiling.short_steps --tiny               # CPU, a tiny model: checks the script
    python -m benchmarks.profiling.short_steps --evaluate-first     # step 1 as in the TTA run: after an evaluation

The model is `time_to_accuracy.py`'s (the Qwen2.5-0.5B body with the demo's character tokenizer), random init (no
SFT: the step's cost does not depend on what the model knows, only on how long its responses are, and the demo caps
them at 6 tokens), and the trainer is the TTA's own (`learning_vs_trl.hybridrl_trainer` with the TTA's settings:
32 prompts x 8 samples, 6 new tokens, its `--hybridrl-overrides`). Printed:

1. per step: the rollout and, inside it, everything before the first decode step, split into the engine's set-up
   (`ModelRunner.begin`: weights, KV cache, state), the prefill, the decode graph's warm-up run and its capture, with
   the compilation (dynamo + inductor) and Triton JIT time (kernels and their C launchers) that happened inside them
   taken out and shown apart (each part exclusive of the others; "other" is what no part covers: the host work
   between them and the GPU trailing at the first replay); then the decode, the reward, the log-probs and the update;
   each compiled frame and Triton kernel is listed under its step;
2. a torch.profiler top-20 (self CPU time, and self CUDA time on a GPU) of the phases named by `--profile` (default:
   step 1's rollout and update, the last step's rollout and update). A profiled phase is slower than it would be:
   its row in the table is marked.

The compile caches (inductor's, Triton's) start empty unless `--warm-cache`: a user's first run pays for them, and a
warm cache from an earlier run would hide that. `--evaluate-first` runs the TTA's held-out evaluation (HF `generate`,
greedy, on 64 rows; untimed) before step 1, as the TTA run does: the process's first cuBLAS and SDPA calls then
happen there, not in the first rollout. JSON goes to $OUT/short_steps.json (else <out-dir>/short_steps.json).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks import time_to_accuracy as tta
from benchmarks.greedy_accuracy import greedy_accuracy, read_rows
from benchmarks.learning_vs_trl import hybridrl_trainer, spec_for
from hybridrl.data.tasks import write_arithmetic_task
from hybridrl.cli import DEMO_TEACHERS
from hybridrl.rollout.engine.graphs import DecodeGraphs
from hybridrl.rollout.engine.runner import ModelRunner
from hybridrl.rollout.timeline import phase_seconds

PARTS = ("set-up", "prefill", "warm-up run", "capture", "compile", "triton")
"""The parts of a rollout's time before its first decode step, each exclusive of the others."""
PHASES = ("rollout", "reward", "logprobs", "advantages", "update")


class Clocks:
    """Seconds spent in each kind of work, per trainer phase, from wrappers around the functions that do it. Nested
    timed calls are exclusive: a warm-up run that compiles counts its compilation as `compile`, not as its own."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.items: list[tuple[str, str, str, float]] = []  # (phase, kind, what, seconds) of the labelled kinds
        self.phase = "outside"
        self._children: list[float] = []  # per open timed call: the seconds its timed callees took

    def timed(self, kind: str, function, label=None):
        """`function` timed as `kind`; `label(args)` names each call in `items` (which frame, which kernel)."""
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            self._children.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = self._children.pop()
                self.seconds[(self.phase, kind)] += elapsed - inner
                if label is not None:
                    self.items.append((self.phase, kind, label(args), elapsed - inner))
                if self._children:
                    self._children[-1] += elapsed

        return wrapper

    def wrap(self, owner, name: str, kind: str, label=None) -> bool:
        """Time `owner.name` as `kind`; False when `owner` has no such attribute (another torch or Triton version)."""
        if name not in vars(owner):
            return False
        setattr(owner, name, self.timed(kind, getattr(owner, name), label))
        return True

    def take(self) -> tuple[dict[tuple[str, str], float], list[tuple[str, str, str, float]]]:
        """The seconds and labelled items since the last `take`, and start again from zero."""
        seconds, items, self.seconds, self.items = dict(self.seconds), self.items, defaultdict(float), []
        return seconds, items


def frame_name(args) -> str:
    """dynamo's `_compile(code, ...)`: the function it compiles."""
    code = args[0] if args else None
    return f"{getattr(code, 'co_name', '?')} ({Path(getattr(code, 'co_filename', '?')).name})"


def launcher_name(args) -> str:
    """`CudaLauncher.__init__(self, src, metadata)`: the launcher of the kernel `src` was compiled from."""
    return "launcher of " + getattr(getattr(args[1], "fn", None), "__name__", "?") if len(args) > 1 else "?"


def kernel_name(args) -> str:
    """`JITFunction._do_compile(self, ...)`: the Triton kernel it builds."""
    return getattr(getattr(args[0], "fn", None), "__name__", "?") if args else "?"


@contextlib.contextmanager
def instrumented(clocks: Clocks):
    """Wrap the functions that do one-off work for the duration; yields what could not be wrapped (reported as
    missing: another torch or Triton version)."""
    import torch._dynamo.convert_frame as convert_frame

    targets = [(ModelRunner, "begin", "set-up", None), (ModelRunner, "prefill", "prefill", None),
               (DecodeGraphs, "warm_up", "warm-up run", None), (DecodeGraphs, "capture", "capture", None),
               (convert_frame, "_compile", "compile", frame_name)]  # dynamo's entry for one frame: tracing, inductor
    try:
        from triton.runtime.jit import JITFunction

        # a hand-written kernel's first launch per signature
        targets.append((JITFunction, "_do_compile", "triton", kernel_name))
        from triton.backends.nvidia.driver import CudaLauncher

        # its launcher, a C module built (or loaded from the cache) at the kernel's first run, after `_do_compile`
        targets.append((CudaLauncher, "__init__", "triton", launcher_name))
    except ImportError:
        pass
    originals = [(owner, name, vars(owner)[name]) for owner, name, *_ in targets if name in vars(owner)]
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, kind, label in targets
               if not clocks.wrap(owner, name, kind, label)]
    try:
        yield missing
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def profiled_phases(spec: str, steps: int) -> set[tuple[int, str]]:
    """`--profile`'s "1:rollout,last:update" as {(1, "rollout"), (steps, "update")}; "none" is empty."""
    if spec == "none":
        return set()
    chosen = set()
    for item in spec.split(","):
        step, _, phase = item.partition(":")
        if phase not in ("rollout", "update") or not (step == "last" or step.isdigit()):
            raise SystemExit(f"--profile takes STEP:PHASE items (STEP a number or 'last', PHASE rollout or update) "
                             f"separated by commas, or 'none'; got {item!r}.")
        chosen.add((steps if step == "last" else int(step), phase))
    return chosen


def print_profile(prof, title: str, cuda: bool, top: int = 20) -> None:
    averages = prof.key_averages()
    sorts = [("self CPU time", "self_cpu_time_total")]
    if cuda:
        sorts.append(("self CUDA time", "self_device_time_total"))
    for what, key in sorts:
        print(f"\n{title}: top {top} by {what}")
        print(averages.table(sort_by=key, row_limit=top, max_name_column_width=60))


def watch_phases(trainer, clocks: Clocks, profile: set[tuple[int, str]], cuda: bool) -> None:
    """Set `clocks.phase` around the trainer's phase methods, and profile the chosen (step, phase) pairs."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for phase, name in (("rollout", "rollout"), ("logprobs", "compute_logprobs"), ("update", "update")):
        method = getattr(trainer, name)

        def watched(*args, _method=method, _phase=phase, **kwargs):
            clocks.phase = _phase
            try:
                if (trainer.step_count, _phase) not in profile:
                    return _method(*args, **kwargs)
                with torch_profile(activities=activities) as prof:
                    result = _method(*args, **kwargs)
                    if cuda:
                        torch.cuda.synchronize()
                print_profile(prof, f"step {trainer.step_count} {_phase}", cuda)
                return result
            finally:
                clocks.phase = "outside"

        setattr(trainer, name, watched)


def step_row(step: int, metrics: dict, engine: dict, seconds: dict, profiled: set[str]) -> dict:
    """One step's figures: the phases' seconds, the rollout's split (`timeline.phase_seconds`) and the parts before
    its first decode step."""
    row = {"step": step, "profiled": sorted(profiled)}
    row.update({phase: metrics.get(f"timing/{phase}_s", 0.0) for phase in PHASES})
    split = phase_seconds(engine.get("timeline_ms", {}))
    row.update(split)
    parts = {part: seconds.get(("rollout", part), 0.0) for part in PARTS}
    row["parts"] = parts
    if split:
        row["parts"]["other"] = split["before_decode"] - sum(parts.values())
        row["outside_engine"] = row["rollout"] - sum(split.values())  # weight switch, batch building, texts
    row["update_compile"] = seconds.get(("update", "compile"), 0.0) + seconds.get(("logprobs", "compile"), 0.0)
    row["update_triton"] = seconds.get(("update", "triton"), 0.0) + seconds.get(("logprobs", "triton"), 0.0)
    row["timing"] = {key: value for key, value in metrics.items() if key.startswith("timing/")}
    row["engine"] = {key: engine.get(key) for key in ("graphs_captured", "graphs_kept", "captures_without_warmup",
                                                      "warmup_s",
                                                      "compiled", "attention", "sampler", "num_slots", "decode_steps")}
    return row


def print_table(rows: list[dict]) -> None:
    columns = ["rollout", "before_decode", *PARTS, "other", "decode", "after_decode", "outside eng.", "reward",
               "logprobs", "update", "upd compile", "upd triton"]
    print("\nseconds per step (* a profiled phase: slower than unprofiled); 'before_decode' = set-up + prefill + "
          "warm-up run + capture + compile + triton + other")
    print(f"{'step':>4} " + " ".join(f"{name:>13}" for name in columns))
    for row in rows:
        values = [row["rollout"], row.get("before_decode"), *(row["parts"].get(p) for p in [*PARTS, "other"]),
                  row.get("decode"), row.get("after_decode"), row.get("outside_engine"), row["reward"], row["logprobs"],
                  row["update"], row["update_compile"], row["update_triton"]]
        cells = [f"{value:13.4f}" if value is not None else f"{'-':>13}" for value in values]
        mark = "*" if row["profiled"] else " "
        print(f"{row['step']:>3}{mark} " + " ".join(cells))
    if len(rows) > 2:
        steady = [row for row in rows[1:] if not row["profiled"]] or rows[1:]
        print(f"median of steps 2+ (unprofiled ones): rollout {statistics.median(r['rollout'] for r in steady):.4f} s, "
              f"before decode {statistics.median(r.get('before_decode', 0.0) for r in steady):.4f} s, update "
              f"{statistics.median(r['update'] for r in steady):.4f} s, step "
              f"{statistics.median(r['timing'].get('timing/step_s', 0.0) for r in steady):.4f} s")
    first = rows[0]
    print(f"step 1 engine: {first['engine']}")
    print(f"step {rows[-1]['step']} engine: {rows[-1]['engine']}")
    print(f"step 1 other timing keys: { {k: round(v, 4) for k, v in first['timing'].items()} }")


def timed_step(trainer, clocks: Clocks, step: int, profile: set[tuple[int, str]], cuda: bool,
               cprofile_top: int = 0) -> dict:
    """One trainer step, its phases split by `clocks`; under cProfile (its `cprofile_top` costliest functions
    printed) when that is not 0."""
    clocks.take()
    profiler = cProfile.Profile() if cprofile_top else None
    with profiler or contextlib.nullcontext():
        metrics = trainer.step()
        if cuda:
            torch.cuda.synchronize()
    if profiler is not None:
        for order in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(cprofile_top)
            print(f"step {step} under cProfile, by {order}:\n" + text.getvalue().split("\n\n", 1)[-1], flush=True)
    engine = getattr(trainer.parts.rollout, "last_stats", None) or {}
    seconds, items = clocks.take()
    row = step_row(step, {k: float(v) for k, v in metrics.items() if k.startswith("timing/")}, engine, seconds,
                   {phase for s, phase in profile if s == step})
    row["compiled"] = [{"phase": phase, "kind": kind, "what": what, "seconds": round(took, 4)}
                       for phase, kind, what, took in items]
    print(f"step {step}: rollout {row['rollout']:.3f} s, update {row['update']:.3f} s", flush=True)
    for phase, kind, what, took in items:
        print(f"    {phase} {kind}: {what} {took:.3f} s")
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", default="1:rollout,1:update,last:rollout,last:update",
                        help="STEP:PHASE items to profile (STEP a number or 'last'; PHASE rollout or update), "
                             "or 'none'")
    parser.add_argument("--warm-cache", action="store_true",
                        help="keep inductor's and Triton's default cache directories (default: fresh, empty ones)")
    parser.add_argument("--evaluate-first", action="store_true",
                        help="evaluate 64 held-out rows (HF generate, untimed) before step 1, as the TTA run does")
    parser.add_argument("--out-dir", default="runs/short_steps")
    parser.add_argument("--model-dir", default=None,
                        help="load this saved model (as the TTA's workers do) instead of building a random one here")
    parser.add_argument("--cprofile-step1", type=int, default=0, metavar="N",
                        help="run step 1 under cProfile and print its N costliest functions (cumulative and own "
                             "time); slows step 1's Python work")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the script")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="more hybridrl config overrides, after the TTA's (e.g. rollout.engine.compile=false)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1.")
    if not args.warm_cache:  # both are read when first needed, after this
        scratch = tempfile.mkdtemp(prefix="short_steps_cache_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{scratch}/inductor"
        os.environ["TRITON_CACHE_DIR"] = f"{scratch}/triton"
    settings = tta.parse_args(["--tiny"] if args.tiny else [])
    # On CPU `auto` picks the hf backend; the tiny run checks the engine's path (uncompiled, no CUDA graphs)
    engine = ["rollout.backend=builtin"] if args.tiny else []
    settings.hybridrl_overrides = [*settings.hybridrl_overrides, *engine, *args.overrides]
    out = Path(args.out_dir).resolve() / ("tiny" if args.tiny else settings.body)
    cuda = settings.device == "cuda"
    started = time.perf_counter()
    data = write_arithmetic_task(out / "data", **DEMO_TEACHERS["arithmetic"],
                                 **({"num_train": 64, "num_eval": 16} if args.tiny else {}))
    model_dir = Path(args.model_dir) if args.model_dir else out / "init"
    params = None if args.model_dir else tta.build_model(settings.body, settings.device, model_dir)
    if cuda:
        torch.cuda.empty_cache()
    settings.steps = args.steps
    spec = {**spec_for(settings, 0, model_dir, data), "device": settings.device, "out_dir": str(out / "run")}
    trainer = hybridrl_trainer(spec)
    params = params or sum(p.numel() for p in trainer.parts.actor.parameters())
    print(f"{settings.body} body, {params / 1e6:.1f}M parameters on {settings.device}; "
          f"{settings.prompts_per_step} prompts x {settings.group_size} samples, {settings.max_new_tokens} new tokens; "
          f"overrides {settings.hybridrl_overrides}; compile caches {'warm' if args.warm_cache else 'fresh'}; "
          f"ready after {time.perf_counter() - started:.1f} s", flush=True)
    if args.evaluate_first:
        started_evaluation = time.perf_counter()
        accuracy = greedy_accuracy(trainer.parts.actor, trainer.parts.tokenizer, read_rows(data["eval"])[:64],
                                   settings.max_new_tokens)
        if cuda:
            torch.cuda.synchronize()
        print(f"evaluated first (untimed): accuracy {accuracy:.3f} in {time.perf_counter() - started_evaluation:.2f} s",
              flush=True)
    clocks, profile = Clocks(), profiled_phases(args.profile, args.steps)
    watch_phases(trainer, clocks, profile, cuda)
    with instrumented(clocks) as missing:
        if missing:
            print(f"not timed (not found in this torch/triton): {', '.join(missing)}")
        rows = [timed_step(trainer, clocks, step, profile, cuda, args.cprofile_step1 if step == 1 else 0)
                for step in range(1, args.steps + 1)]
    print_table(rows)
    report = {"args": vars(args), "date": time.strftime("%Y-%m-%d"), "params": params, "not_timed": missing,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "steps": rows}
    path = Path(os.environ["OUT"]) / "short_steps.json" if os.environ.get("OUT") else out / "short_steps.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"JSON in {path}; {time.perf_counter() - started:.1f} s in all")
    return report


if __name__ == "__main__":
    main()
