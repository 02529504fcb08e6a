"""7b-full-one-gpu: a full-parameter GRPO step of a Qwen2.5-7B-shaped model on ONE H200: step time, update MFU, peak.

    python -m benchmarks.full_7b_one_gpu                # GPU: the default variants, each in its own process
    python -m benchmarks.full_7b_one_gpu --variants ckpt-offload
    python -m benchmarks.full_7b_one_gpu --tiny         # CPU: a 2-layer model; checks the script

Peers run full-parameter GRPO of a 7B model on eight GPUs; here it is one. The step is the trainer's own
(`benchmarks/grpo_step.py`'s `run_mode`): built-in engine rollout of `--prompts` (16) prompts x `--n` (4) samples,
prompt `--prompt-len` (256), responses forced to `--response-len` (256) tokens, a cheap reward, GRPO advantages, one
optimizer step over the whole batch (log-probs reused on-policy, no KL). The model: Qwen2.5-7B shape (hidden 3584,
intermediate 18944, 28 layers, 28 heads, 4 KV heads, vocab 152064, untied head; 7.6B parameters), random init on the
GPU, bf16 weights, each decoder layer compiled.

What has to fit, per parameter: bf16 weight 2 bytes + bf16 gradient 2 + `LeanAdamW`'s float32 moments 8 (no float32
master copy: the update is rounded stochastically into the bf16 weight) = 12 bytes, 85 GiB for 7.6B, which an H200
(about 140 GiB) holds with room for activations, so the default variants keep everything on the GPU; gradients are
freed before each rollout (`phase_switch.py`) for the KV cache and the engine's stacked projections. The offloaded
variant keeps the moments in pinned CPU memory (`actor.optimizer_offload`: 57 GiB off the GPU, at the price of
streaming them over PCIe both ways in every optimizer step), for cards that cannot hold them.

Variants (each in a fresh process; step 1 compiles and is left out, the mean of the later steps is reported):
- `ckpt`: gradient checkpointing, the whole update in one micro-batch (32k tokens at the default shape), moments
  on the GPU.
- `nockpt-mb4k`: no gradient checkpointing (about 7 MiB of activations per token at this shape), micro-batches of
  4,096 tokens, moments on the GPU: no recomputed forward.
- `ckpt-offload`: `ckpt` with the moments in CPU memory.

Update MFU: the update phase's FLOPs (`long_update.update_flops`: 6 x parameters outside the embedding and head x
tokens, the LM head at response positions, causal attention; recompute not counted) over its wall time, at
`--peak-tflops` (989: the H200's dense bf16 figure) and at DESIGN.md's measured 785. The update floor adds the resident
optimizer step's HBM traffic (not the offloaded variant's PCIe traffic); the rollout floor is `grpo_step.floor`'s (weights and KV read per decode step at 4.2
TB/s, prefill FLOPs at 785 TFLOP/s).

Prints a table last; writes JSON to $OUT/full_7b_one_gpu.json when $OUT is set.
"""

from __future__ import annotations

import argparse

from benchmarks.grpo_step import SHAPES, run_mode
from benchmarks.long_update import (
    MEASURED_MATMUL_TFLOPS,
    add_run_arguments,
    parse_run_arguments,
    print_rows,
    run_variants,
    update_flops,
    update_floor_s,
)

BASE = dict(shape="7b", kv_gib=4.0, max_tokens=32768, offload=False, settings=dict(model__compile=True))
VARIANTS = {
    "ckpt": BASE,
    "nockpt-mb4k": {**BASE, "max_tokens": 4096,
                    "settings": {**BASE["settings"], "model__gradient_checkpointing": False}},
    "ckpt-offload": {**BASE, "offload": True},
}
DEFAULT_VARIANTS = "nockpt-mb4k,ckpt"  # the likelier to reach the MFU goal first, the surer to fit second


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.full_7b_one_gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256, help="every response forced to this length")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per variant; the first is left out")
    add_run_arguments(parser, VARIANTS, DEFAULT_VARIANTS, 240,
                      "CPU: a 2-layer model, 4 prompts x 2, 16 + 8 tokens, no compile")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parse_run_arguments(parser, argv, VARIANTS, dict(prompts=4, n=2, prompt_len=16, response_len=8))
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step compiles and is left out).")
    return args


