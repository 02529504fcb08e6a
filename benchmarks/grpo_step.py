"""GRPO step benchmark: hybridrl's full step (phases, peak memory, update MFU) next to TRL's GRPOTrainer.

    python -m benchmarks.grpo_step                     # the default modes, TRL included, table last
    python -m benchmarks.grpo_step --modes grpo-0.5b   # one mode
    python -m benchmarks.grpo_step --quick             # tiny shapes on CPU: checks the script, measures nothing
    python -m benchmarks.grpo_step --modes grpo-0.5b-fast,1.5b-full --gpus 1,2   # the trainer itself on 1 and 2
        # GPUs (torchrun, same global batch); on nvidia-h200-x2 export NCCL_NVLS_ENABLE=0
        # TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 first

Modes (random init, bf16 parameters, no KL, one optimizer step per rollout, responses forced to full
length with `ignore_eos`, gradient checkpointing, LeanAdamW with float32 state):
- `grpo-0.5b`: the reference shape of DESIGN.md (Qwen2-0.5B, 64 prompts x 8, prompt 256, response 256),
  built-in rollout engine with a 3.2 GiB KV cache (all 512 sequences at once), 16k-token micro-batches.
- `grpo-0.5b-offload`: the same with the AdamW state in CPU memory.
- `grpo-0.5b-mb8k`: the same with 8k-token micro-batches (less activation memory, smaller matmuls).
- `grpo-0.5b-compile`: `grpo-0.5b` with `model.compile` (each decoder layer torch.compiled).
- `grpo-0.5b-compile-offload`: compiled, AdamW state in CPU memory.
- `grpo-0.5b-compile-offload-mb32k`: the same with 32k-token micro-batches (8 per step instead of 16): whether a
  fixed cost per micro-batch makes smaller ones slower than their compute.
- `grpo-0.5b-fast`: compiled, offloaded moments, 32k-token micro-batches and the engine's stacked q/k/v
  projection (`rollout.engine.fuse_qkv`); `-mb64k` with half as many micro-batches, `-nockpt` without gradient checkpointing.
- `grpo-0.5b-fast-replicated`: `grpo-0.5b-fast` with `trainer.fsdp_shard_size=1`: on several GPUs every
  GPU holds whole weights (no gathers), gradients are all-reduced; on one GPU it is `grpo-0.5b-fast`.
- `grpo-0.5b-fast-resident`: `grpo-0.5b-fast` with the AdamW moments on the GPU (what offloading costs).
- `grpo-0.5b-fused`: `grpo-0.5b-fast` plus the stacked gate/up projection (`rollout.engine.fuse_gate_up`).
- `grpo-0.5b-fused-shared`: `grpo-0.5b-fused` with `actor.share_prompt_tokens` (each prompt once per micro-batch
  in the update, its 8 responses after it, under a FlexAttention block mask): 64 x (256 + 8 x 256) = 147k
  tokens computed instead of 262k. Its update MFU counts the tokens computed, not the 262k they stand for.
- `grpo-0.5b-fused-shared-offload60` / `-offload50`: the shared mode with 40% / 50% of the AdamW moments resident on
  the GPU (the first parameters: fewer PCIe bytes in the optimizer step for more GPU memory).
- `grpo-0.5b-fused-shared-resident`: the shared mode with the AdamW moments on the GPU (no PCIe traffic in the
  optimizer step; with two GPUs, whether their offload copies contend).
- `grpo-0.5b-fused-shared-resident-half`: the resident mode with half the prompts (32 x 8) on one GPU: one rank's
  share of the 64 x 8 batch on 2 GPUs with no communication, so its step time bounds what 2 GPUs can reach
  (1-GPU step / this step = the best 2-GPU speed-up with the work each rank does).
- `grpo-0.5b-fused-shared-replicated`: the resident mode with `trainer.fsdp_shard_size=1` (no gather before the
  rollout or in the update; gradients all-reduced); on one GPU it is the resident mode.
- `grpo-0.5b-fused-shared-torchtiles`: the shared mode with torch's default FlexAttention tiles instead of
  `shared_prompt.TUNED_FLEX_TILES`.
- `grpo-0.5b-fused-flex`: `grpo-0.5b-fused` with the model's attention set to flex_attention and one row per
  sequence, to separate what the attention kernel changes from what sharing saves.
- `grpo-0.5b-fused-replicated`: `grpo-0.5b-fused` with `trainer.fsdp_shard_size=1` (for 1 vs 2 GPUs).
- `grpo-0.5b-fused-offload60`: `grpo-0.5b-fused` with 60% of the AdamW state in CPU memory and 40% (the
  first parameters: embeddings and early layers) on the GPU (`actor.optimizer_offload_fraction=0.6`).
- `grpo-0.5b-kl-refoffload`: `grpo-0.5b-compile-offload` with a KL term (kl_coef 0.05), so a reference
  model exists, kept in CPU memory between its passes (`model.reference_offload`).
- `grpo-0.5b-lean`: compiled, 8k-token micro-batches, a 2 GiB KV cache (the prefix-shared layout needs
  1.8 GiB for 64 prompts x 8 x 512 tokens).
- `grpo-0.5b-nockpt`: compiled, no gradient checkpointing, 4k-token micro-batches.
- `1.5b-full`: Qwen2.5-1.5B shape, full-parameter, optimizer state offloaded, 3 GiB KV cache.
- `1.5b-full-shared`: the same, compiled, with flex attention and shared prompts (its peak against the 20 GiB
  bar of a 24 GB card).
- `7b-full`: Qwen2.5-7B shape, full-parameter, compiled, fused q/k/v: for 8 GPUs (FSDP2).
- `7b-lora`: Qwen2.5-7B shape (untied head), LoRA rank 16 on all linear layers, built-in engine applying
  the adapter in place, 16 prompts x 4 to keep the run short.
- `7b-qlora`: `7b-lora` with the base's linear layers in 4-bit NF4 (`model.load_in_4bit`, needs bitsandbytes),
  quantized in memory after the random init (`qlora.quantize_4bit`, called by the trainer's set-up); rollout
  through HF generate.
- `7b-qlora-engine`: the same with `rollout.backend=builtin`: the engine dequantizes each 4-bit layer as it
  runs it or, with `rollout.engine.dequantize_4bit` (`auto`: as many layers as half the free memory holds), from a
  full-precision copy made once per rollout. `7b-qlora-engine-perstep`: every layer dequantized at every step
  (`rollout.engine.dequantize_4bit=false`). `7b-qlora-engine-20of28`: 20 of the 28 layers copied, the rest dequantized per step
  (what `auto` copies on a 24 GB card by its estimate).
- `trl`: `shared/peers/trl_grpo_gpu.py` (TRL, HF generate, fp32 master weights + bf16 autocast) on the
  grpo-0.5b shape, as a subprocess; its script must be at `--trl-script` with trl/datasets importable.
  Three TRL steps (`TRL_STEPS`), steady state = mean of steps 2-3 as for hybridrl. `--steps N` sets both to N:
  TRL's step time varies from step to step and between machines, so compare in one run and prefer N >= 5 when
  device time allows.

Each mode runs in its own process. Peak memory is the largest `perf/peak_memory_gib` of its steps (the
trainer measures each phase; the table names the peak of each). The
floor is computed: training 6 * params * tokens at `--peak` FLOP/s; rollout as in `rollout.py` (weights
and KV read once per decode step at `--bandwidth`, prefill FLOPs). MFU of the update phase counts
6 * params * tokens (the recompute of gradient checkpointing is not counted as useful work).
JSON goes to $OUT/grpo_step.json when $OUT is set, and each mode's stderr to $OUT/stderr_<mode>.log (run with
TORCH_LOGS=recompiles to see why a later step compiled again: `diag/compiled_frames` counts such frames).
Where time goes: `--profile` (the last step's top kernels and host operations, its Chrome trace in $OUT; read
it later with `python -m benchmarks.profiling.trace_report`), HYBRIDRL_BENCH_HEAD_GRAD_CHUNKS=N (the head
backward's chunks per weight product, `logprobs.GRAD_CHUNKS_PER_PRODUCT`, for an A/B in one call), `--gaps` (the
last two updates' GPU idle time by gap size and by the kernels around each gap, then the host work during the
largest gaps; `benchmarks/profiling/gaps.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.profiling.step_profiling import live_blocks, print_memory_growth, profiled, update_with_gap_report, warm_up_counters

ROOT = Path(__file__).resolve().parents[1]
PEAK_FLOPS, BANDWIDTH = 785e12, 4.2e12
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True),
}
MODES = {
    "grpo-0.5b": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=16384),
    "grpo-0.5b-offload": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=16384, offload=True),
    "grpo-0.5b-mb8k": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=8192),
    "grpo-0.5b-compile": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=16384,
                              settings=dict(model__compile=True)),
    "grpo-0.5b-compile-offload": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=16384,
                                      offload=True, settings=dict(model__compile=True)),
    "grpo-0.5b-compile-offload-mb32k": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768,
                                            offload=True, settings=dict(model__compile=True)),
    "grpo-0.5b-fast": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768, offload=True,
                           settings=dict(model__compile=True, rollout__engine__fuse_qkv=True)),
    "grpo-0.5b-fast-replicated": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768,
                                      offload=True, settings=dict(model__compile=True, rollout__engine__fuse_qkv=True,
                                                                  trainer__fsdp_shard_size=1)),
    "grpo-0.5b-fast-mb64k": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=65536, offload=True,
                                 settings=dict(model__compile=True, rollout__engine__fuse_qkv=True)),  # half the micro-batches
    "grpo-0.5b-fast-nockpt": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=6144, offload=True,
                                  settings=dict(model__compile=True, rollout__engine__fuse_qkv=True,
                                                model__gradient_checkpointing=False)),
    "grpo-0.5b-fused": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768, offload=True,
                            settings=dict(model__compile=True, rollout__engine__fuse_qkv=True,
                                          rollout__engine__fuse_gate_up=True)),
    "grpo-0.5b-fused-shared": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768, offload=True,
                                   attn="flex_attention", settings=dict(model__compile=True, rollout__engine__fuse_gate_up=True,
                                                                        actor__share_prompt_tokens=True)),
    "grpo-0.5b-fused-shared-offload60": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768,
                                             offload=True, attn="flex_attention",
                                             settings=dict(model__compile=True, rollout__engine__fuse_gate_up=True,
                                                           actor__share_prompt_tokens=True,
                                                           actor__optimizer_offload_fraction=0.6)),
    "grpo-0.5b-fused-shared-offload50": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768,
                                             offload=True, attn="flex_attention",
                                             settings=dict(model__compile=True, rollout__engine__fuse_gate_up=True,
                                                           actor__share_prompt_tokens=True,
                                                           actor__optimizer_offload_fraction=0.5)),
    "grpo-0.5b-fused-shared-resident": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768,
                                            offload=False, attn="flex_attention",
                                            settings=dict(model__compile=True, rollout__engine__fuse_gate_up=True,
                                                          actor__share_prompt_tokens=True)),
    "grpo-0.5b-fused-shared-torchtiles": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768,
                                              offload=True, attn="flex_attention", torch_flex_tiles=True,
                                              settings=dict(model__compile=True, rollout__engine__fuse_gate_up=True,
                                                            actor__share_prompt_tokens=True)),
    "grpo-0.5b-fused-flex": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768, offload=True,
                                 attn="flex_attention", settings=dict(model__compile=True, rollout__engine__fuse_gate_up=True)),
    "grpo-0.5b-fused-replicated": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768,
                                       offload=True, settings=dict(model__compile=True, rollout__engine__fuse_gate_up=True,
                                                                   trainer__fsdp_shard_size=1)),
    "grpo-0.5b-fused-offload60": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768,
                                      offload=True, settings=dict(model__compile=True, rollout__engine__fuse_gate_up=True,
                                                                  actor__optimizer_offload_fraction=0.6)),
    "grpo-0.5b-fast-resident": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=32768,
                                    settings=dict(model__compile=True, rollout__engine__fuse_qkv=True)),
    "grpo-0.5b-kl-refoffload": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=3.2, max_tokens=16384, offload=True,
                                    settings=dict(model__compile=True, algorithm__kl_coef=0.05,
                                                  model__reference_offload=True)),
    "grpo-0.5b-lean": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=2.0, max_tokens=8192,
                           settings=dict(model__compile=True)),
    "grpo-0.5b-nockpt": dict(shape="0.5b", prompts=64, n=8, steps=3, kv_gib=2.0, max_tokens=4096,
                             settings=dict(model__compile=True, model__gradient_checkpointing=False)),
    "1.5b-full": dict(shape="1.5b", prompts=64, n=8, steps=2, kv_gib=3.0, max_tokens=16384, offload=True),
    "1.5b-full-shared": dict(shape="1.5b", prompts=64, n=8, steps=3, kv_gib=3.0, max_tokens=16384, offload=True,
                             attn="flex_attention", settings=dict(model__compile=True, actor__share_prompt_tokens=True)),
    "7b-full": dict(shape="7b", prompts=64, n=8, steps=3, kv_gib=8.0, max_tokens=16384, offload=False,
                    settings=dict(model__compile=True, rollout__engine__fuse_qkv=True)),  # 8 GPUs (FSDP2)
    "7b-lora": dict(shape="7b", prompts=16, n=4, steps=2, kv_gib=2.0, max_tokens=8192, lora_rank=16),
    "7b-qlora": dict(shape="7b", prompts=16, n=4, steps=2, kv_gib=2.0, max_tokens=8192, lora_rank=16, backend="hf",
                     settings=dict(model__load_in_4bit=True)),
    "7b-qlora-engine": dict(shape="7b", prompts=16, n=4, steps=2, kv_gib=2.0, max_tokens=8192, lora_rank=16,
                            backend="builtin", settings=dict(model__load_in_4bit=True)),
    "7b-qlora-engine-20of28": dict(shape="7b", prompts=16, n=4, steps=2, kv_gib=2.0, max_tokens=8192, lora_rank=16,
                                   backend="builtin", dequantize_layers=20, settings=dict(model__load_in_4bit=True)),
    "7b-qlora-engine-perstep": dict(shape="7b", prompts=16, n=4, steps=2, kv_gib=2.0, max_tokens=8192, lora_rank=16,
                                    backend="builtin", settings=dict(model__load_in_4bit=True,
                                                                     rollout__engine__dequantize_4bit=False)),
}

_RESIDENT = MODES["grpo-0.5b-fused-shared-resident"]
MODES["grpo-0.5b-fused-shared-resident-half"] = {**_RESIDENT, "prompts": 32}  # one rank's share of 2 GPUs
MODES["grpo-0.5b-fused-shared-replicated"] = {**_RESIDENT,
                                              "settings": {**_RESIDENT["settings"], "trainer__fsdp_shard_size": 1}}


def build_tokenizer(vocab_size: int):
    """Word-level tokenizer over `t<i>` words: any id decodes and re-encodes to itself (as in the TRL script)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(3, vocab_size)}
    vocab.update({"<eos>": 0, "<pad>": 1, "<unk>": 2})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def even_fraction(prompts, completions, **columns):
    """Cheap, varied reward: the fraction of even token ids in the response."""
    words = [[w for w in c.split() if w[1:].isdigit()] for c in completions]
    return [sum(int(w[1:]) % 2 == 0 for w in ws) / max(1, len(ws)) for ws in words]


