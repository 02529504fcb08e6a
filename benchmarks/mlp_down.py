"""The decode step's MLP after the gate/up matmul, on the grpo-0.5b shape (hidden 896, intermediate 4864, bf16):
Inductor's silu(gate) * up kernel + cuBLAS's down projection (what the engine runs by default) against the split-K
Triton kernel with the activation in its operand load (`hybridrl/rollout/mlp_kernels.py`, opt-in
`BuiltinBackend(fuse_mlp_down=True)`) over launch configurations. Both include the next piece's residual add (the
kernel's float32 partial sums are summed there), are compiled as the engine compiles them and timed in one CUDA graph
over 24 distinct weight copies (one per layer, so weights come from HBM). Then whole rollouts (`rollout.py`'s shape)
with and without the option, alternating in one process, best of `--repeats`.

    python3 benchmarks/mlp_down.py [--rows 512,256] [--repeats 3] [--no-rollout]
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
from hybridrl.rollout.mlp_kernels import triton_swiglu_down  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS = 896, 4864, 24
CONFIGS = [dict(splits=s, block_m=m, block_n=n, block_k=k, num_warps=w)
           for s, (m, n, k), w in itertools.product((1, 2, 4, 8), ((64, 64, 64), (32, 64, 128), (64, 128, 64),
                                                                  (128, 64, 64)), (4, 8))]


@torch.compile(fullgraph=True)
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@torch.compile(fullgraph=True)
def add_residual(h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return h + (residual.sum(0).to(h.dtype) if residual.dim() == 3 else residual)


def time_projections(rows: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    gate_up = [(torch.randn(rows, 2 * INTERMEDIATE, device="cuda") * 2).to(torch.bfloat16) for _ in range(LAYERS)]
    down = [(torch.randn(HIDDEN, INTERMEDIATE, device="cuda") / INTERMEDIATE**0.5).to(torch.bfloat16)
            for _ in range(LAYERS)]
    h = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    reference = add_residual(h, F.linear(silu_mul(gate_up[0]), down[0])).float()

    def plain():
        for x, w in zip(gate_up, down):
            add_residual(h, F.linear(silu_mul(x), w))

    results = [("silu·mul kernel + cuBLAS down", graph_time_us(plain, calls=4, per_call=LAYERS), 0.0)]
    for config in CONFIGS:
        error = (add_residual(h, triton_swiglu_down(gate_up[0], down[0], **config)).float() - reference).abs().max()

        def fused(config=config):
            for x, w in zip(gate_up, down):
                add_residual(h, triton_swiglu_down(x, w, **config))

        name = "fused, {splits} splits, {block_m}x{block_n}x{block_k}, {num_warps} warps".format(**config)
        results.append((name, graph_time_us(fused, calls=4, per_call=LAYERS), error.item()))
    return results


def time_rollouts(repeats: int) -> None:
    model = build_model("cuda")
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (64, 256), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=256, temperature=1.0, n=8, seed=0, ignore_eos=True)
    engines = {fused: BuiltinBackend(model, fuse_mlp_down=fused) for fused in (False, True)}
    for engine in engines.values():  # compile and capture once
        engine.generate(prompts, params)
    best = {fused: float("inf") for fused in engines}
    for _ in range(repeats):
        for fused, engine in engines.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(prompts, params)
            torch.cuda.synchronize()
            best[fused] = min(best[fused], time.perf_counter() - start)
    print(f"\nrollout (64 prompts x 8, prompt 256, response 256), best of {repeats}, alternating in one process:")
    for fused, seconds in best.items():
        print(f"  fuse_mlp_down={fused}: {seconds:.3f} s ({engines[fused].last_stats['mlp_down']}), "
              f"{512 * 256 / seconds:,.0f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="512,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-rollout", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/mlp_down.py needs a CUDA GPU.")
    for rows in map(int, args.rows.split(",")):
        results = time_projections(rows)
        print(f"\n{rows} rows: us per layer (max |error| against the plain path, bf16 outputs)")
        for name, us, error in sorted(results, key=lambda item: item[1]):
            print(f"  {us:7.2f}  {name}" + (f"  (error {error:.3g})" if error else ""), flush=True)
    if not args.no_rollout:
        time_rollouts(args.repeats)


if __name__ == "__main__":
    main()
