"""FlexAttention at the two layouts of the GRPO update, side by side (issue 4: why the shared-prompt forward is slow).

In `grpo_step.py`'s profile (2026-11-30, 16:12 UTC section of docs/benchmarks.md) the FlexAttention forward took
571 us per call with shared prompts against 205 us with a row per sample, 2.2x what the attention work would
give, while the backward scaled with the work. This script times the attention alone, at both layouts of one
micro-batch:

- `separate`: each sample in its own row, B = prompts x n rows of P + R tokens, with the trainer's segment mask
  (causal here);
- `causal`: the same rows with a causal mask that reads no tensor (the mask transformers builds), so the cost of
  the segment look-ups in the trainer's mask shows apart from the layout;
- `shared`: one row per prompt, the prompt then its n responses, B = prompts rows of P + n R tokens (padded to 128),
  with the block mask the trainer builds (`shared_prompt.attention_mask_for`, the same code);

each with GQA inside the kernel (`enable_gqa`) and with K/V repeated to every query head (what transformers does
when the query-head count is not a power of two, as Qwen2-0.5B's 14). It prints forward and forward + backward
times, the visible (query, key) pairs, the TFLOP/s on them, the floor at the GPU's dense bf16 peak, and the host
time of building the block mask.

    python benchmarks/flex_layouts.py                      # grpo-0.5b's micro-batch: 14 prompts x 8, P = R = 256
    python benchmarks/flex_layouts.py --quick              # CPU, tiny shapes, forward only, not compiled
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from hybridrl.shared_prompt import PromptLayout, attention_mask_for, pack_shared_prompts, visible

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
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import flex_attention

    if args.quick:
        args.prompts, args.n, args.prompt_len, args.response_len, args.heads, args.kv_heads, args.head_dim = 2, 2, 8, 8, 4, 2, 16
        args.repeats = 1
    device = "cpu" if args.quick else "cuda"
    dtype = torch.float32 if args.quick else torch.bfloat16
    attend = flex_attention if args.quick else torch.compile(flex_attention, dynamic=False)
    results = []
    for name, (segments, mask, mask_ms) in layouts(args.prompts, args.n, args.prompt_len, args.response_len, device).items():
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
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "flex_layouts.json").write_text(json.dumps(dict(args=vars(args), results=results), indent=1))


if __name__ == "__main__":
    main()
