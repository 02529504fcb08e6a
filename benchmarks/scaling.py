"""Data-parallel scaling of one GRPO step: 1 GPU vs 2 GPUs on the same global batch, with the floor.

    python -m benchmarks.scaling --compare                        # runs torchrun with 1 and 2 processes
    torchrun --nproc_per_node 2 -m benchmarks.scaling --shape grpo-0.5b   # one configuration
    python -m benchmarks.scaling --compare --tiny --device cpu    # smoke test on a CPU (numbers meaningless)

One step, as the trainer runs it with `hybridrl.parallel` (process_group, fsdp, sharding): (1) gather the
sharded weights (`gather_for_rollout`), each rank samples n=8 responses for its share of the 64 prompts with the
built-in engine (prompt 256, response 256 forced, temperature 1), generations are all-gathered; (2)
old log-probs on a token-balanced half of the rows per rank, all-gathered; (3) GRPO advantages from
random scores; (4) one optimizer step over the whole batch (rows split by tokens, micro-batches of
`--micro-batch` sequences, gradients summed by FSDP2). With one process the same code runs and every
distributed helper is the identity (no FSDP).

Shapes: grpo-0.5b (Qwen2-0.5B: hidden 896, 24 layers, 14 heads, 2 KV heads), qwen2.5-1.5b (hidden 1536,
intermediate 8960, 28 layers, 12 heads, 2 KV heads) and qwen2.5-7b (hidden 3584, 28 layers, 28 heads, 4 KV
heads, untied head; for 8 GPUs), vocab 151936, tied embeddings below 7B, random init, bf16
parameters (as the trainer loads them on GPU), AdamW, gradient checkpointing on.

The floor per configuration is computed, not measured, for G GPUs: decode reads the weights once per
step on every GPU plus that GPU's share of the KV cache; prefill, old log-probs and training cost
2, 2 and 6 (8 with checkpointing) FLOPs per parameter per token, split over G GPUs. Defaults are the
H200 figures of DESIGN.md (4.2 TB/s, 785 TFLOP/s bf16). Prints a table on rank 0; with --out, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

SHAPES = {
    "grpo-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="grpo-0.5b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward per rank")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--no-grad-ckpt", action="store_true")
    parser.add_argument("--reshard-every-micro-batch", action="store_true",
                        help="FSDP2's default: gather weights and reduce-scatter gradients in every micro-batch")
    parser.add_argument("--kv-cache-memory", type=float, default=0.3)
    parser.add_argument("--attention", default="auto", choices=["auto", "triton", "sdpa"], help="engine decode attention")
    parser.add_argument("--reuse-logprobs", action="store_true",
                        help="skip the old-log-prob pass, as the trainer does on-policy (actor.reuse_logprobs_on_policy)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (model.compile)")
    parser.add_argument("--lean-adamw", action="store_true",
                        help="the trainer's optimizer for bf16 weights (LeanAdamW) instead of torch AdamW")
    parser.add_argument("--shard-size", type=int, default=0,
                        help="trainer.fsdp_shard_size: 0 shards over all ranks, 1 replicates (no weight gathers)")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.2)
    parser.add_argument("--peak-tflops", type=float, default=785.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", help="write rank 0's result as JSON here")
    parser.add_argument("--compare", action="store_true", help="run 1 and 2 processes for each shape and compare")
    parser.add_argument("--gpus", default="1,2", help="process counts for --compare")
    parser.add_argument("--shapes", default="grpo-0.5b,qwen2.5-1.5b", help="shapes for --compare")
    parser.add_argument("--tiny", action="store_true", help="tiny shape, 4 prompts x 2, 16+16 tokens (smoke test)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.shape, args.shapes = "tiny", "tiny"
        args.prompts, args.n, args.prompt_len, args.response_len, args.micro_batch, args.steps = 4, 2, 16, 16, 2, 1
    return args


def build_model(shape: str, device: torch.device):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPES[shape], vocab_size=151936 if shape != "tiny" else 512,
                         tie_word_embeddings=shape != "qwen2.5-7b",
                         max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


class _IdTokenizer:
    """The engine only needs ids; a stand-in so no tokenizer is downloaded."""

    eos_token_id = None
    pad_token_id = 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grpo_step(model, optimizer, prompts, args, setup, timings: dict[str, float]) -> None:
    from hybridrl import algorithms
    from hybridrl.parallel import fsdp, sharding
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.engine.backend import BuiltinBackend
    from hybridrl.training.batch import build_rollout_batch
    from hybridrl.training.logprobs import response_logprobs

    device = setup.device
    params = SamplingParams(max_new_tokens=args.response_len, temperature=1.0, n=args.n, ignore_eos=True, seed=1)
    start = time.perf_counter()
    model.eval()
    with torch.no_grad(), fsdp.gather_for_rollout(model) as weights:
        engine = BuiltinBackend(model, tokenizer=_IdTokenizer(), kv_cache_memory=args.kv_cache_memory,
                                attention=args.attention)
        generations = sharding.generate_sharded(engine, prompts, params, setup)
        engine.release_memory()
    model.train()
    batch = build_rollout_batch(prompts, generations, 0, args.response_len).to(device)
    sync(device)
    timings["rollout_s"] = time.perf_counter() - start
    timings["weight_sync_s"] = weights.seconds

    start = time.perf_counter()
    num_tokens = batch.attention_mask.sum(1)
    rows = sharding.shard_rows(torch.arange(len(batch), device=device), num_tokens, setup)
    gather_once = not args.reshard_every_micro_batch
    if not args.reuse_logprobs:
        with torch.no_grad(), fsdp.gathered_for_micro_batches(model, gather_once):
            old = [response_logprobs(model, *_inputs(batch, part), batch.response_length)[0]
                   for part in rows.split(args.micro_batch)]
        batch.old_logp = sharding.gather_rows(torch.cat(old), rows, len(batch), setup)
    sync(device)
    timings["logprobs_s"] = time.perf_counter() - start

    start = time.perf_counter()
    scores = torch.rand(len(batch), generator=torch.Generator().manual_seed(7)).to(device)
    batch.advantages, _ = algorithms.grpo_advantages(scores, batch.response_mask, args.n)
    norm = {"num_tokens": batch.response_mask.sum().item(), "num_sequences": len(batch),
            "max_length": batch.response_length}
    parts = rows.split(args.micro_batch)
    with fsdp.gathered_for_micro_batches(model, gather_once):
        for index, part in enumerate(parts):
            fsdp.sync_gradients(model, index == len(parts) - 1, gather_once)
            logp, _ = response_logprobs(model, *_inputs(batch, part), batch.response_length)
            old_logp = logp.detach() if args.reuse_logprobs else batch.old_logp[part]
            loss, _ = algorithms.policy_loss(logp, old_logp, batch.advantages[part],
                                             batch.response_mask[part], clip_low=0.2, clip_high=0.2, **norm)
            loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    timings["update_s"] = time.perf_counter() - start


def _inputs(batch, rows):
    return batch.input_ids[rows], batch.attention_mask[rows], batch.position_ids[rows]


def floor(model_params: int, kv_bytes_per_token: int, args, num_gpus: int) -> float:
    """Seconds per step that no implementation on `num_gpus` such GPUs can beat (see the module docstring)."""
    bandwidth, peak = args.bandwidth_tbs * 1e12, args.peak_tflops * 1e12
    sequences = args.prompts * args.n / num_gpus
    decode = 0.0
    for step in range(args.response_len):
        context = args.prompt_len + step
        decode += (2 * model_params + sequences * context * kv_bytes_per_token) / bandwidth
    tokens = args.prompts * args.n * (args.prompt_len + args.response_len)
    prefill = 2 * model_params * args.prompts * args.prompt_len / num_gpus / peak
    # update (+ recompute) and, unless skipped on-policy, the old log-probs
    train_flops_per_token = (6 if args.no_grad_ckpt else 8) + (0 if args.reuse_logprobs else 2)
    return decode + prefill + train_flops_per_token * model_params * tokens / num_gpus / peak


def run_one(args) -> dict | None:
    from hybridrl.parallel import fsdp, process_group

    setup = process_group.init_from_env(args.device, hang_timeout_s=None, shard_size=args.shard_size)
    model = build_model(args.shape, setup.device)
    num_params = sum(p.numel() for p in model.parameters())
    config = model.config
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 2
    if not args.no_grad_ckpt:
        model.gradient_checkpointing_enable()
    fsdp.parallelize(model, setup)
    if args.compile:  # model.compile in the trainer
        from hybridrl.models.loading import compile_layers

        compile_layers(model)
    if args.lean_adamw:  # what the trainer builds for bf16 weights: float32 moments, no float32 weight copy
        from hybridrl.training.optim import build_optimizer

        optimizer = build_optimizer(model.parameters(), lr=1e-6)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    steps = []
    for step in range(args.steps + 1):
        if setup.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(setup.device)
        timings: dict[str, float] = {}
        start = time.perf_counter()
        grpo_step(model, optimizer, prompts, args, setup, timings)
        timings["step_s"] = time.perf_counter() - start
        if step:  # the first step compiles graphs and allocates; not timed
            steps.append(timings)
    mean = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}
    peak = torch.cuda.max_memory_allocated(setup.device) / 2**30 if setup.device.type == "cuda" else 0.0
    slowest = process_group.reduce_metrics({**mean, "peak_gib": peak}, setup)  # mean over ranks
    peak_max = process_group.all_reduce(torch.tensor([peak], device=setup.device), setup, op="max").item()
    variant = ("/reshard" if args.reshard_every_micro_batch else "") + (f"/shard{args.shard_size}" if args.shard_size else "") \
        + ("/reuse" if args.reuse_logprobs else "") + ("/lean" if args.lean_adamw else "") \
        + ("/compile" if args.compile else "")
    result = {"shape": args.shape + variant, "gpus": setup.world_size,
              **slowest, "peak_gib_max": peak_max,
              "params": num_params, "generated_tokens": args.prompts * args.n * args.response_len,
              "floor_s": floor(num_params, kv_bytes, args, setup.world_size), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "cpu"}
    process_group.shutdown(setup)
    if setup.is_main:
        if args.out:
            with open(args.out, "w") as file:
                json.dump(result, file)
        print_table([result])
    return result


def print_table(results: list[dict]) -> None:
    header = ("shape", "GPUs", "step s", "rollout", "logprobs", "update", "w-sync", "gen tok/s", "peak GiB/GPU",
              "floor s", "% floor", "speed-up")
    rows = []
    base = {r["shape"].split("/")[0]: r["step_s"] for r in results if r["gpus"] == 1}
    for r in results:
        speedup = f"{base[r['shape'].split('/')[0]] / r['step_s']:.2f}x" if r["shape"].split("/")[0] in base else "-"
        rows.append((r["shape"], str(r["gpus"]), f"{r['step_s']:.2f}", f"{r['rollout_s']:.2f}", f"{r['logprobs_s']:.2f}",
                     f"{r['update_s']:.2f}", f"{r['weight_sync_s']:.3f}", f"{r['generated_tokens'] / r['step_s']:,.0f}",
                     f"{r['peak_gib_max']:.1f}", f"{r['floor_s']:.2f}", f"{100 * r['floor_s'] / r['step_s']:.0f}%", speedup))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)), flush=True)


def compare(args) -> None:
    """torchrun this script with each process count and shape; one table at the end."""
    results = []
    passthrough = [a for a in sys.argv[1:] if a not in ("--compare",)]
    for shape in args.shapes.split(","):
        for gpus in [int(g) for g in args.gpus.split(",")]:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                           "-m", "benchmarks.scaling", *passthrough, "--shape", shape, "--out", out.name]
                print(f"== {shape} on {gpus} process(es): {' '.join(command)}", flush=True)
                root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `benchmarks` is found
                path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
                finished = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
                if finished.returncode != 0:  # keep going: the other configurations still get measured
                    print(f"== {shape} on {gpus} process(es) FAILED (exit {finished.returncode})", flush=True)
                    continue
                results.append(json.load(open(out.name)))
    print()
    print_table(results)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "scaling_benchmark.json"), "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    arguments = parse_args()
    compare(arguments) if arguments.compare else run_one(arguments)
