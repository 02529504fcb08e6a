"""Engine options A/B in one process: the grpo-0.5b rollout of `rollout.py` (64 prompts x 8, prompt 256, response
256 forced, temperature 1) with each named set of `BuiltinBackend` options, run in turn (a, b, a, b, ...), so the
sets share the process, the GPU's clocks and the host (rollout times vary by a few percent between processes).

    python -m benchmarks.profiling.engine_ab default: sdpa:attention=sdpa [--rounds 4] [--prompts 32]
    python -m benchmarks.profiling.engine_ab kept:keep_runs=True fresh:keep_runs=False --tta   # the TTA's rollout

Each argument is NAME:OPTIONS, OPTIONS a comma-separated list of key=value (values parsed as Python literals where
they parse, else strings); every set starts from the defaults (with `--tta`, from the light rollout's: SDPA, the
PyTorch sampler, uncompiled). Each call is followed by `release_memory()`, as the trainer's rollout is. Prints every
run's seconds and each set's best and median, with the attention and sampler its stats report and the graphs it
captured and replayed from a kept run.

`--tta` is the time-to-accuracy run's rollout shape: the same body with a 64-token vocabulary (the character
tokenizer's size), 32 prompts x 8 of 4-7 tokens, 6 new tokens.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import time

import torch

from benchmarks.rollout import GRPO_05B, build_model, timeline_line
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend


def parse_option_set(text: str) -> tuple[str, dict]:
    """'graphs:attention=sdpa,sync_every=16' -> ('graphs', {'attention': 'sdpa', 'sync_every': 16})."""
    name, _, options = text.partition(":")
    parsed = {}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        try:
            parsed[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed[key] = value
    return name, parsed


TTA_OPTIONS = dict(attention="sdpa", compile=False, sampler="torch")
"""The light rollout's engine options (`kernel_choices.light_rollout`), which the TTA's trainer picks."""


def tta_rollout(device: str = "cuda") -> tuple:
    """The time-to-accuracy run's rollout: (model, prompts, sampling params); see the module docstring."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(device, {**GRPO_05B, "vocab_size": 64})
    lengths = torch.randint(4, 8, (32,), generator=generator).tolist()
    prompts = [torch.randint(1, 64, (length,), generator=generator).tolist() for length in lengths]
    return model, prompts, SamplingParams(max_new_tokens=6, temperature=1.0, n=8, seed=0, ignore_eos=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sets", nargs="+", help="NAME:key=value,... (one per engine)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per rollout (8 samples each)")
    parser.add_argument("--tta", action="store_true", help="the time-to-accuracy run's rollout shape (above)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/profiling/engine_ab.py needs a CUDA GPU.")
    if args.tta:
        (model, prompts, params), base = tta_rollout(), TTA_OPTIONS
        args.response_len = params.max_new_tokens
    else:
        model, base = build_model("cuda"), {}
        generator = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, model.config.vocab_size, (args.prompts, 256), generator=generator).tolist()
        params = SamplingParams(max_new_tokens=args.response_len, temperature=1.0, n=8, seed=0, ignore_eos=True)
    engines = {name: BuiltinBackend(model, **{**base, **options}) for name, options in map(parse_option_set, args.sets)}
    for engine in engines.values():  # compile, load kernels, capture once
        engine.generate(prompts, params)
        engine.release_memory()
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(args.rounds):
        for name, engine in engines.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(prompts, params)
            engine.release_memory()
            torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - start)
            print(f"round {round_index + 1} {name}: {seconds[name][-1]:.4f} s", flush=True)
    tokens = len(prompts) * 8 * args.response_len
    print(f"\nrollout ({len(prompts)} prompts x 8, prompt {max(map(len, prompts))}, response {args.response_len}), "
          f"{args.rounds} rounds alternating:")
    for name, runs in seconds.items():
        stats = engines[name].last_stats
        print(f"  {name:<12} best {min(runs):.4f} s ({tokens / min(runs):,.0f} tok/s), median "
              f"{statistics.median(runs):.4f} s; attention {stats['attention']}, sampler {stats['sampler']}, graphs "
              f"captured {stats['graphs_captured']} / kept {stats['graphs_kept']}; {timeline_line(stats)}")


if __name__ == "__main__":
    main()
