"""long-tail: rollout with long, uneven responses, the paged KV cache against the contiguous one, with the floor.

    python -m benchmarks.long_tail                     # Qwen2.5-1.5B shape, 64 prompts x 8, prompt 512, GPU
    python -m benchmarks.long_tail --tiny              # CPU: a 2-layer model and short lengths; checks the script
    python -m benchmarks.long_tail --shape grpo-0.5b --prompt-len 256 --median 256 --sigma 0 --cap 256 \
        --kv-cache-memory 3.2 --repeats 3                  # the grpo-0.5b rollout (every response 256 tokens)

The model is (`--shape 1.5b`, the default) Qwen2.5-1.5B-shaped (hidden 1536, intermediate 8960, 28 layers, 12 heads,
2 KV heads, vocab 151936, tied embeddings), random init, bf16. Each of the 512 responses gets its own length, drawn
once (seeded) from a log-normal with median `--median` (1,024) and shape `--sigma` (1.0), clipped to [`--min-len`,
`--cap`] (8,192), and is forced to exactly that length (`ignore_eos` + `generate(response_lengths=)`), sampled at
temperature 1. That is the shape of reasoning RL: most responses around a thousand tokens, a few running to the cap.
`--shape grpo-0.5b` is the reference benchmark's model (Qwen2-0.5B-shaped, `benchmarks/rollout.py`); with `--sigma
0` every response is `--median` tokens long, so the line above times the grpo-0.5b rollout on both layouts (its KV
budget, 3.2 GiB, is the GRPO step's: `benchmarks/grpo_step.py`).

Both layouts get the same KV budget (`--kv-cache-memory`, a fraction of free GPU memory) and the engine's other
defaults (compiled, CUDA graphs, prefix-shared Triton attention for `contiguous`, which is today's GPU default).
`contiguous` sizes every slot for the longest possible response, so the budget holds far fewer sequences at once;
`paged` holds blocks only for the tokens sequences have actually produced. Each layout first runs a warm-up call
on the same batch and response capacity whose forced lengths halve the live sequences every two syncs once none
waits, whatever the layout's slot count (`warm_up_lengths`), so it visits every batch-size bucket: the compilations, CUDA graphs and split-KV kernel variants
(their split count depends on the batch) that the timed call needs are made there, as a trainer's first step makes
them for the rest (`warmup_s` in the table: what the timed call still spent on them). The timed calls then alternate
between the layouts (`--repeats` each), so a shared machine's load hits both alike; the best of each is reported.

The floor is computed, not measured, as in `benchmarks/rollout.py`: a decode step must read the weights once and
each live sequence's KV for its context (prompt KV counted per sequence), and do 2 * params FLOPs per live sequence;
it costs max(bytes / bandwidth, flops / peak). Here the live sequences thin out step by step as the drawn lengths
end, so the floor includes the tail, where a step reads the weights for a handful of sequences. Prefill: 2 * params
FLOPs per distinct prompt token. Defaults are the H200's figures from DESIGN.md (4.2 TB/s, 785 TFLOP/s).

GPU busy share: a thread samples NVML's utilisation (the share of time a kernel ran) every 50 ms during each timed
call; the table prints the mean over each quarter of the call's wall time, so the last quarter shows how busy the
tail keeps the GPU. On CPU (or without NVML) it prints n/a.

Prints a table last; writes JSON to $OUT/long_tail.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time

import numpy as np
import torch

from benchmarks.rollout import GRPO_05B, TINY, build_model, sync
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend

QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936)
"""Qwen2.5-1.5B's shape (tied embeddings)."""
SHAPES = {"1.5b": QWEN25_15B, "grpo-0.5b": GRPO_05B}
LAYOUTS = ("contiguous", "paged")


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The long-tail batch: prompts x n, prompt length, and the log-normal draw of forced response lengths."""
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--median", type=int, default=1024, help="median response length")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal shape of the response lengths")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--cap", type=int, default=8192, help="longest response (max_new_tokens)")


def apply_tiny_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace, values: dict) -> None:
    """`--tiny`: the given values replace the defaults the user did not set."""
    for name, value in values.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_tail", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_batch_arguments(parser)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b", help="the model's shape")
    parser.add_argument("--kv-cache-memory", type=float, default=0.3)
    parser.add_argument("--block-size", type=int, default=64, help="tokens per block of the paged cache")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per layout (alternating)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of contiguous,paged")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.2)
    parser.add_argument("--peak-tflops", type=float, default=785.0)
    parser.add_argument("--tiny", action="store_true", help="CPU: a 2-layer model, 4 prompts x 2, short lengths")
    parser.add_argument("--trace", action="store_true",
                        help="CUDA: time each decode window's GPU work, the GPU gaps between windows and the host "
                             "phases, by batch bucket (benchmarks/profiling/window_trace.py)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tiny:
        apply_tiny_defaults(parser, args, dict(prompts=4, n=2, prompt_len=16, median=8, min_len=2, cap=32, block_size=8))
    return args


def response_lengths(num_sequences: int, median: int, sigma: float, low: int, cap: int, seed: int = 0) -> list[int]:
    """Log-normal lengths with the given median, clipped to [low, cap]; one draw per sequence, seeded."""
    draws = median * np.exp(sigma * np.random.default_rng(seed).standard_normal(num_sequences))
    return np.clip(np.round(draws), low, cap).astype(int).tolist()


def warm_up_lengths(num_sequences: int, sync_every: int, cap: int) -> list[int]:
    """Forced lengths whose call passes through every batch-size bucket, however many slots the layout has: the
    r-th sequence from the end (r = n - 1 - i) runs 2 + 2 * sync_every * (bit_length(n - 1) - bit_length(r)) tokens
    (at most `cap`), so once none waits the live ones halve every two windows, to 2^k of them each time, down to one.

    The last sequences run longest because a layout with fewer slots than sequences refills its slots in
    prompt-major order: only the sequences admitted last decide which buckets the call's tail passes through (with
    the first ones longest, the contiguous layout's 180 of 512 slots stayed full until a few sequences were left, so
    buckets 64, 32 and 16 were first built inside the timed call). Two windows per halving because such a layout
    admits those last sequences over two consecutive windows. `tests/test_builtin_engine_warm_up.py` checks every
    slot count."""
    top = (num_sequences - 1).bit_length()
    return [min(cap, 2 + 2 * sync_every * (top - (num_sequences - 1 - i).bit_length())) for i in range(num_sequences)]


def read_bytes(model) -> tuple[int, int]:
    """(weight bytes, KV bytes per token in bf16): what a decode step reads once, and per token of context."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return (sum(p.numel() * p.element_size() for p in model.parameters()),
            config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2)


