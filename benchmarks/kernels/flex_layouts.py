"""FlexAttention at the two layouts of the GRPO update, side by side: whether the shared-prompt forward costs
what its attention work says (a `grpo_step.py --profile` shows the FlexAttention calls inside the update; this
script times the attention alone), at both layouts of one micro-batch:

- `separate`: each sample in its own row, B = prompts x n rows of P + R tokens, with the trainer's segment mask
  (causal here);
- `causal`: the same rows with a causal mask that reads no tensor (the mask transformers builds), so the cost of
  the segment look-ups in the trainer's mask shows apart from the layout;
- `shared`: one row per prompt, the prompt then its n responses, B = prompts rows of P + n R tokens (padded to 128),
  with the block mask the trainer builds (`shared_prompt.attention_mask_for`, the same code);

each with GQA inside the kernel (`enable_gqa`) and with K/V repeated to every query head (what transformers does
when the query-head count is not a power of two, as Qwen2-0.5B's 14). It prints forward and forward + backward
times, the visible (query, key) pairs, the TFLOP/s on them, the floor at the GPU's dense bf16 peak, and the host
time of building the block mask (eagerly, as the trainer does; on GPU also through
`torch.compile(create_block_mask)`, printed last: whether compiling the build would pay).

    python -m benchmarks.kernels.flex_layouts          # grpo-0.5b's micro-batch: 14 prompts x 8, P = R = 256
    python -m benchmarks.kernels.flex_layouts --quick  # CPU, tiny shapes, forward only, not compiled
    python -m benchmarks.kernels.flex_layouts --sweep  # + kernel options at the shared layout, SDPA beside

`--sweep` then times the shared layout (K/V repeated, as transformers runs Qwen2) under FlexAttention kernel
options (tile sizes, warps and stages of the forward and the backward, TMA, the safe-rows and pre-scaled QK
flags) and under `mode="max-autotune-no-cudagraphs"` (inductor's own search; its tables go to stderr), with
SDPA's causal kernel on the separate layout as the peer.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from hybridrl.training.shared_prompt import (
    TUNED_FLEX_TILES,
    PromptLayout,
    attention_mask_for,
    pack_shared_prompts,
    visible,
)

SWEEP = {  # name: FlexAttention kernel_options ("fwd_"/"bwd_" prefixes reach only that pass)
    "default": {},
    "tuned (trainer)": TUNED_FLEX_TILES[(9, 0), 64],
    "safe+prescale": dict(ROWS_GUARANTEED_SAFE=True, PRESCALE_QK=True),
    "tma": dict(USE_TMA=True),
    "fwd 128x64 w4 s3": dict(fwd_BLOCK_M=128, fwd_BLOCK_N=64, fwd_num_warps=4, fwd_num_stages=3),
    "fwd 128x128 w8 s2": dict(fwd_BLOCK_M=128, fwd_BLOCK_N=128, fwd_num_warps=8, fwd_num_stages=2),
    "fwd 64x128 w4 s3": dict(fwd_BLOCK_M=64, fwd_BLOCK_N=128, fwd_num_warps=4, fwd_num_stages=3),
    "fwd 64x64 w4 s3": dict(fwd_BLOCK_M=64, fwd_BLOCK_N=64, fwd_num_warps=4, fwd_num_stages=3),
    "bwd 32x64 w4 s3": dict(bwd_BLOCK_M1=32, bwd_BLOCK_N1=64, bwd_BLOCK_M2=64, bwd_BLOCK_N2=32,
                            bwd_num_warps=4, bwd_num_stages=3),
    "bwd 64x64 w4 s3": dict(bwd_BLOCK_M1=64, bwd_BLOCK_N1=64, bwd_BLOCK_M2=64, bwd_BLOCK_N2=64,
                            bwd_num_warps=4, bwd_num_stages=3),
    "bwd 64x128 w4 s3": dict(bwd_BLOCK_M1=64, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=64,
                             bwd_num_warps=4, bwd_num_stages=3),
    "bwd 32x128 w4 s3": dict(bwd_BLOCK_M1=32, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=32,
                             bwd_num_warps=4, bwd_num_stages=3),
}

PEAK_FLOPS = 989e12
"""Dense bf16 peak of an H100/H200 SXM (tensor cores, no sparsity): the floor's denominator."""


