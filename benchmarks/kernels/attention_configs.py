"""The decode attention kernel's launch configuration as the engine calls it, per batch size, then in rollouts.

`decode_attention.py` times the kernel on one layer's cache, replayed until it sits in L2 (50 MB on an H200 holds a
whole layer's KV at the grpo-0.5b shape); in the engine each layer's KV is read once per step, after 23 other layers
have passed through L2. Here every configuration runs the engine's call (raw q and new K/V, RoPE and the q/k/v bias
inside the kernel, the fused cache write) over 24 layers' caches in turn — keys per iteration, warps, pipeline
stages and, beside the 1-2 warp launches, the prompt part in 64-key blocks — checked against the PyTorch reference
first, at 512 slots (64 prompts x 8) and 256 slots (32 x 8: one rank's share of the batch on 2 GPUs). Then the fastest
configuration of each size runs in rollouts of that size against the default launch, alternating in one process.

    python -m benchmarks.kernels.attention_configs [--rounds 3] [--response-len 128]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time

import torch

from benchmarks.kernels.cuda_timing import graph_time_us
from benchmarks.rollout import build_model
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.kernels import decode_attention
from tests.decode_attention_cases import TOLERANCE, make_case, rope_inputs, with_new_kv

LAYERS, KV_HEADS, GROUP, HEAD_DIM, PROMPT_LEN = 24, 2, 7, 64, 256
DEFAULT = dict(block_n=decode_attention.BLOCK_N, num_warps=decode_attention.NUM_WARPS, num_stages=None,
               prompt_block_n=None)
ORIGINAL = decode_attention.triton_decode_attention


def engine_call_cases(slots: int, entries: int, response_len: int) -> list[tuple[dict, tuple]]:
    """One (case, (new_kv, rope, bias)) per layer: adjacent samples share an entry, every slot mid-rollout."""
    cases = []
    for layer in range(LAYERS):
        case = make_case(layer, slots, KV_HEADS, GROUP, HEAD_DIM, entries, PROMPT_LEN, 256, dtype=torch.bfloat16,
                         device="cuda")
        case["prompt_index"] = torch.arange(slots, device="cuda") * entries // slots
        case["prompt_len"].fill_(PROMPT_LEN)
        case["response_len"].fill_(response_len)
        case, new_kv = with_new_kv(case, seed=layer)
        cos, sin, bias = rope_inputs(case, with_bias=True, seed=layer)
        cases.append((case, (new_kv, (cos, sin), bias)))
    return cases


def check(config: dict, case: dict, extras: tuple) -> None:
    """The configuration's output and cache write against the reference's, on copies of one layer."""
    new_kv, rope, bias = extras
    ours, _ = with_new_kv(case)
    theirs, _ = with_new_kv(case)
    out = ORIGINAL(**ours, new_kv=new_kv, rope=rope, qkv_bias=bias, **config)
    expected = decode_attention.reference_decode_attention(**theirs, new_kv=new_kv, rope=rope, qkv_bias=bias)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(ours["response_k"], theirs["response_k"], **TOLERANCE[torch.bfloat16])


def sweep(slots: int, entries: int, response_len: int) -> list[tuple[float, dict]]:
    cases = engine_call_cases(slots, entries, response_len)

    def all_layers(config: dict) -> None:
        for case, (new_kv, rope, bias) in cases:
            ORIGINAL(**case, new_kv=new_kv, rope=rope, qkv_bias=bias, **config)

    rows = []
    launches = itertools.product((16, 32, 64), (1, 2, 4), (None, 2, 3), (None, 64))
    for block_n, warps, stages, prompt_block_n in launches:
        if prompt_block_n is not None and (warps > 2 or prompt_block_n == block_n):
            continue  # the prompt part's own block size only beside the fewer-warp launches
        config = dict(block_n=block_n, num_warps=warps, num_stages=stages, prompt_block_n=prompt_block_n)
        try:
            check(config, *cases[0])
            micros = graph_time_us(lambda: all_layers(config), calls=2, replays=10, per_call=LAYERS)
        except Exception as error:  # e.g. out of shared memory, or wrong: report it, go on
            print(f"{slots} slots {config}: failed: {str(error).splitlines()[0][:120]}", flush=True)
            continue
        rows.append((micros, config))
        print(f"{slots} slots {config}: {micros:.2f} us per layer-step", flush=True)
    return sorted(rows, key=lambda row: row[0])


def launched_with(config: dict):
    attention = functools.partial(ORIGINAL, **config)
    attention.writes_new_kv = attention.applies_rope = True
    return attention


def rollouts(model, prompts: int, configs: dict[str, dict], rounds: int) -> dict[str, list[float]]:
    """Rollouts of `prompts` x 8 (prompt 256, response 256 forced), one engine per configuration, alternating; the
    engine looks the kernel up in `decode_attention` when it sizes its cache, so each call gets its own launch."""
    generator = torch.Generator().manual_seed(1)
    token_ids = torch.randint(0, model.config.vocab_size, (prompts, PROMPT_LEN), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=256, temperature=1.0, n=8, seed=0, ignore_eos=True)
    engines = {name: BuiltinBackend(model) for name in configs}
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    for round_index in range(rounds + 1):  # round 0 compiles and captures
        for name, engine in engines.items():
            decode_attention.triton_decode_attention = launched_with(configs[name])
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(token_ids, params)
            torch.cuda.synchronize()
            if round_index:
                seconds[name].append(time.perf_counter() - start)
    decode_attention.triton_decode_attention = ORIGINAL
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--response-len", type=int, default=128, help="every slot's response length in the sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/attention_configs.py needs a CUDA GPU.")
    best = {}
    for slots, entries in ((512, 64), (256, 32)):
        rows = sweep(slots, entries, args.response_len)
        torch.cuda.empty_cache()  # the 24 layers' caches are gone with the sweep
        default = next((micros for micros, config in rows if config == DEFAULT), float("nan"))
        print(f"\n{slots} slots, 24 layers' caches in turn, the engine's call: default {default:.2f} us per "
              f"layer-step; fastest:", flush=True)
        for micros, config in rows[:6]:
            print(f"  {micros:6.2f} us  {config}", flush=True)
        best[slots] = rows[0][1]
    model = build_model("cuda")
    for slots in (512, 256):
        configs = {"default": DEFAULT, "fastest": best[slots]}
        if best[slots] == DEFAULT:
            print(f"\n{slots} slots: the default launch is the fastest; no rollout comparison", flush=True)
            continue
        seconds = rollouts(model, slots // 8, configs, args.rounds)
        print(f"\nrollouts of {slots} sequences, {args.rounds} rounds alternating (fastest = {best[slots]}):")
        for name, runs in seconds.items():
            print(f"  {name:<8} best {min(runs):.3f} s, runs " + ", ".join(f"{s:.3f}" for s in runs), flush=True)


if __name__ == "__main__":
    main()