def floor(model, num_prompts: int, prompt_len: int, lengths: list[int], bandwidth: float, peak: float) -> dict:
    """The computed floor (see the module docstring) for responses of the given lengths."""
    params = sum(p.numel() for p in model.parameters())
    weight_bytes, kv_bytes_per_token = read_bytes(model)
    prefill = max(2 * params * num_prompts * prompt_len / peak, weight_bytes / bandwidth)
    lengths_array = np.asarray(lengths)
    decode = 0.0
    for step in range(int(lengths_array.max()) - 1):  # the first token comes from the prefill logits
        live = int((lengths_array > step + 1).sum())
        step_bytes = weight_bytes + live * (prompt_len + 1 + step) * kv_bytes_per_token
        decode += max(step_bytes / bandwidth, 2 * params * live / peak)
    seconds = prefill + decode
    return dict(params=params, prefill_s=prefill, decode_s=decode, seconds=seconds,
                tokens_per_s=sum(lengths) / seconds)


class BusySampler:
    """NVML's GPU utilisation sampled on a thread while a call runs; `quarters` averages each quarter of it."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s, self.samples, self._stop = period_s, [], threading.Event()
        self.handle = None
        if torch.cuda.is_available():
            try:
                import pynvml

                pynvml.nvmlInit()
                self.handle, self.nvml = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()), pynvml
            except Exception as error:  # noqa: BLE001 - the figure is optional; say why it is missing
                print(f"GPU busy share unavailable: {error}", flush=True)

    def __enter__(self):
        self.samples, self._stop = [], threading.Event()
        if self.handle is not None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))
            time.sleep(self.period_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.handle is not None:
            self.thread.join()

    def quarters(self, parts: int = 4) -> list[float] | None:
        """The mean busy share over each of `parts` equal stretches of the call (quarters by default)."""
        if len(self.samples) < 2 * parts:
            return None
        times = np.array([t for t, _ in self.samples])
        busy = np.array([b for _, b in self.samples], dtype=float)
        edges = np.linspace(times[0], times[-1], parts + 1)
        return [float(busy[(times >= lo) & (times <= hi)].mean()) for lo, hi in zip(edges[:-1], edges[1:])]


def make_engine(model, layout: str, args) -> BuiltinBackend:
    return BuiltinBackend(model, kv_cache=layout, kv_block_size=args.block_size, kv_cache_memory=args.kv_cache_memory)


def timed_call(engine: BuiltinBackend, prompts, params, lengths, sampler: BusySampler, trace=None) -> dict:
    """One timed call; with `trace` (engine -> a context manager yielding a `WindowTrace`), also its window-by-window
    trace."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sync()
    tracing = trace(engine) if trace else contextlib.nullcontext()
    with sampler, tracing as windows:
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, response_lengths=lengths)
        sync()
        seconds = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in outputs)
    assert [len(g.token_ids) for g in outputs] == lengths, "a response did not run to its forced length"
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    stats = {key: engine.last_stats[key] for key in ("num_slots", "decode_steps", "prefill_waves", "kv_blocks",
                                                      "kv_blocks_peak", "preemptions", "preempted_tokens",
                                                      "refilled_tokens", "decoded_tokens",
                                                      "attention", "warmup_s")}
    result = dict(seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds, peak_gib=peak,
                  busy_quarters=sampler.quarters(), busy_twentieths=sampler.quarters(20), stats=stats)
    if windows is not None:
        result["windows"] = windows.summarize()
    return result


