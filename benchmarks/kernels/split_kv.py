"""Split-KV in the decode-attention kernel: the default launch plan against fixed split counts.

The default plan (`hybridrl/rollout/kernels/decode_launch.py`) cuts responses of a capacity above `SPLIT_KEYS` into
splits, one program each, merged by a second kernel: as many as the capacity asks, at most `split_count(batch x KV
heads)` (4 for wide batches, up to `MAX_SPLITS` for narrow tails, whose keys are then shared out by each slot's own
length: `balanced_splits`); the same rule for the contiguous (prefix-shared) and the paged layout. This script times the contiguous kernel both ways on batches shaped like the
long-tail rollout (`benchmarks/long_tail.py`): Qwen2.5-1.5B's heads (2 KV heads, group 6, head_dim 128), bf16, prompt
512 shared by 8 samples, response capacity `--cap` (8,192), the engine's call (raw q and K/V, RoPE and the q/k/v bias
inside the kernel, the fused cache write). Each launch is checked against the PyTorch reference first, then timed
as calls captured in one CUDA graph (`cuda_timing.graph_time_us`) over `--layers` layers' caches in turn, so each is
read from HBM rather than L2.

Batches (response keys per slot):
- `full-64`, `full-1024`: 180 slots (what the contiguous long-tail run holds at cap 8,192) all at 64 / 1,024 keys:
  little or nothing to split, so the split plan's cost (empty programs, partial state, the merge kernel) shows;
- `full-mixed`, `512-mixed`: 180 / 512 slots at lengths drawn as long_tail.py draws them (median 1,024, sigma 1);
- `tail-16`, `tail-4`: the last few long sequences of a rollout (4,096-8,192 keys), where one program per (slot,
  head) leaves most SMs idle.

Besides the default, fixed counts are timed (1, 4, 8 and 16 splits at cap 8,192), so the rule can be judged. The floor is the bytes a layer must read once (each prompt entry's KV, each
slot's response KV) at `--bandwidth-tbs`.

    python -m benchmarks.kernels.split_kv [--cap 8192] [--layers 4] [--bandwidth-tbs 4.2]

Prints a table; JSON goes to $OUT/split_kv.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import numpy as np
import torch

from benchmarks.kernels.cuda_timing import graph_time_us
from hybridrl.rollout.kernels import decode_launch
from hybridrl.rollout.kernels.decode_attention import reference_decode_attention, triton_decode_attention
from tests.decode_attention_cases import TOLERANCE, rope_inputs, with_new_kv

KV_HEADS, GROUP, HEAD_DIM, PROMPT_LEN, SAMPLES_PER_PROMPT = 2, 6, 128, 512, 8


def batches(cap: int) -> dict[str, list[int]]:
    """Response keys per slot of each batch (see the module docstring); drawn lengths are seeded."""
    rng = np.random.default_rng(0)

    def drawn(slots: int) -> list[int]:
        return np.clip(np.round(1024 * np.exp(rng.standard_normal(slots))), 16, cap).astype(int).tolist()

    return {"full-64": [64] * 180, "full-1024": [min(1024, cap)] * 180, "full-mixed": drawn(180),
            "512-mixed": drawn(512), "tail-16": np.linspace(cap // 2, cap, 16).astype(int).tolist(),
            "tail-4": [cap - 7 * i for i in range(4)]}


def layer_case(seed: int, lengths: list[int], cap: int) -> tuple[dict, tuple]:
    """One layer's (case, (new_kv, rope, bias)) in the engine's layout: prompt entries shared by adjacent slots."""
    generator = torch.Generator("cuda").manual_seed(seed)
    slots, entries = len(lengths), max(1, len(lengths) // SAMPLES_PER_PROMPT)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16)

    prompt, response = randn(2, entries, KV_HEADS, PROMPT_LEN, HEAD_DIM), randn(2, slots, KV_HEADS, cap, HEAD_DIM)
    case = dict(q=randn(slots, KV_HEADS, GROUP, HEAD_DIM), prompt_k=prompt[0], prompt_v=prompt[1],
                response_k=response[0], response_v=response[1],
                prompt_index=torch.arange(slots, device="cuda") * entries // slots,
                prompt_len=torch.full((slots,), PROMPT_LEN, device="cuda"),
                response_len=torch.tensor(lengths, device="cuda"), scale=HEAD_DIM ** -0.5)
    cos, sin, bias = rope_inputs(case, with_bias=True, seed=seed)
    return case, (randn(slots, 2, KV_HEADS, HEAD_DIM), (cos, sin), bias)


@contextlib.contextmanager
def forced_splits(count: int, cap: int):
    """Every launch inside runs `count` splits at capacity `cap` whatever the batch (1: one program per slot)."""
    saved = decode_launch.SPLIT_KEYS, decode_launch.split_count
    decode_launch.SPLIT_KEYS = -(-cap // count) if count > 1 else cap
    decode_launch.split_count = lambda slot_heads: count
    try:
        yield
    finally:
        decode_launch.SPLIT_KEYS, decode_launch.split_count = saved


def check(case: dict, extras: tuple) -> None:
    """The launch's output and cache write against the reference's, on copies of one layer."""
    new_kv, rope, bias = extras
    ours, _ = with_new_kv(case)
    theirs, _ = with_new_kv(case)
    out = triton_decode_attention(**ours, new_kv=new_kv, rope=rope, qkv_bias=bias)
    expected = reference_decode_attention(**theirs, new_kv=new_kv, rope=rope, qkv_bias=bias)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(ours["response_k"], theirs["response_k"], **TOLERANCE[torch.bfloat16])


def time_layers(cases: list[tuple[dict, tuple]]) -> float:
    """µs per layer-step of the engine's call over `cases` (one per layer) in turn."""
    def all_layers() -> None:
        for case, (new_kv, rope, bias) in cases:
            triton_decode_attention(**case, new_kv=new_kv, rope=rope, qkv_bias=bias)

    return graph_time_us(all_layers, calls=max(2, 20 // len(cases)), replays=10, per_call=len(cases))


def floor_us(lengths: list[int], bandwidth_tbs: float) -> float:
    """The bytes one layer must read (prompt entries once, each slot's response KV) at the given bandwidth."""
    entries = max(1, len(lengths) // SAMPLES_PER_PROMPT)
    token_bytes = KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
    return (entries * PROMPT_LEN + sum(lengths)) * token_bytes / (bandwidth_tbs * 1e12) * 1e6


def kernel_sweep_parser(script: str, doc: str) -> argparse.ArgumentParser:
    """The options this script and `paged_sweep.py` share: the response capacity, the layers timed in turn and the
    bandwidth of the floor."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.kernels.{script}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap", type=int, default=8192, help="response capacity per slot (max_new_tokens)")
    parser.add_argument("--layers", type=int, default=4, help="layers' caches timed in turn (HBM, not L2)")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.2)
    return parser


def main() -> None:
    args = kernel_sweep_parser("split_kv", __doc__).parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/split_kv.py needs a CUDA GPU (it times Triton kernels).")
    counts = [1, 4, 8, 16]
    print(f"{torch.cuda.get_device_name()}: capacity {args.cap}, {decode_launch.SPLIT_KEYS}-key splits, at most "
          f"split_count(batch x {KV_HEADS} KV heads) of them", flush=True)
    columns = "".join(f"{f'{count} split(s) us':>15}" for count in counts)
    print(f"{'batch':>10} {'slots':>6} {'mean keys':>10} {'floor us':>9}{columns} {'default':>8} {'default us':>11} "
          f"{'default vs 1':>13} {'vs best':>8} {'default % floor':>16}", flush=True)
    rows = []
    for name, lengths in batches(args.cap).items():
        cases = [layer_case(layer, lengths, args.cap) for layer in range(args.layers)]
        micros = {}
        for count in counts:
            with forced_splits(count, args.cap):
                check(*cases[0])
                micros[count] = time_layers(cases)
        default_splits = decode_launch.launch_plan(GROUP, HEAD_DIM, args.cap, paged=False,
                                                   slot_heads=len(lengths) * KV_HEADS).num_splits
        check(*cases[0])
        default_us = time_layers(cases)
        floor = floor_us(lengths, args.bandwidth_tbs)
        rows.append(dict(batch=name, slots=len(lengths), mean_keys=float(np.mean(lengths)), floor_us=floor,
                         us_by_splits=micros, default_splits=default_splits, default_us=default_us))
        timings = "".join(f"{micros[count]:>15.1f}" for count in counts)
        print(f"{name:>10} {len(lengths):>6} {np.mean(lengths):>10.0f} {floor:>9.1f}{timings} {default_splits:>8} "
              f"{default_us:>11.1f} {micros[1] / default_us:>12.2f}x {min(micros.values()) / default_us:>7.2f}x "
              f"{100 * floor / default_us:>15.0f}%", flush=True)
        del cases
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "split_kv.json"), "w") as handle:
            json.dump(dict(args=vars(args), device=torch.cuda.get_device_name(), split_keys=decode_launch.SPLIT_KEYS,
                           rows=rows), handle, indent=2)


if __name__ == "__main__":
    main()
