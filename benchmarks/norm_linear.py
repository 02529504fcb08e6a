"""Sweep the fused residual + RMSNorm + linear kernel's launch (`hybridrl/rollout/norm_linear.py`) at the
grpo-0.5b decode shapes, against what it replaces: the compiled residual add + RMSNorm, the cuBLAS matmul
and (gate/up) SiLU·mul, and against the cuBLAS matmul alone (the kernel's target). Times come from CUDA
graph replays (`triton.testing.do_bench_cudagraph`), as the engine runs them. Every configuration is
checked against the reference before it is timed. The best launch per kernel goes to --out as JSON, which
`benchmarks/rollout.py --norm-linear-launch` reads.

    python3 benchmarks/norm_linear.py --out /tmp/norm_linear_best.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

from hybridrl.rollout.norm_linear import Launch, fold_norm, reference_norm_linear, triton_norm_linear


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--qkv-outputs", type=int, default=1152)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping after this long")
    parser.add_argument("--peak-tflops", type=float, default=785.0)
    parser.add_argument("--out", default=None, help="write the best launch per kernel here (JSON)")
    return parser.parse_args()


def candidate_launches() -> list[Launch]:
    """Tile shapes for a few hundred rows; larger tiles first, where a compute-bound matmul wants to be."""
    launches = [Launch(m, n, k, warps, stages)
                for m, n, k in itertools.product((128, 64, 32), (128, 64, 32), (64, 128))
                for warps, stages in ((8, 3), (4, 3), (4, 4), (8, 4), (4, 2))]
    return launches


def unfused(h, residual, norm_weight, weight, eps, swiglu):
    x = h + residual
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * norm_weight
    y = F.linear(normed, weight)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y, x


def sweep_one(name, rows, hidden, outputs, swiglu, args) -> dict:
    torch.manual_seed(0)
    device, dtype, eps = "cuda", torch.bfloat16, 1e-6
    total_outputs = outputs * (2 if swiglu else 1)
    h = torch.randn(rows, hidden, device=device, dtype=dtype)
    residual = torch.randn(rows, hidden, device=device, dtype=dtype)
    weight = torch.randn(total_outputs, hidden, device=device, dtype=dtype) * hidden ** -0.5
    norm_weight = 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)
    folded = fold_norm(weight, norm_weight)
    want_y, want_x = reference_norm_linear(h, (residual,), folded, eps, swiglu)
    flops = 2 * rows * hidden * total_outputs

    compiled = torch.compile(unfused)
    compiled(h, residual, norm_weight, weight, eps, swiglu)
    times = {"unfused (compiled norm + cuBLAS)": do_bench_cudagraph(
                 lambda: compiled(h, residual, norm_weight, weight, eps, swiglu)),
             "cuBLAS matmul alone": do_bench_cudagraph(lambda: F.linear(h, weight))}
    results, start = [], time.perf_counter()
    for launch in candidate_launches():
        if time.perf_counter() - start > args.budget_s:
            print(f"{name}: sweep budget spent after {len(results)} launches")
            break
        try:
            y, x = triton_norm_linear(h, (residual,), folded, eps, swiglu, launch)
            torch.testing.assert_close(x, want_x, atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(y, want_y, atol=3e-2, rtol=3e-2)
            ms = do_bench_cudagraph(lambda: triton_norm_linear(h, (residual,), folded, eps, swiglu, launch))
        except triton.runtime.errors.OutOfResources:
            continue
        results.append((ms, launch))
    results.sort(key=lambda item: item[0])
    print(f"\n{name}: {rows} rows, {hidden} -> {total_outputs}{' (SwiGLU)' if swiglu else ''}, "
          f"{flops / 1e9:.2f} GFLOP, compute floor {flops / (args.peak_tflops * 1e12) * 1e6:.1f} us")
    for label, ms in times.items():
        print(f"  {label:<40} {ms * 1e3:7.1f} us")
    for ms, launch in results[:8]:
        print(f"  fused {tuple(launch)!s:<34} {ms * 1e3:7.1f} us  ({flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s)")
    if results:
        print(f"  fused, the current default {'':<14}"
              + next((f"{ms * 1e3:7.1f} us" for ms, launch in results if launch == Launch(64, 64, 64, 4, 3)), "-"))
    return dict(best=list(results[0][1]) if results else None, best_us=results[0][0] * 1e3 if results else None,
                **{label: ms * 1e3 for label, ms in times.items()})


def main() -> None:
    args = parse_args()
    report = {"qkv": sweep_one("q/k/v", args.rows, args.hidden, args.qkv_outputs, False, args),
              "gate_up": sweep_one("gate/up", args.rows, args.hidden, args.intermediate, True, args)}
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"False": report["qkv"]["best"], "True": report["gate_up"]["best"]}, file)


if __name__ == "__main__":
    main()