def layouts(prompts: int, n: int, prompt_len: int, response_len: int, device: str) -> dict:
    """Per layout: (segments (B, L), block mask) built by the trainer's own code on fake token ids."""
    stub = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flex_attention"))
    built = {}
    for name, group in (("separate", 1), ("shared", n)):
        rows = prompts * n
        ids = torch.randint(3, 1000, (rows, prompt_len + response_len), device=device)
        prompt_ids = [r // n for r in range(rows)] if group > 1 else list(range(rows))
        layout = PromptLayout(prompt_ids, [prompt_len] * rows, [response_len] * rows)
        packed = pack_shared_prompts(ids, prompt_len, layout, multiple=128 if name == "shared" else 1)
        attention_mask_for(stub, packed)  # the first build pays one-time set-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        mask = attention_mask_for(stub, packed)
        if device == "cuda":
            torch.cuda.synchronize()
        built[name] = (packed.segments, mask, (time.perf_counter() - start) * 1e3)
    from torch.nn.attention.flex_attention import create_block_mask

    segments = built["separate"][0]  # the same rows with a mask that reads no tensor: transformers' causal one
    start = time.perf_counter()
    causal = create_block_mask(lambda b, h, q, kv: kv <= q, B=None, H=None, Q_LEN=segments.shape[1],
                               KV_LEN=segments.shape[1], device=device)
    built["causal"] = (segments, causal, (time.perf_counter() - start) * 1e3)
    return built


def visible_pairs(segments: torch.Tensor) -> int:
    index = torch.arange(segments.shape[1], device=segments.device)
    return sum(int(visible(row[:, None], row[None, :], index[:, None], index[None, :]).sum()) for row in segments)


def timed(fn, repeats: int, device: str) -> float:
    """Milliseconds per call, after warm-up (compilation)."""
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=14, help="prompts per micro-batch (grpo-0.5b at 32k tokens: 14)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shapes, forward only, eager")
    parser.add_argument("--sweep", action="store_true", help="then kernel options at the shared layout (GPU)")
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import flex_attention

    if args.quick:
        args.prompts, args.n, args.prompt_len, args.response_len, args.heads, args.kv_heads, args.head_dim = 2, 2, 8, 8, 4, 2, 16
        args.repeats = 1
    device = "cpu" if args.quick else "cuda"
    dtype = torch.float32 if args.quick else torch.bfloat16
    attend = flex_attention if args.quick else torch.compile(flex_attention, dynamic=False)
    torch._dynamo.config.recompile_limit = 64  # one compile per layout, K/V form and grad mode (the causal row hit 8)
    results = []
    built = layouts(args.prompts, args.n, args.prompt_len, args.response_len, device)
    for name, (segments, mask, mask_ms) in built.items():
        rows, length = segments.shape
        pairs = visible_pairs(segments)
        flops = 4 * pairs * args.heads * args.head_dim  # QK^T and PV, 2 FLOPs per multiply-add
        for kv in ("gqa", "repeat"):
            kv_heads = args.kv_heads if kv == "gqa" else args.heads

            def tensors(grad: bool):
                shapes = ((rows, args.heads, length, args.head_dim), (rows, kv_heads, length, args.head_dim))
                q = torch.randn(shapes[0], device=device, dtype=dtype, requires_grad=grad)
                k, v = (torch.randn(shapes[1], device=device, dtype=dtype, requires_grad=grad) for _ in range(2))
                return q, k, v

            q, k, v = tensors(False)
            forward_ms = timed(lambda: attend(q, k, v, block_mask=mask, enable_gqa=kv == "gqa"), args.repeats, device)
            backward_ms = None
            if not args.quick:  # CPU FlexAttention has no backward
                qg, kg, vg = tensors(True)
                grad = torch.randn_like(qg)
                backward_ms = timed(lambda: attend(qg, kg, vg, block_mask=mask, enable_gqa=kv == "gqa").backward(grad),
                                    args.repeats, device)
            results.append(dict(layout=name, kv=kv, rows=rows, length=length, visible_pairs=pairs,
                                forward_ms=forward_ms, forward_backward_ms=backward_ms, mask_ms=mask_ms,
                                forward_tflops=flops / forward_ms / 1e9,
                                forward_floor_ms=flops / PEAK_FLOPS * 1e3, training_floor_ms=3.5 * flops / PEAK_FLOPS * 1e3))
    print(f"{'layout':9} {'kv':7} {'B x L':>11} {'pairs M':>8} {'fwd ms':>8} {'TFLOP/s':>8} {'fwd floor':>9} "
          f"{'fwd+bwd ms':>10} {'floor':>7} {'mask ms':>8}")
    for r in results:
        both = "-" if r["forward_backward_ms"] is None else f"{r['forward_backward_ms']:.3f}"
        print(f"{r['layout']:9} {r['kv']:7} {r['rows']:>4} x {r['length']:<4} {r['visible_pairs'] / 1e6:>8.2f} "
              f"{r['forward_ms']:>8.3f} {r['forward_tflops']:>8.1f} {r['forward_floor_ms']:>9.3f} {both:>10} "
              f"{r['training_floor_ms']:>7.3f} {r['mask_ms']:>8.2f}")
    print(f"floor: visible pairs x {args.heads} heads x {args.head_dim} x 4 FLOPs at {PEAK_FLOPS / 1e12:.0f} TFLOP/s "
          "(forward; forward + backward counts 3.5x: the backward recomputes QK^T and does 4 more matmuls)")
    swept = sweep(args, built) if args.sweep and not args.quick else []
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "flex_layouts.json").write_text(
            json.dumps(dict(args=vars(args), results=results, sweep=swept), indent=1))
    if not args.quick:  # last, so a failure here costs only this line (not yet run on a GPU)
        try:
            compiled_mask_build(built["shared"][0])
        except Exception as error:  # noqa: BLE001
            print(f"compiled block-mask build failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}")


