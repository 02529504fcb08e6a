"""long-update: the GRPO update alone on 8k-token sequences, Qwen2.5-1.5B shape, one GPU: peak memory, MFU, tokens/s.

    python -m benchmarks.long_update                   # GPU: the default variants, each in its own process
    python -m benchmarks.long_update --variants ckpt,nockpt-compile
    python -m benchmarks.long_update --tiny            # CPU: a 2-layer model and short sequences; checks the script

What is timed is `RLTrainer.update` as a step runs it (response log-probs through the chunked LM head, the GRPO loss,
backward, gradient clipping and the AdamW step), on a batch built without a rollout: `--sequences` (16) sequences of
`--seq-len` (8,192) tokens, a `--prompt-len` (512) prompt shared by each group of `--n` (8) samples, random token ids,
random scores turned into GRPO advantages by the trainer itself. Every sequence is full length, so nothing is padded:
the log-prob pass runs without a mask and SDPA takes its causal flash kernel. The model is Qwen2.5-1.5B-shaped (hidden
1536, intermediate 8960, 28 layers, 12 heads, 2 KV heads, vocab 151936, tied embeddings), random init on the GPU, bf16
weights, `LeanAdamW` with float32 moments on the GPU (12 GiB: no offload needed for 1.5B), one optimizer step per
update. The first update compiles and warms up and is left out; the others are timed and the best one reported.

Variants (what it takes to fit 8k-token sequences; each runs in a fresh process, so its peak is its own), all with
micro-batches of two sequences (`actor.max_tokens_per_micro_batch` = 2 x `--seq-len`: 16k tokens):
- `ckpt`: gradient checkpointing, eager layers.
- `ckpt-compile`: the same with each decoder layer torch.compiled (`model.compile`).
- `nockpt-compile`: no gradient checkpointing (every activation kept: about 3 MiB per token at this shape, some
  50 GiB for a 16k-token micro-batch), compiled: no recomputed forward, more memory.
The LM head is never materialised whole: `logprobs.py` runs it in chunks with the fused Triton softmax statistics on
CUDA (`fused_head.py`), so the 152k-wide logits of 8k positions (2.3 GiB per sequence in bf16) never exist at once.

MFU counts the FLOPs of the work itself, at `--peak-tflops` (989: the H200's dense bf16 figure; the table also gives
the share of DESIGN.md's measured 785 TFLOP/s matmul rate): 6 x (parameters outside the embedding) x tokens, plus the
LM head, 6 x vocab x hidden per response token (it runs only where a response token is predicted), plus causal
attention, 6 x layers x (heads x head dim) x sum of squared sequence lengths (QK^T and PV, forward and backward,
half the square). Recomputed work is not counted: gradient checkpointing's second forward, nor the LM head's logits,
which its backward makes again chunk by chunk instead of keeping them (`logprobs.py`). The floor is those FLOPs
at the peak plus the optimizer step's HBM traffic (22 bytes per parameter at `--bandwidth-tbs`).

Prints a table last; writes JSON to $OUT/long_update.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.grpo_step import build_tokenizer, child, even_fraction
from benchmarks.long_tail import QWEN25_15B, apply_tiny_defaults
from benchmarks.rollout import TINY

H200_DENSE_BF16_TFLOPS = 989.0
"""The H200's dense bf16 tensor-core peak (NVIDIA's data sheet): the MFU denominator of the goals."""
MEASURED_MATMUL_TFLOPS = 785.0
"""The bf16 matmul rate measured on the lent H200 (DESIGN.md), the denominator of the older benchmarks."""
OPTIMIZER_BYTES_PER_PARAMETER = 22
"""A resident LeanAdamW step: reads bf16 weight and gradient and float32 moments, writes the moments and the weight."""
VARIANTS = {
    "ckpt": dict(checkpointing=True, compile=False),
    "ckpt-compile": dict(checkpointing=True, compile=True),
    "nockpt-compile": dict(checkpointing=False, compile=True),
}
SEQUENCES_PER_MICRO_BATCH = 2
DEFAULT_VARIANTS = "ckpt-compile,nockpt-compile"


def update_flops(shape: dict, params: int, sequence_lengths: list[int], response_tokens: int) -> dict:
    """FLOPs of one training pass (forward + backward) of a Qwen2/Llama-shaped model over the given sequences, with
    the LM head applied at `response_tokens` positions only (see the module docstring)."""
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    embedding_copies = 1 if shape.get("tie_word_embeddings", True) else 2
    body = params - embedding_copies * vocab * hidden
    matmul = 6 * body * sum(sequence_lengths)
    head = 6 * vocab * hidden * response_tokens
    attention = 6 * shape["num_hidden_layers"] * hidden * sum(length * length for length in sequence_lengths)
    return dict(body_params=body, matmul=matmul, head=head, attention=attention, total=matmul + head + attention)


def update_floor_s(flops: float, params: int, peak_tflops: float, bandwidth_tbs: float) -> float:
    """The update's floor: its FLOPs at the peak, then the resident optimizer step's bytes at the bandwidth."""
    return flops / (peak_tflops * 1e12) + OPTIMIZER_BYTES_PER_PARAMETER * params / (bandwidth_tbs * 1e12)


def synthetic_batch(num_prompts: int, n: int, prompt_len: int, response_len: int, vocab: int, pad_token_id: int,
                    seed: int = 0):
    """A rollout batch as `build_rollout_batch` makes it, without a rollout: random prompts and responses of exactly
    the given lengths (stopped, so no loss mask drops them) and random scores; advantages are the trainer's to make."""
    import torch

    from hybridrl.rollout.base import Generation, SamplingParams
    from hybridrl.training.batch import build_rollout_batch

    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=generator).tolist() for _ in range(num_prompts)]
    generations = [Generation(index // n, torch.randint(3, vocab, (response_len,), generator=generator).numpy(),
                              torch.zeros(response_len).numpy(), "stop") for index in range(num_prompts * n)]
    sampling = SamplingParams(max_new_tokens=response_len, n=n, temperature=1.0)
    batch = build_rollout_batch(prompts, generations, pad_token_id, response_len, sampling=sampling)
    batch.scores = torch.rand(len(generations), generator=generator)
    return batch


