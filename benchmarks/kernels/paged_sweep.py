"""The paged decode-attention kernel at the long-tail rollout's live shapes, over its launch knobs, against the
contiguous (prefix-shared) kernel and the bandwidth floor.

Shapes as `benchmarks/long_tail.py` runs them (Qwen2.5-1.5B heads: 2 KV heads, group 6, head_dim 128; bf16; prompt
512 shared by 8 samples; response capacity `--cap` 8,192; the engine's call with RoPE, q/k/v bias and the fused cache
write): `512-mixed` (drawn lengths, median 1,024), and the run's live batches, whose sequences all have the length
of the steps so far (it admits every sequence at once): `512x1k` (the whole batch at the median), `256x2k`, `128x4k`,
`64x6k`, `32x8k`, `16x8k`, `8x8k`, `4x8k` (the tail); `--batches` picks a subset. The paged pool holds only the
blocks the lengths fill, in shuffled order (as blocks handed out window by window end up); unused table columns
point at block 0.

Variants (`VARIANTS`): the engine's plan (`decode_launch.launch_plan`) for the contiguous layout and the paged one
(the long-tail run's blocks of 64), then the paged kernel with `decode_launch` constants overridden: the split
combine as a loop over splits (`COMBINE_TILE` 0) rather than one load of all, the narrow-grid tiles up to 16 (slot,
KV head) pairs or never (`NARROW_SLOT_HEADS`), the split count (half, 2 or 4 times the programs the split grid aims
at), and 64 keys per iteration over 4 warps at every shape.
Each variant is checked against the PyTorch reference on the first layer (its max abs error is printed), then timed
over `--layers` layers' caches in one CUDA graph (`cuda_timing.graph_time_us`), so each layer is read from HBM.
A variant that fails to compile or check prints its error and the sweep goes on; past `--budget` seconds the
remaining variants are skipped (they run in the order above, most telling first).

    python -m benchmarks.kernels.paged_sweep [--cap 8192] [--layers 4] [--budget 90]

Prints a table (µs per layer-step; % of floor); JSON to $OUT/paged_sweep.json when $OUT is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import numpy as np
import torch

from benchmarks.kernels.cuda_timing import graph_time_us
from benchmarks.kernels.split_kv import (GROUP, HEAD_DIM, KV_HEADS, PROMPT_LEN, SAMPLES_PER_PROMPT, floor_us,
                                         kernel_sweep_parser, layer_case)
from hybridrl.rollout.kernels import decode_launch
from hybridrl.rollout.kernels.decode_attention import reference_decode_attention, triton_decode_attention
from hybridrl.rollout.kernels.paged_attention import reference_paged_decode_attention, triton_paged_decode_attention

DEVICE = "cuda"
"""Where the cases are built (a CPU check of the script sets "cpu")."""
DTYPE = torch.bfloat16
"""The cases' dtype (a CPU check sets float32: Triton's interpreter has no bf16)."""
TOLERANCE = dict(atol=2e-2, rtol=2e-2)
"""bf16 against a float32 reference."""


def batches(cap: int) -> dict[str, list[int]]:
    """Response keys per slot of each live shape (see the module docstring); drawn lengths are seeded."""
    drawn = np.clip(np.round(1024 * np.exp(np.random.default_rng(0).standard_normal(512))), 16, cap)
    return {"512-mixed": drawn.astype(int).tolist(), "512x1k": [1024] * 512, "256x2k": [min(2048, cap)] * 256,
            "128x4k": [min(4096, cap)] * 128, "64x6k": [min(6144, cap)] * 64, "32x8k": [cap - 5] * 32,
            "16x8k": [cap - 3] * 16, "8x8k": [cap - 2] * 8, "4x8k": [cap - 1] * 4}


def paged_case(seed: int, lengths: list[int], cap: int, block_size: int) -> tuple[dict, tuple]:
    """One layer's paged (case, (new_kv, rope, bias)): pool blocks for each prompt entry and each slot's response
    (its length plus the new key), shuffled; a table of `cap / block_size` response columns per slot."""
    generator = torch.Generator(DEVICE).manual_seed(seed)
    slots, entries = len(lengths), max(1, len(lengths) // SAMPLES_PER_PROMPT)
    prompt_columns, response_columns = -(-PROMPT_LEN // block_size), -(-cap // block_size)
    used = [-(-length // block_size) for length in lengths]  # response_len counts the new key (written at its end)
    num_blocks = 1 + entries * prompt_columns + sum(used)
    order = (1 + torch.randperm(num_blocks - 1, generator=generator, device=DEVICE)).tolist()
    table = torch.zeros(slots, prompt_columns + response_columns, dtype=torch.int32)
    prompt_blocks = [order[e * prompt_columns:(e + 1) * prompt_columns] for e in range(entries)]
    at = entries * prompt_columns
    for slot, count in enumerate(used):
        table[slot, :prompt_columns] = torch.tensor(prompt_blocks[slot * entries // slots])
        table[slot, prompt_columns:prompt_columns + count] = torch.tensor(order[at:at + count])
        at += count

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=DEVICE, dtype=DTYPE)

    pool = randn(2, num_blocks, KV_HEADS, block_size, HEAD_DIM)
    case = dict(q=randn(slots, KV_HEADS, GROUP, HEAD_DIM), k_pool=pool[0], v_pool=pool[1], response_k=pool[0],
                response_v=pool[1], block_table=table.to(DEVICE), response_len=torch.tensor(lengths, device=DEVICE),
                prompt_len=torch.full((slots,), PROMPT_LEN, device=DEVICE), scale=HEAD_DIM ** -0.5,
                prompt_columns=prompt_columns)
    cos, sin = randn(slots, HEAD_DIM).float().cos(), randn(slots, HEAD_DIM).float().sin()
    return case, (randn(slots, 2, KV_HEADS, HEAD_DIM), (cos.to(DTYPE), sin.to(DTYPE)),
                  randn((KV_HEADS * GROUP + 2 * KV_HEADS) * HEAD_DIM))


def copied(case: dict) -> dict:
    """The case with its pools (or caches) cloned, so a check's cache write does not touch the timed case."""
    out = dict(case)
    for pair in (("k_pool", "v_pool"), ("prompt_k", "prompt_v"), ("response_k", "response_v")):
        if pair[0] in case:
            out[pair[0]], out[pair[1]] = case[pair[0]].clone(), case[pair[1]].clone()
    if "k_pool" in case:
        out["response_k"], out["response_v"] = out["k_pool"], out["v_pool"]
    return out


