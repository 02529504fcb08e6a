"""The decode step's projections at small batches (Qwen2.5-1.5B shape): cuBLAS (`F.linear`, as the compiled step
calls it) against the Triton kernel (`hybridrl/rollout/kernels/decode_linear.py`; for gate/up with SiLU-mul applied,
which cuBLAS leaves to a kernel of its own), µs per product in a CUDA graph over enough weight copies that the
weights come from HBM, not L2. Prints the kernel's and cuBLAS's largest difference from F.linear in float32.

    python -m benchmarks.kernels.decode_linear [--rows 1,8,16]

Prints, for each (product, rows), µs and TB/s of one read of the weight for cuBLAS and each launch tile of the kernel
in `TILES` (split-K tiles include their reduction kernel here; in the engine o's and down's partial sums are added
inside the next fused kernel instead); the floor is that read at --bandwidth.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

from benchmarks.kernels.cuda_timing import graph_time_us
from hybridrl.rollout.kernels.decode_linear import Launch, decode_linear

SHAPES = {"qkv": (2048, 1536, False), "o": (1536, 1536, False), "gate_up": (17920, 1536, True),
          "down": (1536, 8960, False), "lm_head": (151936, 1536, False)}
"""name -> (output columns N, input K, SiLU-mul): the 1.5B layer's products and its LM head."""
NARROW_TILES = (Launch(16, 512), Launch(16, 256, 2), Launch(16, 128, 4), Launch(16, 128, 8))
TILES = {"qkv": NARROW_TILES, "o": NARROW_TILES, "down": NARROW_TILES, "gate_up": (Launch(32, 128), Launch(16, 128)),
         "lm_head": (Launch(32, 128), Launch(64, 128))}
"""The launches timed per product, from which `decode_linear.launch`'s table is chosen."""
HBM_BYTES = 256 * 2**20
"""Weights per graph pass: well over the H200's 50 MB L2."""


def tile_name(tile: Launch) -> str:
    return f"{tile.columns}x{tile.depth}" + (f"/{tile.splits}" if tile.splits > 1 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--bandwidth", type=float, default=4.8e12)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/decode_linear.py needs a CUDA GPU.")
    torch.manual_seed(0)
    print("us per product (TB/s of one weight read); tiles: columns x K tile / splits; |diff|: largest difference "
          "from float32, the kernel's default tile (cuBLAS)", flush=True)
    for name, (columns, depth, silu_mul) in SHAPES.items():
        weight_bytes = columns * depth * 2
        copies = max(1, math.ceil(HBM_BYTES / weight_bytes))
        weights = [torch.randn(columns, depth, device="cuda", dtype=torch.bfloat16) / depth**0.5 for _ in range(copies)]
        for rows in (int(value) for value in args.rows.split(",")):
            x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)
            expected, cublas_out = F.linear(x.float(), weights[0].float()), F.linear(x, weights[0]).float()
            if silu_mul:
                expected, cublas_out = (F.silu(gate) * up for gate, up in (expected.chunk(2, -1),
                                                                          cublas_out.chunk(2, -1)))
            diffs = [(out - expected).abs().max().item() for out in (decode_linear(x, weights[0], silu_mul).float(),
                                                                     cublas_out)]
            timings = [("cuBLAS", graph_time_us(lambda: [F.linear(x, w) for w in weights], calls=2, replays=10,
                                                 per_call=copies))]
            for tile in TILES[name]:
                timings.append((tile_name(tile), graph_time_us(
                    lambda: [decode_linear(x, w, silu_mul, tile) for w in weights], calls=2, replays=10,
                    per_call=copies)))
            cells = "  ".join(f"{label} {us:6.1f} ({weight_bytes / us / 1e6:4.2f})" for label, us in timings)
            print(f"{name:<8} {rows:>3} floor {weight_bytes / args.bandwidth * 1e6:6.1f}  {cells}  "
                  f"|diff| {diffs[0]:.1e} ({diffs[1]:.1e})", flush=True)
        del weights


if __name__ == "__main__":
    main()