def add_run_arguments(parser: argparse.ArgumentParser, variants: dict, default: str, timeout: int,
                      tiny_help: str) -> None:
    """The options both scripts share: which variants, the MFU and floor denominators, the per-variant time limit,
    `--tiny` (`--quick`, the flag `grpo_step.child` passes) and the hidden `--child`."""
    parser.add_argument("--variants", default=default, help=f"comma-separated subset of {', '.join(variants)}")
    parser.add_argument("--peak-tflops", type=float, default=H200_DENSE_BF16_TFLOPS)
    parser.add_argument("--bandwidth-tbs", type=float, default=4.2)
    parser.add_argument("--timeout", type=int, default=timeout, help="seconds per variant")
    parser.add_argument("--budget", type=int, default=0,
                        help="seconds for all variants (0: no limit): a variant gets at most what is left, and none "
                             "starts with less than a minute left, so no variant's process outlives the call")
    parser.add_argument("--tiny", "--quick", dest="tiny", action="store_true", help=tiny_help)
    parser.add_argument("--child", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_update", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=16, help="sequences in the update (a multiple of --n)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence, prompt included")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--updates", type=int, default=3, help="updates per variant; the first is left out")
    add_run_arguments(parser, VARIANTS, DEFAULT_VARIANTS, 150,
                      "CPU: a 2-layer model, 4 sequences of 64 tokens, no compile")
    return parser


