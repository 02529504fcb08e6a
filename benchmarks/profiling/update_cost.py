"""Where the update's time goes at short sequences (issue 31's time-to-accuracy shape): the first update and a
steady one of the real trainer, 358M-parameter Qwen2.5-0.5B body with the demo's character vocabulary, 32 prompts x
8 samples of ~6 prompt + 6 new tokens, one micro-batch, no KL, one optimizer step per batch.

    python -m benchmarks.profiling.update_cost            # one GPU, random init (no SFT): ~1 minute
    python -m benchmarks.profiling.update_cost --tiny     # CPU, a tiny body: that it runs
    python -m benchmarks.profiling.update_cost --compare-graphs   # eager against CUDA graphs, alternating

Printed: each step's phases (`timing/*`); the first update's Python profile (cumulative seconds per function: what
compiles or warms up) and torch.compile's frame counters; then one steady batch updated `--repeats` times
(device-synchronised, median) with the allocator's cache kept and emptied before each (as after a
rollout), alternating, the host syncs one steady update makes (`torch.cuda.set_sync_debug_mode`) and a
torch.profiler table of one steady update (self CPU time per operation, and the kernels' GPU time), with the
update's wall time against its GPU busy time. At this size the update is bound by the host, so the gap between the
two is what fewer launches, passes and syncs can win. `--compare-graphs` builds the trainer with `actor.cuda_graphs=true`
(`training/graphed_pass.py`) and alternates the steady updates between its graphs and the eager pass (the runner
taken away), then syncs and profiles both."""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import time
import warnings
from pathlib import Path

import torch

from benchmarks.learning_vs_trl import hybridrl_trainer
from benchmarks.time_to_accuracy import build_model
from hybridrl.data.tasks import write_arithmetic_task


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def trainer_for(args: argparse.Namespace):
    """time_to_accuracy.py's hybridrl side on a random model of its body (the update's cost does not depend on
    what the weights learned)."""
    out = Path(args.out_dir)
    data = write_arithmetic_task(out / "data", num_train=2000, num_eval=16, period_rate=0.5)
    model_dir = out / f"model_{args.body}"
    if not (model_dir / "config.json").is_file():
        build_model(args.body, args.device, model_dir)
    spec = dict(model=str(model_dir), train_path=str(data["train"]), seed=0, steps=1000, prompts_per_step=32,
                group_size=8, lr=1e-6, temperature=1.0, max_new_tokens=6, device=args.device,
                out_dir=str(out / "run"), hybridrl_overrides=["rollout.kv_cache_memory=2", *args.overrides])
    return hybridrl_trainer(spec)


def profiled_once(function, top: int):
    """`function` wrapped so that its first call runs under cProfile and prints the `top` functions by cumulative
    time (what the first update compiles, loads or allocates)."""
    state = {"done": False}

    def wrapper(*args, **kwargs):
        if state["done"]:
            return function(*args, **kwargs)
        state["done"] = True
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            return function(*args, **kwargs)
        finally:
            synchronize()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
            print("first update, cumulative seconds per function:\n" + text.getvalue(), flush=True)

    return wrapper


def steady_batch(trainer):
    """A fresh rollout, scored, with its log-prob passes and advantages: what `trainer.update` takes."""
    prompts = trainer.parts.dataset.batch(next(trainer.sampler))
    batch, _ = trainer.rollout(prompts)
    trainer.score(batch, prompts)
    trainer.compute_logprobs(batch)
    trainer.compute_advantages(batch)
    return batch


def timed_update(trainer, batch, empty_cache_first: bool = False) -> tuple[float, int]:
    """Seconds of one update of a copy of `batch` (device-synchronised), and the segments the allocator took from
    the driver meanwhile (cudaMalloc calls). `empty_cache_first`: the allocator's cache handed back before it, as
    the trainer's phase switch and the engine's release do after each rollout."""
    if empty_cache_first and torch.cuda.is_available():
        torch.cuda.empty_cache()
    synchronize()
    segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0
    start = time.perf_counter()
    trainer.update(copy.copy(batch))
    synchronize()
    seconds = time.perf_counter() - start
    if torch.cuda.is_available():
        segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) - segments
    return seconds, segments


def timed_updates(trainer, batch, repeats: int) -> dict[str, list[tuple[float, int]]]:
    """Updates with the allocator's cache kept and emptied before each, alternating."""
    runs = {"cache kept": [], "cache emptied first": []}
    for _ in range(repeats):
        runs["cache kept"].append(timed_update(trainer, batch))
        runs["cache emptied first"].append(timed_update(trainer, batch, empty_cache_first=True))
    return runs


