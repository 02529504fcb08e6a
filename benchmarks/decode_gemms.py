"""The decode step's projections at small batch: cuBLAS as the engine calls it against split-K by hand.

At 512 rows the grpo-0.5b down projection (K = 4864, N = 896) has only 8 x 14 output tiles of 64 x 64 for
132 SMs, and the o projection (K = N = 896) the same, so cuBLAS runs them at ~22-52% of peak (profile in
docs/rollout.md). Split-K cuts K into `s` slices computed as one batched matmul ((s, M, K/s) @ (s, K/s, N),
s times the tiles), then sums the slices -- in the engine that sum would ride in the next RMSNorm kernel,
which already adds the residuals. Each variant is timed as the engine runs it: compiled together with
`rmsnorm(residual + projection)`, captured in one CUDA graph over 24 distinct weight copies (one per
layer, so the weights come from HBM, not L2), and checked against a float32 reference first.

    python3 benchmarks/decode_gemms.py [--rows 512,256] [--splits 2,4]

Prints one table (us per call, TFLOP/s, error against float32); JSON to $OUT/decode_gemms.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import graph_time_us  # noqa: E402

LAYERS = 24
# (name, N, K) of the grpo-0.5b (Qwen2.5-0.5B) decode projections: rows x K @ K x N
SHAPES = [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864)]


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(weight.dtype)


def plain(x, w, residual, norm_weight):
    return rms_norm(residual.float() + torch.nn.functional.linear(x, w).float(), norm_weight)


def split_k(x, w, residual, norm_weight, splits: int, fp32_out: bool):
    rows, k = x.shape
    a = x.view(rows, splits, k // splits).transpose(0, 1)  # (s, M, K/s)
    b = w.view(w.shape[0], splits, k // splits).permute(1, 2, 0)  # (s, K/s, N)
    parts = torch.bmm(a, b, out_dtype=torch.float32) if fp32_out else torch.bmm(a, b)
    return rms_norm(residual.float() + parts.float().sum(0), norm_weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="512,256")
    parser.add_argument("--splits", default="2,4")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_gemms.py needs a CUDA GPU.")
    torch.manual_seed(0)
    results = []
    for rows in map(int, args.rows.split(",")):
        for name, n, k in SHAPES:
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(LAYERS)]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            norm_weight = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
            expected = rms_norm(residual.float() + x.float() @ weights[0].float().T, norm_weight.float())
            variants = {"cuBLAS linear": plain}
            for splits in map(int, args.splits.split(",")):
                if k % (splits * 8) == 0:
                    for fp32_out in (False, True):
                        label = f"split-K {splits}" + (" fp32 out" if fp32_out else " bf16 out")
                        variants[label] = (lambda s, f: lambda *a: split_k(*a, splits=s, fp32_out=f))(splits, fp32_out)
            for label, fn in variants.items():
                compiled = torch.compile(fn, fullgraph=True)
                try:
                    error = (compiled(x, weights[0], residual, norm_weight).float() - expected).abs().max().item()
                    micros = graph_time_us(lambda: [compiled(x, w, residual, norm_weight) for w in weights], calls=1,
                                           per_call=LAYERS)
                except Exception as exc:  # e.g. out_dtype not supported by this torch: report it, go on
                    print(f"{rows} {name} {label}: failed: {str(exc).splitlines()[0][:120]}", flush=True)
                    continue
                tflops = 2 * rows * n * k / micros / 1e6
                results.append(dict(rows=rows, proj=name, n=n, k=k, variant=label, us=micros, tflops=tflops,
                                    max_abs_err=error))
                print(f"{rows} {name} {label}: {micros:.2f} us", flush=True)
    print(f"\n{'rows':>5} {'proj':>8} {'variant':>22} {'us':>7} {'TFLOP/s':>8} {'% peak':>7} {'max err':>9}")
    for r in results:
        print(f"{r['rows']:>5} {r['proj']:>8} {r['variant']:>22} {r['us']:>7.2f} {r['tflops']:>8.0f} "
              f"{100 * r['tflops'] / args.peak_tflops:>6.0f}% {r['max_abs_err']:>9.2e}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_gemms.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