def parse_run_arguments(parser: argparse.ArgumentParser, argv: list[str] | None, variants: dict,
                        tiny_defaults: dict) -> argparse.Namespace:
    """Parse; `--tiny` puts `tiny_defaults` in place of the defaults not given; an unknown variant is refused."""
    args = parser.parse_args(argv)
    if args.tiny:
        apply_tiny_defaults(parser, args, {**tiny_defaults, "timeout": 300})
    unknown = [name for name in args.variants.split(",") if name not in variants]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(variants)}.")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parse_run_arguments(parser, argv, VARIANTS, dict(sequences=4, n=2, seq_len=64, prompt_len=16, updates=2))
    if args.sequences % args.n or args.prompt_len >= args.seq_len or args.updates < 2:
        parser.error("--sequences must be a multiple of --n, --prompt-len below --seq-len, and --updates at least 2 "
                     "(the first update warms up and is left out).")
    return args


def run_variant(name: str, args: argparse.Namespace) -> dict:
    """One variant in this process: build the model and trainer, time `--updates` updates of the synthetic batch."""
    import torch

    from benchmarks.rollout import build_model
    from hybridrl import PromptDataset
    from hybridrl.models.loading import HFModel
    from hybridrl.training.trainer import RLTrainer

    spec = VARIANTS[name]
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    shape = TINY if args.tiny else QWEN25_15B
    model = build_model(device, shape).train()  # random init on the device, bf16; train mode: HF checkpoints only then
    if device == "cpu":
        model = model.float()
    tokenizer = build_tokenizer(shape["vocab_size"])
    response_len = args.seq_len - args.prompt_len
    dataset = PromptDataset([{"prompt": "t5 t6 t7"}], tokenizer, max_length=8, use_chat_template=False)
    trainer = RLTrainer(
        actor=HFModel(model, tokenizer), reward_fn=even_fraction, dataset=dataset, trainer__device=device,
        trainer__prompts_per_step=1, trainer__total_steps=args.updates, trainer__save_model=False,
        trainer__output_dir=tempfile.mkdtemp(), logging__sinks=["jsonl"], rollout__backend="hf",
        rollout__num_samples_per_prompt=args.n, rollout__max_new_tokens=response_len, algorithm__name="grpo",
        algorithm__kl_coef=0.0, actor__lr=1e-6, actor__micro_batch_size=args.sequences,
        actor__max_tokens_per_micro_batch=SEQUENCES_PER_MICRO_BATCH * args.seq_len,
        model__gradient_checkpointing=spec["checkpointing"], model__compile=spec["compile"] and device == "cuda")
    batch = synthetic_batch(args.sequences // args.n, args.n, args.prompt_len, response_len, shape["vocab_size"],
                            trainer.parts.pad_token_id).to(trainer.device)
    trainer.compute_logprobs(batch)  # on-policy: nothing to compute, the update provides the old log-probs
    trainer.compute_advantages(batch)
    params = sum(p.numel() for p in model.parameters())
    updates = []
    for index in range(args.updates):
        if device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        metrics = trainer.update(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        trainer.step_count += 1
        updates.append(dict(seconds=time.perf_counter() - start, loss=metrics["actor/policy_loss"],
                            allocated_before_gib=before / 2**30 if device == "cuda" else None,
                            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                            reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else None))
        print(name, "update", index + 1, json.dumps(updates[-1]), flush=True)
    flops = update_flops({**shape, "tie_word_embeddings": True}, params, [args.seq_len] * args.sequences,
                         args.sequences * response_len)
    best = min(updates[1:], key=lambda update: update["seconds"])
    return dict(variant=name, **spec, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                params=params, tokens=args.seq_len * args.sequences, flops=flops, updates=updates,
                seconds=best["seconds"], tokens_per_s=args.seq_len * args.sequences / best["seconds"],
                mfu=flops["total"] / best["seconds"] / (args.peak_tflops * 1e12),
                mfu_of_measured=flops["total"] / best["seconds"] / (MEASURED_MATMUL_TFLOPS * 1e12),
                floor_s=update_floor_s(flops["total"], params, args.peak_tflops, args.bandwidth_tbs),
                peak_gib=max((u["peak_gib"] or 0.0) for u in updates[1:]) if device == "cuda" else None,
                resident_gib=best["allocated_before_gib"], train_mode=model.training,
                checkpointing_active=model.training and bool(getattr(model, "is_gradient_checkpointing", False)))


CHILD_OPTIONS = ("sequences", "n", "seq_len", "prompt_len", "updates", "peak_tflops", "bandwidth_tbs")
"""The arguments a variant's process needs (`--tiny`, which sets them, travels as grpo_step's `--quick`)."""


def print_rows(header: tuple[str, ...], results: list[dict], row_of) -> None:
    """An aligned table: `row_of(result)` for each result, a failed variant's last error line in its place."""
    rows = [header]
    for result in results:
        if "error" in result:
            last = result["error"].strip().splitlines()[-1] if result["error"].strip() else "?"
            rows.append((result["mode"], "failed: " + last[:100], *[""] * (len(header) - 2)))
        else:
            rows.append(row_of(result))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))