def run(args) -> dict:
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    model = build_model(device, TINY if args.tiny else SHAPES[args.shape])
    if args.tiny:
        model = model.float()
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=generator).tolist() for _ in range(args.prompts)]
    lengths = response_lengths(args.prompts * args.n, args.median, args.sigma, args.min_len, args.cap)
    params = SamplingParams(max_new_tokens=args.cap, n=args.n, temperature=1.0, ignore_eos=True, seed=0)
    layouts = [layout for layout in args.layouts.split(",") if layout]
    engines = {layout: make_engine(model, layout, args) for layout in layouts}
    sampler = BusySampler()
    first_call_s = {}
    for layout, engine in engines.items():  # compile, capture, build kernels
        sync()
        start = time.perf_counter()
        engine.generate(prompts, params, response_lengths=warm_up_lengths(len(lengths), engine.sync_every, args.cap))
        sync()
        first_call_s[layout] = time.perf_counter() - start
    runs: dict[str, list[dict]] = {layout: [] for layout in layouts}
    trace = None
    if args.trace:
        from benchmarks.profiling.window_trace import traced

        trace = lambda engine: traced(engine, *read_bytes(model), args.bandwidth_tbs * 1e12)  # noqa: E731
    for _ in range(args.repeats):
        for layout, engine in engines.items():
            result = timed_call(engine, prompts, params, lengths, sampler, trace)
            runs[layout].append(result)
            print(f"{layout}: {result['seconds']:.2f} s (warmup_s {result['stats']['warmup_s']:.2f})", flush=True)
            if result.get("windows"):  # printed at once: a run cut short still leaves it
                from benchmarks.profiling.window_trace import print_summary

                print_summary(layout, result["windows"])
    best = {layout: min(results, key=lambda r: r["seconds"]) | dict(first_call_s=first_call_s[layout])
            for layout, results in runs.items()}
    bound = floor(model, args.prompts, args.prompt_len, lengths, args.bandwidth_tbs * 1e12, args.peak_tflops * 1e12)
    for result in best.values():
        result["percent_of_floor"] = 100 * bound["seconds"] / result["seconds"]
    return dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", args=vars(args),
                lengths=dict(total=sum(lengths), median=float(np.median(lengths)), mean=float(np.mean(lengths)),
                             max=max(lengths), at_cap=sum(length == args.cap for length in lengths)),
                floor=bound, layouts=best)


def print_table(result: dict) -> None:
    lengths, bound = result["lengths"], result["floor"]
    shape = "tiny" if result["args"]["tiny"] else result["args"]["shape"]
    print(f"\nlong-tail ({shape} shape) on {result['device']}: {result['args']['prompts']} prompts x "
          f"{result['args']['n']}, prompt {result['args']['prompt_len']}; response lengths median "
          f"{lengths['median']:.0f}, mean {lengths['mean']:.0f}, max {lengths['max']} ({lengths['at_cap']} at the cap), "
          f"{lengths['total']:,} tokens")
    header = ("layout", "seconds", "tokens/s", "% of floor", "warmup_s", "peak GiB", "slots", "blocks peak/all",
              "preempted", "GPU busy % by quarter")
    rows = [header]
    for layout, run in result["layouts"].items():
        stats, busy = run["stats"], run["busy_quarters"]
        rows.append((layout, f"{run['seconds']:.2f}", f"{run['tokens_per_s']:,.0f}", f"{run['percent_of_floor']:.1f}",
                     f"{stats['warmup_s']:.2f}", f"{run['peak_gib']:.1f}", str(stats["num_slots"]),
                     f"{stats['kv_blocks_peak']}/{stats['kv_blocks']}" if stats["kv_blocks"] else "-",
                     str(stats["preemptions"]), " ".join(f"{b:.0f}" for b in busy) if busy else "n/a"))
    rows.append(("floor (computed)", f"{bound['seconds']:.2f}", f"{bound['tokens_per_s']:,.0f}", "100", "-", "-", "-",
                 "-", "-", "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    for layout, run in result["layouts"].items():
        if run.get("busy_twentieths"):
            print(f"{layout}: GPU busy % by twentieth: " + " ".join(f"{b:.0f}" for b in run["busy_twentieths"]))
    if set(LAYOUTS) <= set(result["layouts"]):
        speedup = result["layouts"]["paged"]["tokens_per_s"] / result["layouts"]["contiguous"]["tokens_per_s"]
        print(f"paged / contiguous: {speedup:.2f}x tokens/s")


def main(argv: list[str] | None = None) -> None:
    result = run(parse_args(argv))
    print_table(result)
    if os.environ.get("OUT"):
        suffix = "" if result["args"]["shape"] == "1.5b" else f"_{result['args']['shape']}"
        with open(os.path.join(os.environ["OUT"], f"long_tail{suffix}.json"), "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