def variant_spec(name: str, args: argparse.Namespace) -> dict:
    """`grpo_step.run_mode`'s spec for a variant; `--tiny`: the tiny shape on CPU, sdpa, 4-sequence micro-batches."""
    spec = {**VARIANTS[name], "prompts": args.prompts, "n": args.n, "steps": args.steps}
    if args.tiny:
        spec.update(shape="tiny", max_tokens=4 * (args.prompt_len + args.response_len), attn="sdpa",
                    settings={key: value for key, value in spec["settings"].items() if key != "model__compile"})
    return spec


def run_variant(name: str, args: argparse.Namespace) -> dict:
    """One variant in this process: `run_mode`'s result with the update's FLOPs, MFU and floor added."""
    spec = variant_spec(name, args)
    result = run_mode(name, spec, args.prompt_len, args.response_len, "cpu" if args.tiny else "cuda")
    sequences = args.prompts * args.n
    flops = update_flops(SHAPES[spec["shape"]], result["params"], [args.prompt_len + args.response_len] * sequences,
                         sequences * args.response_len)
    update_s = result["mean"]["timing/update_s"]
    rollout_floor = result.pop("floor")
    update_floor = update_floor_s(flops["total"], result["params"], args.peak_tflops, args.bandwidth_tbs)
    return dict(result, variant=name, spec=spec, flops=flops, update_s=update_s,
                update_mfu=flops["total"] / update_s / (args.peak_tflops * 1e12),
                update_mfu_of_measured=flops["total"] / update_s / (MEASURED_MATMUL_TFLOPS * 1e12),
                update_floor_s=update_floor, rollout_floor_s=rollout_floor["prefill_s"] + rollout_floor["decode_s"],
                step_floor_s=rollout_floor["prefill_s"] + rollout_floor["decode_s"] + update_floor)


CHILD_OPTIONS = ("prompts", "n", "prompt_len", "response_len", "steps", "peak_tflops", "bandwidth_tbs")


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\n7b-full-one-gpu: {args.prompts} prompts x {args.n}, prompt {args.prompt_len}, response "
          f"{args.response_len} forced; update MFU at {args.peak_tflops:.0f} TFLOP/s (and at the measured "
          f"{MEASURED_MATMUL_TFLOPS:.0f}); gradient checkpointing's recompute not counted")
    peak = lambda result: f"{result['peak_alloc_gib']:.1f}" if result.get("peak_alloc_gib") else "-"  # noqa: E731
    print_rows(("variant", "step s", "rollout s", "update s", "update MFU", "MFU of 785", "peak GiB",
                "floor s (step / rollout / update)"), results,
               lambda result: (result["variant"], f"{result['step_s']:.2f}",
                               f"{result['mean']['timing/rollout_s']:.2f}", f"{result['update_s']:.2f}",
                               f"{100 * result['update_mfu']:.1f}%", f"{100 * result['update_mfu_of_measured']:.1f}%",
                               peak(result),
                               f"{result['step_floor_s']:.2f} / {result['rollout_floor_s']:.2f} / "
                               f"{result['update_floor_s']:.2f}"))
    for result in results:
        if "error" not in result:
            phases = " ".join(f"{phase} {gib:.1f}" for phase, gib in result["peak_by_phase"].items() if gib >= 0.01)
            print(f"{result['variant']}: {result['params']:,} parameters; peak GiB by phase: {phases}")


def main(argv: list[str] | None = None) -> None:
    run_variants(parse_args(argv), "benchmarks.full_7b_one_gpu", CHILD_OPTIONS, run_variant, print_table)


if __name__ == "__main__":
    main()