def run_variants(args: argparse.Namespace, module: str, child_options: tuple[str, ...], run_variant,
                 print_table) -> None:
    """`--child NAME`: run that variant here and print its result; otherwise each of `--variants` in a process of
    its own (`grpo_step.child`), the JSON saved to $OUT/<script>.json after each, then the table."""
    if args.child:
        print("RESULT " + json.dumps(run_variant(args.child, args)), flush=True)
        return
    arguments = tuple(str(part) for option in child_options
                      for part in ("--" + option.replace("_", "-"), getattr(args, option)))
    results, deadline = [], time.monotonic() + (args.budget or float("inf"))
    for name in args.variants.split(","):
        left = deadline - time.monotonic()
        if left < 60:
            results.append(dict(mode=name, error=f"not started: {left:.0f} s of --budget {args.budget} left"))
            continue
        results.append(child(name, int(min(args.timeout, left)), args.tiny, module=module, arguments=arguments))
        if os.environ.get("OUT"):  # after every variant, so a run cut short keeps what finished
            Path(os.environ["OUT"], module.rsplit(".", 1)[-1] + ".json").write_text(json.dumps(
                dict(date=time.strftime("%Y-%m-%d"), args=vars(args), variants=results), indent=1))
    print_table(results, args)


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\nlong-update: {args.sequences} sequences x {args.seq_len} tokens (prompt {args.prompt_len}, groups of "
          f"{args.n}), one update each; MFU at {args.peak_tflops:.0f} TFLOP/s (and at the measured "
          f"{MEASURED_MATMUL_TFLOPS:.0f}); gradient checkpointing's recompute not counted")
    gib = lambda result, key: f"{result[key]:.1f}" if result.get(key) is not None else "-"  # noqa: E731
    print_rows(("variant", "update s", "floor s", "tokens/s", "MFU", "MFU of 785", "peak GiB", "resident GiB"), results,
               lambda result: (result["variant"], f"{result['seconds']:.2f}", f"{result['floor_s']:.2f}",
                               f"{result['tokens_per_s']:,.0f}", f"{100 * result['mfu']:.1f}%",
                               f"{100 * result['mfu_of_measured']:.1f}%", gib(result, "peak_gib"),
                               gib(result, "resident_gib")))
    done = [result for result in results if "error" not in result]
    if done:
        flops = done[0]["flops"]
        print(f"FLOPs per update: {flops['total']:.3e} = matmuls {flops['matmul']:.3e} (6 x {flops['body_params']:,} "
              f"parameters x tokens) + LM head {flops['head']:.3e} + attention {flops['attention']:.3e}")


def main(argv: list[str] | None = None) -> None:
    run_variants(parse_args(argv), "benchmarks.long_update", CHILD_OPTIONS, run_variant, print_table)


if __name__ == "__main__":
    main()
