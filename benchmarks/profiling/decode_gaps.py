"""Where a rollout's GPU idle time goes: the engine (fused q/k/v and gate/up, RoPE in the attention kernel) on
the grpo-0.5b shape of `rollout.py`, timed with several `sync_every` values (decode steps between host checks
for finished sequences; while the host checks, the GPU waits), then one profiled run whose idle gaps between
kernels are summed by size and by the pair of kernels around them, and its GPU time by kernel (per decode step).

    python -m benchmarks.profiling.decode_gaps [--sync-every 16,64,256] [--response-len 256]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.profiling.gaps import cuda_events, gap_report, host_work_in_gaps, kernel_table
from benchmarks.rollout import build_model, time_engine, timeline_line
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--sync-every", default="16,64,256", help="values to time, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-profile", action="store_true", help="skip the two profiled runs")
    return parser.parse_args()


def profile_gaps(engine: BuiltinBackend, prompts, params) -> None:
    """Two profiled runs: GPU activity only for the gap sizes (tracing the CPU too stretches the gaps), then
    both, to name the host operations running during the largest gaps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    kernels = cuda_events(prof)[0]
    gap_report(kernels)
    kernel_table(kernels, per=params.max_new_tokens)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    print("host operations during the largest gaps of a run traced on the CPU too (us of overlap):")
    host_work_in_gaps(*cuda_events(prof))
    one_token = SamplingParams(max_new_tokens=1, temperature=params.temperature, n=params.n, seed=0, ignore_eos=True)
    engine.generate(prompts, one_token)  # the KV geometry differs: compile and warm outside the profile
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, one_token)
        torch.cuda.synchronize()
    print("the prefill alone (a call with max_new_tokens=1):")
    kernel_table(cuda_events(prof)[0], top=20)


def main() -> None:
    args = parse_args()
    model = build_model("cuda")
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (args.prompts, args.prompt_len), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=args.response_len, temperature=1.0, n=args.n, seed=0, ignore_eos=True)
    rows = []
    for sync_every in (int(value) for value in args.sync_every.split(",")):
        engine = BuiltinBackend(model, attention="triton", fuse_qkv=True, fuse_gate_up=True, sync_every=sync_every)
        result = time_engine(engine, prompts, params, args.repeats)
        rows.append((sync_every, result["seconds"], result["tokens_per_s"]))
        print(f"sync_every {sync_every}: {result['seconds']:.3f} s, {result['tokens_per_s']:,.0f} tok/s", flush=True)
        print("  " + timeline_line(result["stats"]), flush=True)
        if sync_every == int(args.sync_every.split(",")[0]) and not args.no_profile:
            profile_gaps(engine, prompts, params)
    print(f"\n{'sync_every':>10} {'seconds':>8} {'tok/s':>10}")
    for sync_every, seconds, tokens_per_s in rows:
        print(f"{sync_every:>10} {seconds:>8.3f} {tokens_per_s:>10,.0f}")


if __name__ == "__main__":
    main()