def check(case: dict, extras: tuple, ours, reference) -> float:
    """The launch's output against the reference's on copies of one layer: its max abs error (raises past
    `TOLERANCE`)."""
    new_kv, rope, bias = extras
    out = ours(**copied(case), new_kv=new_kv, rope=rope, qkv_bias=bias)
    expected = reference(**copied(case), new_kv=new_kv, rope=rope, qkv_bias=bias)
    torch.testing.assert_close(out, expected, **TOLERANCE)
    return (out.float() - expected.float()).abs().max().item()


VARIANTS = {
    "contiguous": ("contiguous", {}),
    "paged": ("paged", {}),
    "paged combine loop": ("paged", dict(COMBINE_TILE=0)),
    "paged narrow<=16": ("paged", dict(NARROW_SLOT_HEADS=16)),
    "paged narrow off": ("paged", dict(NARROW_SLOT_HEADS=0)),
    "paged splits /2": ("paged", dict(SPLIT_PROGRAMS=1024, MIN_SPLITS=2)),
    "paged splits x2": ("paged", dict(SPLIT_PROGRAMS=4096, MIN_SPLITS=8, MAX_SPLITS=32)),
    "paged splits x4": ("paged", dict(SPLIT_PROGRAMS=8192, MIN_SPLITS=8, MAX_SPLITS=64)),
    "paged BLOCK_N=64 warps=4": ("paged", dict(BLOCK_N=64, WIDE_HEAD_NUM_WARPS=4)),
}
"""name -> (layout, `decode_launch` constants it overrides); the engine's plan first for each layout, then the
paged ones, most telling first (the budget may end the sweep). Paged blocks are the long-tail run's 64 keys."""
BLOCK_SIZE = 64


