"""Launch configurations of the prefix-shared decode attention kernel, timed at the grpo-0.5b shape.

The kernel's block size, warps and pipeline stages are fixed (no autotuning: graph capture needs one
kernel per shape). This script times one layer's cache replayed until it sits in L2; the defaults in
`hybridrl/rollout/kernels/decode_attention.py` come from `attention_configs.py`, which times the engine's call over
24 layers' caches in turn (each read from HBM, as in a rollout) and then in rollouts.
Each configuration is checked against the PyTorch reference first, then timed as 20 calls captured in
one CUDA graph (as the engine runs it), so launch overhead is not what is measured. Also timed: the
default launch with the prompt part in blocks of 16, 64 and 128 keys (`prompt_block_n`; the response part keeps
its block size), and the engine's old unfused path (index_put of the new K/V, then the kernel) against the fused
write.

    python -m benchmarks.kernels.decode_attention [--response-len 128] [--bandwidth-tbs 4.2] [--stacked]

The floor is the bytes a layer must read once (each prompt entry's KV, each slot's response KV, the
queries) at `--bandwidth-tbs`. JSON goes to $OUT/decode_attention.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from benchmarks.kernels.cuda_timing import graph_time_us
from hybridrl.rollout.kernels.decode_attention import reference_decode_attention, triton_decode_attention
from tests.decode_attention_cases import TOLERANCE, check_fused_write, make_case


def time_stacked(case: dict, new_kv: torch.Tensor, args) -> list[dict]:
    """attention='triton-stacked' at the same inputs: the n = slots / entries samples of each prompt in
    one table row (as the engine keeps them), every launch configuration checked against the one-slot
    reference with the fused K/V write, then timed; fastest first."""
    from hybridrl.rollout.kernels.stacked_attention import entry_slot_table, stacked_decode_attention

    width = args.slots // args.entries
    table = entry_slot_table({slot: slot // width for slot in range(args.slots)}, args.entries, width).cuda()
    stacked_case = dict(case, entry_slots=table)
    rows = []
    for block_n, prompt_warps, response_warps in itertools.product((32, 64), (2, 4, 8), (2, 4)):
        config = dict(block_n=block_n, prompt_warps=prompt_warps, response_warps=response_warps)
        attention = lambda **kw: stacked_decode_attention(**kw, **config)  # noqa: E731
        try:
            check_fused_write(attention, stacked_case, TOLERANCE[case["q"].dtype])
            micros = graph_time_us(lambda: attention(**stacked_case, new_kv=new_kv))
        except Exception as error:
            print(f"stacked {config}: failed: {str(error).splitlines()[0][:100]}", flush=True)
            continue
        rows.append(dict(config, us=micros))
    return sorted(rows, key=lambda row: row["us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=512)
    parser.add_argument("--entries", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=128, help="every slot's response length (mid-rollout)")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.2)
    parser.add_argument("--no-sweep", action="store_true",
                        help="skip the 60 one-kernel launch configurations (time the default only)")
    parser.add_argument("--stacked", action="store_true",
                        help="also time attention='triton-stacked' (prompt kernel per entry + response kernel per "
                             "slot) over its launch configurations, with the fused K/V write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/decode_attention.py needs a CUDA GPU (it times Triton kernels).")
    dtype, kv_heads, group, head_dim = torch.bfloat16, 2, 7, 64
    case = make_case(0, args.slots, kv_heads, group, head_dim, args.entries, args.prompt_len, 256, dtype=dtype,
                     device="cuda")
    case["prompt_index"] = torch.arange(args.slots, device="cuda") * args.entries // args.slots  # adjacent samples
    case["prompt_len"].fill_(args.prompt_len)
    case["response_len"].fill_(args.response_len)
    new_kv = torch.randn(args.slots, 2, kv_heads, head_dim, device="cuda", dtype=dtype)
    expected = reference_decode_attention(**case)
    token_bytes = kv_heads * head_dim * 2 * 2  # K and V, 2 bytes each
    floor_bytes = (args.entries * args.prompt_len + args.slots * args.response_len) * token_bytes \
        + 2 * case["q"].numel() * 2
    floor_us = floor_bytes / (args.bandwidth_tbs * 1e12) * 1e6
    rows = []
    sweep = [] if args.no_sweep else itertools.product((32, 64, 128), (1, 2, 4, 8), (None, 1, 2, 3, 4))
    for block_n, warps, stages in sweep:
        config = dict(block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            out = triton_decode_attention(**case, **config)
            torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
            micros = graph_time_us(lambda: triton_decode_attention(**case, **config))
        except Exception as error:  # e.g. out of shared memory: report it, go on
            print(f"{config}: failed: {str(error).splitlines()[0][:100]}", flush=True)
            continue
        rows.append(dict(config, us=micros))
        print(f"{config}: {micros:.1f} us", flush=True)
    for prompt_block_n in () if args.no_sweep else (16, 64, 128):  # the prompt part alone in other block sizes
        config = dict(prompt_block_n=prompt_block_n)
        torch.testing.assert_close(triton_decode_attention(**case, **config), expected, **TOLERANCE[dtype])
        micros = graph_time_us(lambda: triton_decode_attention(**case, **config))
        print(f"default launch, prompt part in blocks of {prompt_block_n} keys: {micros:.1f} us", flush=True)
    default = graph_time_us(lambda: triton_decode_attention(**case))
    slots, write_at = torch.arange(args.slots, device="cuda"), case["response_len"] - 1
    response = torch.stack((case["response_k"], case["response_v"]))  # (2, slots, Hkv, L, D), like the engine's view
    unfused_case = dict(case, response_k=response[0], response_v=response[1])

    def unfused() -> None:
        response[:, slots, :, write_at] = new_kv  # advanced indices apart: the batch dim comes first
        triton_decode_attention(**unfused_case)

    fused_us = graph_time_us(lambda: triton_decode_attention(**case, new_kv=new_kv))
    unfused_us = graph_time_us(unfused)
    stacked_rows = time_stacked(case, new_kv, args) if args.stacked else []
    rows.sort(key=lambda row: row["us"])
    print(f"\nshape: {args.slots} slots, {args.entries} prompt entries x {args.prompt_len}, response {args.response_len}, "
          f"bf16, group {group}, head_dim {head_dim}; floor {floor_us:.1f} us ({floor_bytes / 1e6:.1f} MB at "
          f"{args.bandwidth_tbs} TB/s)")
    print(f"{'block_n':>8} {'warps':>6} {'stages':>7} {'us':>8} {'% floor':>8}")
    for row in rows[:10]:
        print(f"{row['block_n']:>8} {row['num_warps']:>6} {str(row['num_stages']):>7} {row['us']:>8.1f} "
              f"{100 * floor_us / row['us']:>7.0f}%")
    print(f"default config: {default:.1f} us; with the fused K/V write: {fused_us:.1f} us; "
          f"index_put write + kernel (unfused): {unfused_us:.1f} us")
    for row in stacked_rows[:8]:
        print(f"stacked, block_n {row['block_n']}, prompt warps {row['prompt_warps']}, response warps "
              f"{row['response_warps']}, fused write: {row['us']:.1f} us ({100 * floor_us / row['us']:.0f}% of the floor; "
              f"one-kernel launch with the fused write {fused_us:.1f} us)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_attention.json"), "w") as handle:
            json.dump(dict(args=vars(args), floor_us=floor_us, configs=rows, default_us=default, fused_us=fused_us,
                           unfused_us=unfused_us, stacked=stacked_rows, device=torch.cuda.get_device_name()), handle, indent=2)


if __name__ == "__main__":
    main()