def run_mode(name: str, spec: dict, prompt_len: int, response_len: int, device: str) -> dict:
    """One mode in this process: build, train `steps` steps, return timings and memory. Under torchrun
    (`--gpus 2`) every rank runs this with the trainer sharding the same global batch; rank 0 reports
    its own timings and peak memory (per GPU)."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1 and device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # build the model on this rank's GPU

    from hybridrl import PromptDataset
    from hybridrl.models.loading import HFModel
    from hybridrl.training import shared_prompt
    from hybridrl.training.trainer import RLTrainer

    if "dequantize_layers" in spec:  # this process only: as if `auto` had found room for that many layers
        import hybridrl.rollout.engine.runner

        hybridrl.rollout.engine.runner.auto_dequantized_layers = lambda model: spec["dequantize_layers"]
    if spec.get("torch_flex_tiles"):  # this process only: FlexAttention with torch's own tiles, for the comparison
        shared_prompt.TUNED_FLEX_TILES.clear()
    shape = SHAPES[spec["shape"]]
    config = Qwen2Config(**shape, max_position_embeddings=4096, eos_token_id=0, pad_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                                 attn_implementation=spec.get("attn", "sdpa"))
    params = sum(p.numel() for p in model.parameters())
    tokenizer = build_tokenizer(shape["vocab_size"])
    rng = random.Random(0)
    records = [{"prompt": " ".join(f"t{rng.randrange(100, shape['vocab_size'])}" for _ in range(prompt_len))}
               for _ in range(spec["prompts"] * spec["steps"])]
    dataset = PromptDataset(records, tokenizer, max_length=prompt_len, use_chat_template=False)
    settings = dict(
        model__gradient_checkpointing=True, model__lora_rank=spec.get("lora_rank", 0),
        rollout__backend=spec.get("backend", "builtin"), rollout__max_new_tokens=response_len,
        rollout__num_samples_per_prompt=spec["n"], rollout__temperature=1.0, rollout__kv_cache_memory=spec["kv_gib"],
        trainer__prompts_per_step=spec["prompts"], trainer__total_steps=spec["steps"], trainer__device=device,
        trainer__save_model=False, trainer__output_dir=tempfile.mkdtemp(), logging__sinks=["jsonl"],
        actor__lr=1e-6, actor__micro_batch_size=min(32, spec["prompts"] * spec["n"]),
        actor__max_tokens_per_micro_batch=spec["max_tokens"], actor__optimizer_offload=spec.get("offload", False),
        algorithm__name="grpo", algorithm__kl_coef=0.0, rollout__ignore_eos=True,
        rollout__engine__attention=os.environ.get("HYBRIDRL_BENCH_ATTENTION", "auto"))
    settings.update(spec.get("settings", {}))
    if world > 1:
        settings["trainer__num_gpus"] = world
    if os.environ.get("HYBRIDRL_BENCH_HEAD_GRAD_CHUNKS"):  # A/B of logprobs.GRAD_CHUNKS_PER_PRODUCT
        import hybridrl.training.logprobs

        hybridrl.training.logprobs.GRAD_CHUNKS_PER_PRODUCT = int(os.environ["HYBRIDRL_BENCH_HEAD_GRAD_CHUNKS"])
    trainer = RLTrainer(actor=HFModel(model, tokenizer), reward_fn=even_fraction, dataset=dataset, **settings)
    trainable = sum(p.numel() for p in trainer.parts.actor.parameters() if p.requires_grad)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps = []
    tracing = os.environ.get("HYBRIDRL_BENCH_MEMORY_TRACE") == "1" and device == "cuda"
    gap_steps = os.environ.get("HYBRIDRL_BENCH_GAPS") == "1" and device == "cuda" and rank == 0
    update = trainer.update
    for index in range(spec["steps"]):
        if tracing and index == 2:  # steps 1-2 allocate what lives all run (compile, caches); growth shows after
            torch.cuda.synchronize()
            blocks_before = live_blocks()
        start = time.perf_counter()
        profiling = os.environ.get("HYBRIDRL_BENCH_PROFILE") == "1" and index == spec["steps"] - 1 and device == "cuda"
        if gap_steps and index >= spec["steps"] - 2:  # the last two updates: GPU activity only, then with the host
            trainer.update = update_with_gap_report(update, name, with_host=index == spec["steps"] - 1)
        with profiled(name) if profiling else contextlib.nullcontext():
            metrics = trainer.step()
        steps.append({**{k: float(v) for k, v in metrics.items() if k.startswith(("timing/", "perf/"))},
                      "wall_s": time.perf_counter() - start, **warm_up_counters(device)})
        if rank == 0:
            print(name, "step", len(steps), json.dumps({k: round(v, 3) for k, v in steps[-1].items()}), flush=True)
    if tracing and rank == 0 and spec["steps"] > 2:
        torch.cuda.synchronize()
        print_memory_growth(name, blocks_before, live_blocks(), spec["steps"] - 2)
    left_out = (2 if gap_steps else 1 if os.environ.get("HYBRIDRL_BENCH_PROFILE") == "1" and device == "cuda" else 0)
    steady = steps[1:len(steps) - left_out] or steps[1:] or steps  # step 1 compiles; profiled steps are slower
    mean = {key: sum(s[key] for s in steady) / len(steady) for key in steady[0]}
    tokens = spec["prompts"] * spec["n"] * (prompt_len + response_len)
    shared = spec.get("settings", {}).get("actor__share_prompt_tokens", False)  # each prompt computed once
    train_flops = 6 * params * (spec["prompts"] * (prompt_len + spec["n"] * response_len) if shared else tokens)
    result = dict(mode=name if world == 1 else f"{name} x{world}", gpus=world, params=params, trainable_params=trainable, tokens_per_step=tokens,
                  generated_per_step=spec["prompts"] * spec["n"] * response_len, steps=steps, mean=mean,
                  step_s=mean["timing/step_s"],
                  peak_alloc_gib=max(s["perf/peak_memory_gib"] for s in steps) if device == "cuda" else None,
                  peak_by_phase={key[len("perf/peak_memory_"):-len("_gib")]: max(s.get(key, 0.0) for s in steps)
                                 for key in steps[0] if key.startswith("perf/peak_memory_") and key != "perf/peak_memory_gib"},
                  peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else None)
    if trainable == params:
        result["update_mfu"] = train_flops / mean["timing/update_s"] / PEAK_FLOPS / world  # per GPU
    result["floor"] = floor(model, config, spec, prompt_len, response_len, train_flops if trainable == params
                            else 2 * params * tokens * 2)  # LoRA: forward + input-gradient backward
    return result


def floor(model, config, spec, prompt_len: int, response_len: int, train_flops: float) -> dict:
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * 2
    head_dim = config.hidden_size // config.num_attention_heads
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2
    sequences = spec["prompts"] * spec["n"]
    prefill = max(2 * params * spec["prompts"] * prompt_len / PEAK_FLOPS, weight_bytes / BANDWIDTH)
    decode = sum(max((weight_bytes + sequences * (prompt_len + 1 + step) * kv_per_token) / BANDWIDTH,
                     2 * params * sequences / PEAK_FLOPS) for step in range(response_len - 1))
    training = train_flops / PEAK_FLOPS
    return dict(prefill_s=prefill, decode_s=decode, training_s=training, step_s=prefill + decode + training)


def run_trl(script: str, timeout: int) -> dict:
    env = {**os.environ, "P": "64", "G": "8", "R": "256", "STEPS": os.environ.get("TRL_STEPS", "3"), "MB": "16"}
    # TRL's Trainer wraps the model in nn.DataParallel when it sees several GPUs, which GRPOTrainer refuses.
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    try:
        done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"mode": "trl", "error": f"timed out after {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"mode": "trl", "error": (done.stderr or done.stdout)[-2000:]}
    out = json.loads(lines[-1])
    print("trl", json.dumps(out), flush=True)  # in the log at once, in case a later mode runs out of time
    return {"mode": "trl", "step_s": out["steady_step_s"], "peak_alloc_gib": out["peak_alloc_GiB"], "raw": out}


def with_root_on_path() -> dict:
    """This process's environment with the repository root first on PYTHONPATH, so a child finds `benchmarks`."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def child(mode: str, timeout: int, quick: bool, gpus: int = 1, module: str = "benchmarks.grpo_step",
          arguments: tuple[str, ...] = ()) -> dict:
    """Run one mode of `module` (`--child MODE [--quick] ARGUMENTS`) in a fresh process (its own peak memory), or
    `gpus` processes under torchrun; the child prints `RESULT <json>`; a failure becomes an `error` entry."""
    launcher = [] if gpus == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    command = [sys.executable, *launcher, "-m", module, "--child", mode, *(["--quick"] if quick else []), *arguments]
    mode = mode if gpus == 1 else f"{mode} x{gpus}"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=with_root_on_path())
    except subprocess.TimeoutExpired as error:
        return {"mode": mode, "error": f"timed out after {timeout} s", "log": str(error.stdout)[-1500:]}
    print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("RESULT ")), flush=True)
    if os.environ.get("OUT") and done.stderr:  # e.g. TORCH_LOGS=recompiles output: why a step compiled again
        (Path(os.environ["OUT"]) / f"stderr_{mode.replace(' ', '_')}.log").write_text(done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"mode": mode, "error": done.stderr[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def print_table(results: list[dict]) -> None:
    ok = {r["mode"]: r for r in results if "error" not in r}
    trl = ok.get("trl")
    print(f"\n{'mode':<19} {'step s':>7} {'rollout':>8} {'logp':>6} {'update':>7} {'peak GiB':>9} {'MFU upd':>8} "
          f"{'floor s':>8}  peak GiB by phase (per GPU)")
    for r in results:
        if "error" in r:
            print(f"{r['mode']:<19} failed: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            continue
        m = r.get("mean", {})
        get = lambda key: f"{m[key]:.2f}" if key in m else "-"
        mfu = f"{100 * r['update_mfu']:.0f}%" if "update_mfu" in r else "-"
        fl = f"{r['floor']['step_s']:.2f}" if "floor" in r else "-"
        peak = f"{r['peak_alloc_gib']:.2f}" if r.get("peak_alloc_gib") else "-"
        print(f"{r['mode']:<19} {r['step_s']:>7.2f} {get('timing/rollout_s'):>8} {get('timing/logprobs_s'):>6} "
              f"{get('timing/update_s'):>7} {peak:>9} {mfu:>8} {fl:>8}  "
              + " ".join(f"{phase} {gib:.2f}" for phase, gib in r.get("peak_by_phase", {}).items() if gib >= 0.01))
    for name, r in ok.items():
        if trl and name.startswith("grpo-0.5b") and r.get("gpus", 1) == 1:
            print(f"{name} vs TRL: {trl['step_s'] / r['step_s']:.2f}x faster per step, "
                  f"{r['peak_alloc_gib'] / trl['peak_alloc_gib']:.2f}x TRL's peak memory")
        if "tokens_per_step" not in r:  # TRL's row: its script reports only step time and memory
            continue
        single = ok.get(name.rsplit(" x", 1)[0])
        gpus = r.get("gpus", 1)
        per_gpu = r["tokens_per_step"] / r["step_s"] / gpus
        switch = r.get("mean", {}).get("perf/weight_sync_s")
        switch_text = f", train->generate switch {switch:.3f} s" if switch is not None else ""
        if r.get("peak_reserved_gib"):  # what the card must hold: allocated peak plus the allocator's cache
            switch_text += f", peak reserved {r['peak_reserved_gib']:.2f} GiB"
        if gpus > 1 and single:
            speedup = single["step_s"] / r["step_s"]
            print(f"{name}: {speedup:.2f}x the speed of 1 GPU (same global batch), scaling efficiency "
                  f"{100 * speedup / gpus:.0f}%, {per_gpu:,.0f} tokens/s per GPU{switch_text}")
        else:
            print(f"{name}: {per_gpu:,.0f} tokens/s per GPU{switch_text}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="grpo-0.5b,trl,1.5b-full,7b-lora,grpo-0.5b-offload")
    parser.add_argument("--trl-script", default=str(ROOT.parent / "shared/peers/trl_grpo_gpu.py"))
    parser.add_argument("--timeout", type=int, default=150, help="seconds per mode")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU, no TRL")
    parser.add_argument("--profile", action="store_true",
                        help="profile each mode's last step (excluded from the mean) and print its top CUDA kernels; "
                             "with $OUT set, rank 0's trace goes there as trace_<mode>.json.gz")
    parser.add_argument("--gaps", action="store_true",
                        help="profile the last two updates (left out of the mean): GPU idle time by gap size and by "
                             "the kernels around each gap, then the host operations during the largest gaps")
    parser.add_argument("--memory-trace", action="store_true",
                        help="print the GPU memory allocated from step 3 on and still held at the end, with the "
                             "Python objects holding it (finds memory that grows with every step)")
    parser.add_argument("--steps", type=int, default=0,
                        help="steps per mode, TRL included (0: each mode's own, 3 for TRL); steady state = mean of "
                             "steps 2..N, so more steps average out TRL's step-to-step spread")
    parser.add_argument("--gpus", default="1",
                        help="process counts per mode, e.g. 1,2: the trainer under torchrun with the same global "
                             "batch; the table adds each mode's speed-up over its 1-process run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    prompt_len, response_len, device = (16, 8, "cpu") if args.quick else (256, 256, "cuda")
    if args.child:
        spec = MODES[args.child]
        if os.environ.get("HYBRIDRL_BENCH_STEPS"):
            spec = {**spec, "steps": int(os.environ["HYBRIDRL_BENCH_STEPS"])}
        if args.quick:
            spec = {**spec, "shape": "tiny", "prompts": 4, "n": 2, "max_tokens": 48, "attn": "sdpa"}  # flex: no CPU backward
        result = run_mode(args.child, spec, prompt_len, response_len, device)
        if os.environ.get("RANK", "0") == "0":
            print("RESULT " + json.dumps(result), flush=True)
        return
    if args.profile:
        os.environ["HYBRIDRL_BENCH_PROFILE"] = "1"
    if args.memory_trace:
        os.environ["HYBRIDRL_BENCH_MEMORY_TRACE"] = "1"
    if args.gaps:
        if args.profile:
            parser.error("--gaps and --profile each profile the last steps; use one of them per run.")
        if args.steps < 4:
            parser.error("--gaps needs --steps 4 or more (step 1 compiles, the last two are profiled).")
        os.environ["HYBRIDRL_BENCH_GAPS"] = "1"
    if args.steps:
        if args.steps < 2:
            parser.error("--steps must be at least 2 (step 1 compiles and is left out of the mean).")
        os.environ["HYBRIDRL_BENCH_STEPS"] = os.environ["TRL_STEPS"] = str(args.steps)
    try:
        gpu_counts = [int(count) for count in args.gpus.split(",")]
    except ValueError:
        parser.error(f"--gpus takes process counts separated by commas, e.g. 1,2; got {args.gpus!r}.")
    results = []

    def save() -> None:  # after every mode, so a run cut short keeps what finished
        report = dict(date=time.strftime("%Y-%m-%d"), modes=results, peak_flops=PEAK_FLOPS, bandwidth=BANDWIDTH)
        if os.environ.get("OUT"):
            name = "grpo_step_profile.json" if args.profile else "grpo_step.json"  # a profile run keeps the timed run's file
            Path(os.environ["OUT"], name).write_text(json.dumps(report, indent=1))

    for mode in args.modes.split(","):
        if mode == "trl":
            if not args.quick:
                results.append(run_trl(args.trl_script, args.timeout))
                save()
            continue
        for gpus in gpu_counts:
            results.append(child(mode, args.timeout, args.quick, gpus))
            save()
    print_table(results)


if __name__ == "__main__":
    main()