@contextlib.contextmanager
def knobs(**overrides):
    """Launches inside see `decode_launch`'s constants replaced by `overrides` (every plan reads them at launch)."""
    saved = {name: getattr(decode_launch, name) for name in overrides}
    for name, value in overrides.items():
        setattr(decode_launch, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(decode_launch, name, value)


def time_variant(cases: list, attention) -> float:
    def all_layers() -> None:
        for case, (new_kv, rope, bias) in cases:
            attention(**case, new_kv=new_kv, rope=rope, qkv_bias=bias)

    return graph_time_us(all_layers, calls=max(2, 20 // len(cases)), replays=10, per_call=len(cases))


def main() -> None:
    parser = kernel_sweep_parser("paged_sweep", __doc__)
    parser.add_argument("--budget", type=float, default=90.0, help="seconds; later variants are skipped")
    parser.add_argument("--batches", default="", help="comma-separated subset of the shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/paged_sweep.py needs a CUDA GPU (it times Triton kernels).")
    start = time.perf_counter()
    shapes = {name: lengths for name, lengths in batches(args.cap).items()
              if not args.batches or name in args.batches.split(",")}
    results: dict[str, dict[str, float | str]] = {name: {} for name in VARIANTS}
    errors: dict[str, dict[str, float]] = {name: {} for name in VARIANTS}
    floors = {name: floor_us(lengths, args.bandwidth_tbs) for name, lengths in shapes.items()}
    print(f"{torch.cuda.get_device_name()}: µs per layer-step over {args.layers} layers; floor: "
          + ", ".join(f"{name} {micros:.1f}" for name, micros in floors.items()), flush=True)
    built: dict = {}  # (shape, layout, block size) -> its layers' cases, kept for the later variants
    for name, (layout, overrides) in VARIANTS.items():  # variant-major: past the budget, whole variants are skipped
        block_size = BLOCK_SIZE if layout == "paged" else 0
        for shape, lengths in shapes.items():
            if time.perf_counter() - start > args.budget:
                results[name][shape] = "skipped"
                continue
            key = (shape, layout, block_size)
            if key not in built:
                built[key] = [layer_case(layer, lengths, args.cap) if layout == "contiguous"
                              else paged_case(layer, lengths, args.cap, block_size) for layer in range(args.layers)]
            ours, reference = ((triton_decode_attention, reference_decode_attention) if layout == "contiguous" else
                               (triton_paged_decode_attention, reference_paged_decode_attention))
            try:
                with knobs(**overrides):
                    errors[name][shape] = check(*built[key][0], ours, reference)
                    results[name][shape] = time_variant(built[key], ours)
            except Exception as error:  # noqa: BLE001 - a knob that does not compile is a result, not a stop
                results[name][shape] = f"error: {type(error).__name__}: {str(error)[:120]}"
            value = results[name][shape]
            shown = (f"{value:.1f} us ({100 * floors[shape] / value:.0f}% of floor, max abs error "
                     f"{errors[name][shape]:.2e})" if isinstance(value, float) else value)
            print(f"{shape:>10} {name:>32}: {shown}", flush=True)
    print(f"\n{'variant':>32} " + " ".join(f"{name:>10}" for name in shapes))
    print(f"{'floor':>32} " + " ".join(f"{floors[name]:>10.1f}" for name in shapes))
    for name, row in results.items():
        worst = max(errors[name].values(), default=0.0)
        print(f"{name:>32} " + " ".join(f"{row[s]:>10.1f}" if isinstance(row.get(s), float) else f"{'-':>10}"
                                        for s in shapes) + f"   max abs error {worst:.1e}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "paged_sweep.json"), "w") as handle:
            json.dump(dict(args=vars(args), device=torch.cuda.get_device_name(), floors_us=floors, us=results,
                           max_abs_error=errors, variants=VARIANTS), handle,
                      indent=1)


if __name__ == "__main__":
    main()