def graph_modes(trainer) -> dict:
    """`--compare-graphs`: the trainer's graph runner (`parts.actor_graphs`) on and taken away (eager)."""
    return {"CUDA graphs": trainer.parts.actor_graphs, "eager": None}


def timed_graph_modes(trainer, batch, repeats: int) -> dict[str, list[tuple[float, int]]]:
    """Updates with the graph runner and without, alternating (the same trainer, batch and process)."""
    modes = graph_modes(trainer)
    runs = {name: [] for name in modes}
    for _ in range(repeats):
        for name, runner in modes.items():
            trainer.parts.actor_graphs = runner
            runs[name].append(timed_update(trainer, batch))
    trainer.parts.actor_graphs = modes["CUDA graphs"]
    return runs


def count_syncs(trainer, batch) -> int:
    """Host syncs of one update, as torch's sync debug mode warns about them (CUDA only; -1 elsewhere)."""
    if not torch.cuda.is_available():
        return -1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.update(copy.copy(batch))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronize()
    lines = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    for line, count in sorted({line: lines.count(line) for line in lines}.items(), key=lambda item: -item[1])[:10]:
        print(f"  sync x{count}: {line}")
    return len(lines)


def profile_table(trainer, batch, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    synchronize()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        trainer.update(copy.copy(batch))
        synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows))
    if gpu:
        print(events.table(sort_by="self_device_time_total", row_limit=rows // 2))
        busy = sum(e.self_device_time_total for e in events) / 1e6
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        print(f"profiled update: wall {wall:.3f} s, GPU busy {busy:.3f} s, kernel launches {launches}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, a tiny body: checks the script")
    parser.add_argument("--steps", type=int, default=6, help="trainer steps before the steady measurement")
    parser.add_argument("--repeats", type=int, default=10, help="updates of the steady batch timed")
    parser.add_argument("--rows", type=int, default=30, help="rows of the profiler table")
    parser.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--no-cudnn-attention", action="store_true",
                        help="torch.backends.cuda.enable_cudnn_sdp(False): SDPA picks flash or memory-efficient "
                             "attention instead of cuDNN's (whose kernels are built at a shape's first call)")
    parser.add_argument("--compare-graphs", action="store_true",
                        help="actor.cuda_graphs=true, and the steady updates alternate graphs and eager")
    parser.add_argument("--out-dir", default="runs/update_cost")
    args = parser.parse_args(argv)
    if args.compare_graphs:
        args.overrides = [*args.overrides, "actor.cuda_graphs=true"]
    args.body, args.device = ("tiny", "cpu") if args.tiny else ("0.5b", "cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        args.steps, args.repeats = min(args.steps, 2), min(args.repeats, 2)
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    start = time.perf_counter()
    trainer = trainer_for(args)
    print(f"trainer built in {time.perf_counter() - start:.1f} s", flush=True)
    trainer.update = profiled_once(trainer.update, args.rows)
    for step in range(1, args.steps + 1):
        metrics = trainer.step()
        synchronize()
        print(f"step {step}: " + ", ".join(f"{key[len('timing/'):]} {float(value):.3f}" for key, value in
                                           metrics.items() if key.startswith("timing/")), flush=True)
        if step == 1:
            from torch._dynamo.utils import counters
            print("torch.compile frames after step 1:", dict(counters["frames"]), flush=True)
    batch = steady_batch(trainer)
    print(f"steady batch: {tuple(batch.input_ids.shape)}, {int(batch.attention_mask.sum())} real tokens, "
          f"response width {batch.response_length}")
    timed = timed_graph_modes if args.compare_graphs else timed_updates
    for name, runs in timed(trainer, batch, args.repeats).items():
        seconds = [run[0] for run in runs]
        print(f"steady update, {name}: median {statistics.median(seconds):.4f} s, min {min(seconds):.4f} s over "
              f"{len(seconds)}; cudaMalloc segments per update {statistics.median(run[1] for run in runs):.0f}",
              flush=True)
    modes = graph_modes(trainer) if args.compare_graphs else {"": trainer.parts.actor_graphs}
    for name, runner in modes.items():
        trainer.parts.actor_graphs = runner
        print(f"{name or 'this'} update: host syncs in one update: {count_syncs(trainer, batch)}")
        profile_table(trainer, batch, args.rows)


if __name__ == "__main__":
    main()