def compiled_mask_build(segments: torch.Tensor, repeats: int = 20) -> float:
    """Milliseconds to build the shared layout's block mask with `create_block_mask` compiled (the trainer
    builds it eagerly, the table's "mask ms", once per micro-batch and pass), after two warm-up builds."""
    from torch.nn.attention.flex_attention import create_block_mask

    from hybridrl.training.shared_prompt import visible

    build = torch.compile(create_block_mask)
    num_rows, length = segments.shape

    def mask_mod(b, h, q, kv):
        return visible(segments[b, q], segments[b, kv], q, kv)

    def once():
        return build(mask_mod, B=num_rows, H=None, Q_LEN=length, KV_LEN=length, device=segments.device)

    milliseconds = timed(once, repeats, "cuda")
    print(f"shared layout's block mask built by torch.compile(create_block_mask): {milliseconds:.2f} ms")
    return milliseconds


def sweep(args, built: dict) -> list[dict]:
    """Forward and forward + backward ms of the shared layout per kernel option set, then SDPA's causal kernel on
    the separate rows; each printed as it finishes (a compile that fails costs one line, not the table)."""
    from torch.nn.attention.flex_attention import flex_attention

    segments, mask, _ = built["shared"]
    rows, length = segments.shape
    shape = (rows, args.heads, length, args.head_dim)
    rows_out = []
    print(f"\nkernel options, shared layout {rows} x {length}, K/V repeated to {args.heads} heads")
    print(f"{'options':20} {'fwd ms':>8} {'fwd+bwd ms':>10}")
    variants = [(name, options, torch.compile(flex_attention, dynamic=False)) for name, options in SWEEP.items()]
    variants.append(("max-autotune", {}, torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")))
    for name, options, attend in variants:
        torch._dynamo.reset()
        try:
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            forward_ms = timed(lambda: attend(q, k, v, block_mask=mask, kernel_options=options), args.repeats, "cuda")
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            grad = torch.randn_like(qg)
            both_ms = timed(lambda: attend(qg, kg, vg, block_mask=mask, kernel_options=options).backward(grad),
                            args.repeats, "cuda")
        except Exception as error:  # noqa: BLE001 - one option set failing to compile is a result too
            print(f"{name:20} failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            continue
        rows_out.append(dict(options=name, kernel_options=options, forward_ms=forward_ms, forward_backward_ms=both_ms))
        print(f"{name:20} {forward_ms:>8.3f} {both_ms:>10.3f}", flush=True)
    separate = built["separate"][0]
    shape = (separate.shape[0], args.heads, separate.shape[1], args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    forward_ms = timed(lambda: sdpa(q, k, v, is_causal=True), args.repeats, "cuda")
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    grad = torch.randn_like(qg)
    both_ms = timed(lambda: sdpa(qg, kg, vg, is_causal=True).backward(grad), args.repeats, "cuda")
    rows_out.append(dict(options="sdpa causal, separate rows", forward_ms=forward_ms, forward_backward_ms=both_ms))
    print(f"{'sdpa (separate rows)':20} {forward_ms:>8.3f} {both_ms:>10.3f}   ({shape[0]} x {shape[2]}, is_causal)")
    return rows_out


if __name__ == "__main__":
    main()
