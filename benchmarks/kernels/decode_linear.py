"""The decode step's projections at small batches (Qwen2.5-1.5B shape): cuBLAS (`F.linear`, as the compiled step
calls it) against the Triton kernel (`hybridrl/rollout/kernels/decode_linear.py`; for gate/up with SiLU-mul applied,
which cuBLAS leaves to a kernel of its own), µs per product in a CUDA graph over enough weight copies that the
weights come from HBM, not L2. Prints the kernel's and cuBLAS's largest difference from F.linear in float32.

    python -m benchmarks.kernels.decode_linear [--rows 1,8,32]

Prints µs and TB/s of one read of the weight for each (product, rows); the floor is that read at --bandwidth.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

from benchmarks.kernels.cuda_timing import graph_time_us
from hybridrl.rollout.kernels.decode_linear import decode_linear

SHAPES = {"qkv": (2048, 1536, False), "o": (1536, 1536, False), "gate_up": (17920, 1536, True),
          "down": (1536, 8960, False), "lm_head": (151936, 1536, False)}
"""name -> (output columns N, input K, SiLU-mul): the 1.5B layer's products and its LM head."""
HBM_BYTES = 256 * 2**20
"""Weights per graph pass: well over the H200's 50 MB L2."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--bandwidth", type=float, default=4.8e12)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/decode_linear.py needs a CUDA GPU.")
    torch.manual_seed(0)
    print(f"{'product':<8} {'rows':>4} {'floor us':>8} {'cuBLAS us':>9} {'TB/s':>5} {'kernel us':>9} {'TB/s':>5}  "
          f"max |diff| from float32", flush=True)
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
            cublas = graph_time_us(lambda: [F.linear(x, w) for w in weights], calls=2, replays=10, per_call=copies)
            kernel = graph_time_us(lambda: [decode_linear(x, w, silu_mul) for w in weights], calls=2, replays=10,
                                   per_call=copies)
            floor = weight_bytes / args.bandwidth * 1e6
            print(f"{name:<8} {rows:>4} {floor:8.1f} {cublas:9.1f} {weight_bytes / cublas / 1e6:5.2f} {kernel:9.1f} "
                  f"{weight_bytes / kernel / 1e6:5.2f}  {diffs[0]:.2e} (cuBLAS {diffs[1]:.2e})", flush=True)
        del weights


if __name__ == "__main__":
    main()
