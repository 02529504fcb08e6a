"""The prefix-shared decode attention kernel at the grpo-0.5b shape: its launch configurations, against the floor.

The kernel's keys per iteration and warps are module constants (`BLOCK_N`, `NUM_WARPS` in
`hybridrl/rollout/kernels/decode_launch.py`; no autotuning: graph capture needs one kernel per shape). This
script sets them in turn and runs the engine's call (raw q and new K/V, RoPE and the q/k/v bias inside the kernel,
the fused cache write), each launch checked against the PyTorch reference first, then timed as calls captured in
one CUDA graph (as the engine runs it), so launch overhead is not what is measured:

- on one layer's cache, replayed until it sits in L2;
- over 24 layers' caches in turn, each read from HBM after the others passed through L2, as in a rollout
  (this is the figure the defaults are chosen by), at 512 slots (64 prompts x 8) and 256 (one rank's share on 2 GPUs).

Also timed: the default launch without the fused write (an index_put of the new K/V, then the kernel).

    python -m benchmarks.kernels.decode_attention [--response-len 128] [--bandwidth-tbs 4.2] [--no-sweep]

The floor is the bytes a layer must read once (each prompt entry's KV, each slot's response KV, the
queries) at `--bandwidth-tbs`. JSON goes to $OUT/decode_attention.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys

import torch

from benchmarks.kernels.cuda_timing import graph_time_us
from hybridrl.rollout.kernels import decode_attention, decode_launch
from tests.decode_attention_cases import TOLERANCE, make_case, rope_inputs, with_new_kv

LAYERS, KV_HEADS, GROUP, HEAD_DIM, PROMPT_LEN = 24, 2, 7, 64, 256
DEFAULT = dict(block_n=decode_launch.BLOCK_N, num_warps=decode_launch.default_num_warps(HEAD_DIM))
LAUNCHES = [dict(block_n=block_n, num_warps=warps) for block_n, warps in itertools.product((16, 32, 64, 128), (1, 2, 4, 8))]


@contextlib.contextmanager
def launch(block_n: int, num_warps: int):
    """The kernel launched with `block_n` keys per iteration and `num_warps` warps while inside."""
    saved = decode_launch.BLOCK_N, decode_launch.NUM_WARPS, decode_launch.WIDE_HEAD_NUM_WARPS
    decode_launch.BLOCK_N, decode_launch.NUM_WARPS, decode_launch.WIDE_HEAD_NUM_WARPS = block_n, num_warps, num_warps
    try:
        yield
    finally:
        decode_launch.BLOCK_N, decode_launch.NUM_WARPS, decode_launch.WIDE_HEAD_NUM_WARPS = saved


def engine_call_case(seed: int, slots: int, entries: int, response_len: int, device: str = "cuda",
                     dtype=torch.bfloat16) -> tuple[dict, tuple]:
    """One layer's (case, (new_kv, rope, bias)): adjacent samples share an entry, every slot mid-rollout."""
    case = make_case(seed, slots, KV_HEADS, GROUP, HEAD_DIM, entries, PROMPT_LEN, 256, dtype=dtype, device=device)
    case["prompt_index"] = torch.arange(slots, device=device) * entries // slots
    case["prompt_len"].fill_(PROMPT_LEN)
    case["response_len"].fill_(response_len)
    case, new_kv = with_new_kv(case, seed=seed)
    cos, sin, bias = rope_inputs(case, with_bias=True, seed=seed)
    return case, (new_kv, (cos, sin), bias)


def check(config: dict, case: dict, extras: tuple, attention=None) -> None:
    """The launch's output and cache write against the reference's, on copies of one layer."""
    attention = attention or decode_attention.triton_decode_attention
    new_kv, rope, bias = extras
    ours, _ = with_new_kv(case)
    theirs, _ = with_new_kv(case)
    with launch(**config):
        out = attention(**ours, new_kv=new_kv, rope=rope, qkv_bias=bias)
    expected = decode_attention.reference_decode_attention(**theirs, new_kv=new_kv, rope=rope, qkv_bias=bias)
    tolerance = TOLERANCE[case["q"].dtype]
    torch.testing.assert_close(out, expected, **tolerance)
    torch.testing.assert_close(ours["response_k"], theirs["response_k"], **tolerance)


