"""The decode step's narrow projections on the grpo-0.5b shape (hidden 896, intermediate 4864, bf16), cuBLAS (what the
engine runs by default) against the split-K Triton kernel (`hybridrl/rollout/projection_kernels.py`) over launch
configurations:

- down: Inductor's silu(gate) * up kernel + cuBLAS's down projection, against the kernel with the SwiGLU in its
  operand load (opt-in `BuiltinBackend(fuse_mlp_down=True)`);
- o: cuBLAS's o projection, against the kernel (opt-in `BuiltinBackend(split_k_o_proj=True)`).

Each includes the next piece's residual add (the kernel's float32 partial sums are summed there), compiled as the
engine compiles it, and is timed in one CUDA graph over 24 distinct weight copies (one per layer, so weights come from
HBM); the error column is the largest difference from the cuBLAS path's output (bf16). Then whole rollouts
(`rollout.py`'s shape) with each option and both, alternating in one process, best of `--repeats`.

    python3 benchmarks/decode_projections.py [--rows 512,256] [--repeats 3] [--no-rollout]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import graph_time_us  # noqa: E402
from rollout import build_model  # noqa: E402

from hybridrl.rollout.base import SamplingParams  # noqa: E402
from hybridrl.rollout.builtin import BuiltinBackend  # noqa: E402
from hybridrl.rollout.projection_kernels import triton_split_k_linear  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS = 896, 4864, 24
CONFIGS = [dict(splits=s, block_m=m, block_n=n, block_k=k, num_warps=w)
           for s, (m, n, k), w in itertools.product((1, 2, 4, 8), ((64, 64, 64), (32, 64, 128), (64, 128, 64),
                                                                  (128, 64, 64), (128, 128, 64)), (4, 8))]
ENGINES = {"default": {}, "fuse_mlp_down": dict(fuse_mlp_down=True), "split_k_o_proj": dict(split_k_o_proj=True),
           "both": dict(fuse_mlp_down=True, split_k_o_proj=True)}


@torch.compile(fullgraph=True)
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@torch.compile(fullgraph=True)
def add_residual(h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return h + (residual.sum(0).to(h.dtype) if residual.dim() == 3 else residual)


def time_projection(rows: int, swiglu: bool) -> list[tuple[str, float, float]]:
    """µs per layer of the cuBLAS path and of each kernel configuration, with the error against cuBLAS."""
    torch.manual_seed(0)
    depth = INTERMEDIATE if swiglu else HIDDEN
    inputs = [(torch.randn(rows, (2 if swiglu else 1) * depth, device="cuda") * 2).to(torch.bfloat16)
              for _ in range(LAYERS)]
    weights = [(torch.randn(HIDDEN, depth, device="cuda") / depth**0.5).to(torch.bfloat16) for _ in range(LAYERS)]
    h = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def cublas_projection(x, w):
        return F.linear(silu_mul(x) if swiglu else x, w)

    reference = add_residual(h, cublas_projection(inputs[0], weights[0])).float()

    def plain():
        for x, w in zip(inputs, weights):
            add_residual(h, cublas_projection(x, w))

    name = "silu·mul kernel + cuBLAS down" if swiglu else "cuBLAS o"
    results = [(name, graph_time_us(plain, calls=4, per_call=LAYERS), 0.0)]
    for config in CONFIGS:
        error = (add_residual(h, triton_split_k_linear(inputs[0], weights[0], swiglu=swiglu, **config)).float()
                 - reference).abs().max().item()

        def split_k(config=config):
            for x, w in zip(inputs, weights):
                add_residual(h, triton_split_k_linear(x, w, swiglu=swiglu, **config))

        label = "split-K, {splits} splits, {block_m}x{block_n}x{block_k}, {num_warps} warps".format(**config)
        results.append((label, graph_time_us(split_k, calls=4, per_call=LAYERS), error))
    return results


def time_rollouts(repeats: int) -> None:
    model = build_model("cuda")
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (64, 256), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=256, temperature=1.0, n=8, seed=0, ignore_eos=True)
    engines = {name: BuiltinBackend(model, **options) for name, options in ENGINES.items()}
    for engine in engines.values():  # compile and capture once
        engine.generate(prompts, params)
    best = {name: float("inf") for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(prompts, params)
            torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"\nrollout (64 prompts x 8, prompt 256, response 256), best of {repeats}, alternating in one process:")
    for name, seconds in best.items():
        stats = engines[name].last_stats
        print(f"  {name:<15} {seconds:.3f} s, {512 * 256 / seconds:,.0f} tok/s "
              f"(o_proj {stats['o_proj']}, mlp_down {stats['mlp_down']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="512,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-rollout", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_projections.py needs a CUDA GPU.")
    for rows, swiglu in itertools.product(map(int, args.rows.split(",")), (True, False)):
        results = time_projection(rows, swiglu)
        print(f"\n{'down (SwiGLU)' if swiglu else 'o'} projection, {rows} rows: µs per layer, cuBLAS then the 12 "
              "fastest kernel configurations (max |error| against cuBLAS, bf16)", flush=True)
        for name, us, error in results[:1] + sorted(results[1:], key=lambda item: item[1])[:12]:
            print(f"  {us:7.2f}  {name}" + (f"  (error {error:.3g})" if error else ""), flush=True)
    if not args.no_rollout:
        time_rollouts(args.repeats)


if __name__ == "__main__":
    main()