def time_launches(cases: list[tuple[dict, tuple]], launches: list[dict]) -> list[tuple[float, dict]]:
    """µs per layer-step of each launch over `cases` (one per layer) in turn; fastest first."""
    def all_layers() -> None:
        for case, (new_kv, rope, bias) in cases:
            decode_attention.triton_decode_attention(**case, new_kv=new_kv, rope=rope, qkv_bias=bias)

    rows = []
    for config in launches:
        try:
            check(config, *cases[0])
            with launch(**config):
                micros = graph_time_us(all_layers, calls=max(2, 20 // len(cases)), replays=10, per_call=len(cases))
        except Exception as error:  # e.g. out of shared memory, or wrong: report it, go on
            print(f"{len(cases)} layer(s) {config}: failed: {str(error).splitlines()[0][:120]}", flush=True)
            continue
        rows.append((micros, config))
        print(f"{len(cases)} layer(s) {config}: {micros:.2f} us per layer-step", flush=True)
    return sorted(rows, key=lambda row: row[0])


def unfused_write_us(case: dict, new_kv: torch.Tensor) -> float:
    """The default launch after writing the new K/V with index_put (the path without the fused write)."""
    slots, write_at = torch.arange(case["q"].shape[0], device="cuda"), case["response_len"] - 1
    response = torch.stack((case["response_k"], case["response_v"]))  # (2, slots, Hkv, L, D), like the engine's view
    unfused_case = dict(case, response_k=response[0], response_v=response[1])

    def unfused() -> None:
        response[:, slots, :, write_at] = new_kv  # advanced indices apart: the batch dim comes first
        decode_attention.triton_decode_attention(**unfused_case)

    return graph_time_us(unfused)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels.decode_attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--response-len", type=int, default=128, help="every slot's response length (mid-rollout)")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.2)
    parser.add_argument("--no-sweep", action="store_true", help="time the default launch only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/decode_attention.py needs a CUDA GPU (it times Triton kernels).")
    launches = [DEFAULT] if args.no_sweep else LAUNCHES
    report = dict(args=vars(args), device=torch.cuda.get_device_name(), default=DEFAULT, shapes=[])
    for slots, entries in ((512, 64), (256, 32)):
        token_bytes = KV_HEADS * HEAD_DIM * 2 * 2  # K and V, 2 bytes each
        floor_bytes = (entries * PROMPT_LEN + slots * args.response_len) * token_bytes + 2 * slots * KV_HEADS * GROUP * HEAD_DIM * 2
        floor_us = floor_bytes / (args.bandwidth_tbs * 1e12) * 1e6
        one_layer = [engine_call_case(0, slots, entries, args.response_len)]
        hot = time_launches(one_layer, launches)
        cold = time_launches([engine_call_case(layer, slots, entries, args.response_len) for layer in range(LAYERS)],
                             launches)
        torch.cuda.empty_cache()  # the 24 layers' caches are gone with the sweep
        unfused_us = unfused_write_us(one_layer[0][0], one_layer[0][1][0])
        print(f"\n{slots} slots, {entries} prompt entries x {PROMPT_LEN}, response {args.response_len}, bf16, group "
              f"{GROUP}, head_dim {HEAD_DIM}: floor {floor_us:.1f} us per layer ({floor_bytes / 1e6:.1f} MB at "
              f"{args.bandwidth_tbs} TB/s)")
        print(f"{'block_n':>8} {'warps':>6} {'24 layers us':>13} {'% floor':>8} {'1 layer (L2) us':>16}")
        hot_us = {tuple(config.values()): micros for micros, config in hot}
        for micros, config in cold[:10]:
            mark = "  (default)" if config == DEFAULT else ""
            print(f"{config['block_n']:>8} {config['num_warps']:>6} {micros:>13.2f} {100 * floor_us / micros:>7.0f}% "
                  f"{hot_us.get(tuple(config.values()), float('nan')):>16.2f}{mark}")
        print(f"default launch with an index_put write first instead of the fused write: {unfused_us:.2f} us (1 layer)")
        report["shapes"].append(dict(slots=slots, entries=entries, floor_us=floor_us, layers_in_turn=cold,
                                     one_layer=hot, unfused_us=unfused_us))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_attention.json"), "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
