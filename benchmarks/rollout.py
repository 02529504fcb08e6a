"""Rollout throughput: the built-in engine vs Hugging Face `generate` on the grpo-0.5b shape, with the floor.

    python -m benchmarks.rollout            # 64 prompts x n=8, prompt 256, response 256 forced; HF on 128 seqs
    python -m benchmarks.rollout --quick    # a smaller run that finishes in well under a minute
    python -m benchmarks.rollout --tiny --quick --agreement-sequences 0   # CPU: checks the script, measures nothing

The model is Qwen2-0.5B-shaped (hidden 896, intermediate 4864, 24 layers, 14 heads, 2 KV heads, vocab
151936, tied embeddings), random init, bf16. Responses are forced to full length (`ignore_eos`) and
sampled at temperature 1 (top-p 1, top-k off), as in GRPO. HF `generate` runs on fewer sequences
(`--hf-sequences`) because it is slow; both report generated tokens per second.

The engine is timed compiled (`torch.compile`, the GPU default) and uncompiled (`--no-eager-baseline` skips
that); both with `attention="sdpa"` (per-slot KV cache, SDPA decode attention). When triton is installed, the
compiled engine is also timed with `attention="triton"` (prefix-shared KV: each prompt's KV stored once, Triton
decode kernel; `--no-triton` skips it), in the same run and the same table, with its own log-prob mismatch and
greedy agreement; so is the triton engine with `fuse_qkv=True` (one stacked q/k/v matmul per layer, whose raw
output the kernel biases and rotates itself) and with `fuse_qkv` and `fuse_gate_up` (also one gate/up matmul);
`--no-fused-qkv` skips those two. `--paged` adds the engine on the paged KV cache (`kv_cache="paged"`, fused q/k/v
and gate/up, its own attention through the block table), timed and checked the same way (the paged/contiguous
speed comparison with alternating calls is `benchmarks/long_tail.py --shape grpo-0.5b`). The first `generate` of
a fresh engine compiles; it is timed on its own ("compile + first call") and not in the engine's tokens/s, because
the trainer reuses the compiled code every step. Each timed run still includes KV allocation and CUDA-graph
capture (`warmup_s` in its stats).

The floor is computed, not measured: every decode step must read the weights once and each sequence's
keys/values for its current context (no prefix-shared attention assumed, so the triton engine is not
bound by it: it reads a prompt's KV once per step for all n samples if L2 serves the repeats), and must do 2 * params
FLOPs per token; a step costs max(bytes / bandwidth, flops / peak). Prefill costs 2 * params FLOPs
per distinct prompt token. Defaults are the H200's figures from DESIGN.md (4.2 TB/s, 785 TFLOP/s).

Greedy agreement (first `--agreement-tokens` tokens of `--agreement-sequences` prompts; 0 skips it) is reported
against HF `generate` in bf16 and against a float32 copy of the model, next to HF bf16's own agreement
with float32. A random-init model's logits are nearly flat, so bf16 rounding alone flips near-ties
and no bf16 implementation agrees with another on most sequences; the float32 line says whether the
engine is further from the exact answer than HF's bf16 is.

Prints a short table last; writes JSON to $OUT/rollout_benchmark.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.kernel_choices import triton_available


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rollout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="distinct prompts")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--hf-sequences", type=int, default=128, help="sequences for HF generate (0 skips it)")
    parser.add_argument("--agreement-sequences", type=int, default=64,
                        help="greedy sequences compared with HF (0 skips the agreement check)")
    parser.add_argument("--agreement-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="timed engine runs (the best is reported)")
    add_engine_arguments(parser, quick="16 prompts x 8, response 64, HF on 32 sequences")
    parser.add_argument("--no-eager-baseline", action="store_true", help="skip timing the uncompiled engine too")
    parser.add_argument("--try-efficient-attention", action="store_true",
                        help="also time the compiled engine with SDPA restricted to the mem-efficient backend")
    parser.add_argument("--no-triton", action="store_true", help="skip the attention='triton' engine")
    parser.add_argument("--no-fused-qkv", action="store_true", help="skip the triton engine with fuse_qkv=True")
    parser.add_argument("--paged", action="store_true", help="also the engine on the paged KV cache")
    parser.add_argument("--profile", action="store_true", help="print the top kernels of one engine run (each engine)")
    return parser


def add_engine_arguments(parser: argparse.ArgumentParser, quick: str) -> None:
    """What every grpo-0.5b engine benchmark takes: KV memory, the machine's figures for the floor, `--quick` (whose
    effect `quick` describes), `--tiny`, and the engine's CUDA graphs and compilation."""
    parser.add_argument("--kv-cache-memory", type=float, default=0.3)
    parser.add_argument("--bandwidth-tbs", type=float, default=4.2)
    parser.add_argument("--peak-tflops", type=float, default=785.0)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer model with a 1,000-token vocabulary instead of the grpo-0.5b shape (checks the "
                             "script on CPU; measures nothing)")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="time the engine without torch.compile")


def parse_with_quick(parser: argparse.ArgumentParser, argv: list[str] | None, **quick_defaults) -> argparse.Namespace:
    """Parse `argv` (default: the command line); with `--quick`, `quick_defaults` replace the defaults (flags given
    explicitly still win)."""
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**quick_defaults)
    return parser.parse_args(argv)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_with_quick(build_parser(), argv, prompts=16, response_len=64, hf_sequences=32, agreement_sequences=16)


GRPO_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936)
"""Qwen2-0.5B's shape (tied embeddings)."""
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000)


def build_model(device: str, shape: dict = GRPO_05B):
    config = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=32768, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_engine(engine: BuiltinBackend, prompts, params, repeats: int) -> dict:
    sync()
    start = time.perf_counter()
    # A small call with the same sampler settings: compiles (when on) and warms kernels up.
    engine.generate(prompts[:4], SamplingParams(max_new_tokens=8, n=2, ignore_eos=True, temperature=params.temperature))
    sync()
    first_call_s = time.perf_counter() - start
    best, outputs, peak = float("inf"), None, 0
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        sync()
        best = min(best, time.perf_counter() - start)
        peak = max(peak, torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0)
    tokens = sum(len(g.token_ids) for g in outputs)
    return dict(seconds=best, tokens=tokens, tokens_per_s=tokens / best, peak_gib=peak / 2**30,
                first_call_s=first_call_s, stats=engine.last_stats, outputs=outputs)


def timeline_line(stats: dict) -> str:
    """The last timed call's phases (`BuiltinBackend.last_stats["timeline_ms"]`): host and GPU clocks at each mark."""
    marks = stats.get("timeline_ms", {})
    return "timeline, ms since the call began (host / GPU): " + ", ".join(
        f"{name} {mark['host_ms']:.1f} / {mark.get('gpu_ms', float('nan')):.1f}" for name, mark in marks.items())


def time_hf(model, prompts, num_sequences: int, response_len: int, device: str) -> dict:
    n = max(1, num_sequences // len(prompts)) if num_sequences >= len(prompts) else 1
    batch = [p for p in prompts for _ in range(n)][:num_sequences]
    input_ids = torch.tensor(batch, device=device)
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
    model.generate(input_ids[:2], attention_mask=torch.ones_like(input_ids[:2]), max_new_tokens=4, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=response_len,
                            min_new_tokens=response_len, **kwargs)
    sync()
    seconds = time.perf_counter() - start
    tokens = (output.shape[1] - input_ids.shape[1]) * output.shape[0]
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return dict(sequences=len(batch), seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds, peak_gib=peak / 2**30)


def hf_greedy(model, prompts, num_tokens: int, device: str) -> list[list[int]]:
    input_ids = torch.tensor(prompts, device=device)
    output = model.generate(input_ids, do_sample=False, max_new_tokens=num_tokens, pad_token_id=0,
                            attention_mask=torch.ones_like(input_ids))
    return output[:, input_ids.shape[1]:].tolist()


def float32_greedy(model, prompts, num_tokens: int, device: str) -> list[list[int]]:
    """HF greedy tokens from a float32 copy of the model: the answer bf16 runs (ours and HF's) approximate."""
    copy = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).to(device).eval()
    copy.load_state_dict(model.state_dict())
    copy.generation_config.eos_token_id, copy.generation_config.pad_token_id = None, 0
    tokens = hf_greedy(copy, prompts, num_tokens, device)
    del copy
    return tokens


def matching_prefixes(ours: list[list[int]], theirs: list[list[int]], num_tokens: int) -> list[int]:
    return [next((i for i, (a, b) in enumerate(zip(mine, other)) if a != b), num_tokens)
            for mine, other in zip(ours, theirs)]


def equal_fraction(ours: list[list[int]], theirs: list[list[int]], num_tokens: int) -> float:
    prefixes = matching_prefixes(ours, theirs, num_tokens)
    return sum(p == num_tokens for p in prefixes) / max(1, len(prefixes))


def greedy_agreement(model, engine: BuiltinBackend, prompts, num_tokens: int, device: str,
                     float32_tokens: list[list[int]] | None = None) -> dict | None:
    """The engine's bf16 greedy tokens vs HF's bf16 greedy tokens (and, given, vs HF float32's); None without
    prompts (`--agreement-sequences 0`)."""
    if not prompts:
        return None
    ours = [g.token_ids for g in engine.generate(prompts, SamplingParams(max_new_tokens=num_tokens, temperature=0,
                                                                         ignore_eos=True))]
    reference = hf_greedy(model, prompts, num_tokens, device)
    prefix, gaps = matching_prefixes(ours, reference, num_tokens), []
    for prompt, mine, theirs, same in zip(prompts, ours, reference, prefix):
        if same < num_tokens:  # how close to a tie was the first divergence, in HF's own logits?
            with torch.no_grad():
                logits = model(torch.tensor([prompt + theirs[:same]], device=device)).logits[0, -1].float()
            gaps.append((logits[theirs[same]] - logits[mine[same]]).item())
    gaps_t = torch.tensor(gaps or [0.0])
    result = dict(sequences=len(prompts), all_equal_fraction=sum(p == num_tokens for p in prefix) / len(prefix),
                  mean_matching_prefix=sum(prefix) / len(prefix), tokens=num_tokens,
                  divergence_logit_gap_median=gaps_t.median().item(), divergence_logit_gap_max=gaps_t.abs().max().item())
    if float32_tokens is not None:
        result["vs_float32_equal_fraction"] = equal_fraction(ours, float32_tokens, num_tokens)
    return result


def logprob_mismatch(model, prompts, outputs, num_sequences: int, device: str) -> dict:
    """Engine log-probs vs a bf16 HF forward pass over the same sampled tokens (what the trainer computes)."""
    diffs = []
    for generation in outputs[:num_sequences]:
        prompt = prompts[generation.prompt_index]
        ids = torch.tensor([prompt + generation.token_ids], device=device)
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        reference = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
        diffs.append(torch.tensor(generation.logprobs, device=device) - reference)
    diff = torch.cat(diffs)  # sampler - trainer
    kl = (torch.exp(-diff) - 1 + diff).mean()  # k3 estimate of KL(sampler || trainer)
    return dict(sequences=len(diffs), mean_abs=diff.abs().mean().item(), max_abs=diff.abs().max().item(),
                kl_k3=kl.item())


def floor(model, num_prompts: int, n: int, prompt_len: int, response_len: int, bandwidth: float, peak: float) -> dict:
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2
    sequences = num_prompts * n
    prefill = max(2 * params * num_prompts * prompt_len / peak, weight_bytes / bandwidth)
    decode = 0.0
    for step in range(response_len - 1):  # the first token comes from the prefill logits
        context = prompt_len + 1 + step
        step_bytes = weight_bytes + sequences * context * kv_bytes_per_token
        decode += max(step_bytes / bandwidth, 2 * params * sequences / peak)
    seconds = prefill + decode
    return dict(params=params, weight_gib=weight_bytes / 2**30, prefill_s=prefill, decode_s=decode, seconds=seconds,
                tokens_per_s=sequences * response_len / seconds, kv_bytes_per_token=kv_bytes_per_token)


def time_triton(model, prompts, params, args, device: str, float32_tokens: list[list[int]] | None = None,
                fuse_qkv: bool = False, fuse_gate_up: bool = False, kv_cache: str = "contiguous") -> dict:
    """The compiled engine with the prefix-shared attention ("triton"), timed and checked like the sdpa one;
    `fuse_qkv` / `fuse_gate_up` add the stacked q/k/v / gate-up projections (with fused q/k/v the kernel applies
    the bias and RoPE itself); `kv_cache="paged"`: the paged cache and its attention instead."""
    engine = BuiltinBackend(model, kv_cache_memory=args.kv_cache_memory, use_cuda_graphs=not args.no_cuda_graphs,
                            compile=False if args.no_compile else None,
                            attention="auto" if kv_cache == "paged" else "triton", fuse_qkv=fuse_qkv,
                            fuse_gate_up=fuse_gate_up, kv_cache=kv_cache)
    result = time_engine(engine, prompts, params, args.repeats)
    result["stats"]["attention"] = (result["stats"].get("attention", "") + (" + fused qkv" if fuse_qkv else "")
                                    + (" + fused gate/up" if fuse_gate_up else ""))
    print(f"engine (attention={result['stats'].get('attention')}): {result['seconds']:.3f} s, "
          f"{result['tokens_per_s']:.0f} tok/s, compile + first call {result['first_call_s']:.1f} s, "
          f"stats {result['stats']}", flush=True)
    print(timeline_line(result["stats"]), flush=True)
    if args.profile:
        profile(engine, prompts, params)
    result["logprob_mismatch"] = logprob_mismatch(model, prompts, result.pop("outputs"), 32, device)
    print(f"logprob mismatch ({result['stats']['attention']}): {result['logprob_mismatch']}", flush=True)
    result["greedy_agreement"] = greedy_agreement(model, engine, prompts[: args.agreement_sequences],
                                                  args.agreement_tokens, device, float32_tokens)
    print(f"greedy agreement ({result['stats']['attention']}): {result['greedy_agreement']}", flush=True)
    return result


def profile(engine: BuiltinBackend, prompts, params) -> None:
    """Top kernels of one engine run, then per decode step: kernel count, time some kernel ran, and the
    idle time between kernels (inside a CUDA graph that is the per-kernel gap a kernel count costs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    if not kernels:
        return
    busy, reach = 0.0, kernels[0][0]
    for start, end in kernels:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span, steps = (reach - kernels[0][0]), params.max_new_tokens
    print(f"profile: {len(kernels)} GPU events ({len(kernels) / steps:.0f} per decode step), GPU span "
          f"{span / 1e3:.1f} ms, kernels running {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms "
          f"({(span - busy) / max(1, len(kernels)):.2f} us per event)", flush=True)


def float32_reference(model, prompts, args, device: str) -> tuple[list[list[int]] | None, float | None]:
    """HF float32's greedy tokens on the agreement prompts and HF bf16's agreement with them (the bf16 noise
    floor); (None, None) when `--agreement-sequences 0` leaves no prompts to compare."""
    if not prompts:
        print("greedy agreement: skipped (--agreement-sequences 0)", flush=True)
        return None, None
    float32_tokens = float32_greedy(model, prompts, args.agreement_tokens, device)
    hf_vs_float32 = equal_fraction(hf_greedy(model, prompts, args.agreement_tokens, device), float32_tokens,
                                   args.agreement_tokens)
    print(f"HF bf16 greedy equal to HF float32 on the first {args.agreement_tokens} tokens: "
          f"{100 * hf_vs_float32:.0f}% of {len(prompts)} sequences (the bf16 noise floor)", flush=True)
    return float32_tokens, hf_vs_float32


def time_sdpa(model, prompts, params, args, device: str, float32_tokens) -> dict:
    """The default engine with `attention="sdpa"`: timed, optionally profiled and with SDPA's mem-efficient
    backend, its log-probs and greedy tokens checked against HF."""
    engine = BuiltinBackend(model, kv_cache_memory=args.kv_cache_memory, use_cuda_graphs=not args.no_cuda_graphs,
                            compile=False if args.no_compile else None, attention="sdpa")
    ours = time_engine(engine, prompts, params, args.repeats)
    print(f"engine: {ours['seconds']:.3f} s, {ours['tokens_per_s']:.0f} tok/s, compile + first call "
          f"{ours['first_call_s']:.1f} s, stats {ours['stats']}", flush=True)
    ours["efficient"] = None
    if args.try_efficient_attention and device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # read at dispatch, so captured into the graphs
            ours["efficient"] = time_engine(engine, prompts, params, args.repeats)
        ours["efficient"].pop("outputs")
        print(f"engine (SDPA mem-efficient backend): {ours['efficient']['seconds']:.3f} s, "
              f"{ours['efficient']['tokens_per_s']:.0f} tok/s", flush=True)
    if args.profile:
        profile(engine, prompts, params)
    ours["logprob_mismatch"] = logprob_mismatch(model, prompts, ours.pop("outputs"), 32, device)
    print(f"logprob mismatch: {ours['logprob_mismatch']}", flush=True)
    ours["greedy_agreement"] = greedy_agreement(model, engine, prompts[: args.agreement_sequences],
                                                args.agreement_tokens, device, float32_tokens)
    print(f"greedy agreement: {ours['greedy_agreement']}", flush=True)
    return ours


def time_not_compiled(model, prompts, params, args) -> dict | None:
    if args.no_compile or args.no_eager_baseline:
        return None
    engine = BuiltinBackend(model, kv_cache_memory=args.kv_cache_memory, use_cuda_graphs=not args.no_cuda_graphs,
                            compile=False, attention="sdpa")
    eager = time_engine(engine, prompts, params, args.repeats)
    eager.pop("outputs")
    print(f"engine (not compiled): {eager['seconds']:.3f} s, {eager['tokens_per_s']:.0f} tok/s, "
          f"stats {eager['stats']}", flush=True)
    return eager


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(device, TINY if args.tiny else GRPO_05B)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (args.prompts, args.prompt_len), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=args.response_len, temperature=1.0, n=args.n, seed=0, ignore_eos=True)
    print(f"engine: {args.prompts} prompts x n={args.n}, prompt {args.prompt_len}, response {args.response_len}", flush=True)
    float32_tokens, hf_vs_float32 = float32_reference(model, prompts[: args.agreement_sequences], args, device)
    eager = time_not_compiled(model, prompts, params, args)
    ours = time_sdpa(model, prompts, params, args, device, float32_tokens)
    triton = not args.no_triton and triton_available()
    fused = triton and not args.no_fused_qkv
    prefix_shared = {
        "engine_triton": time_triton(model, prompts, params, args, device, float32_tokens) if triton else None,
        "engine_triton_fused_qkv": time_triton(model, prompts, params, args, device, float32_tokens, fuse_qkv=True)
        if fused else None,
        "engine_triton_fused_qkv_gate_up": time_triton(model, prompts, params, args, device, float32_tokens,
                                                       fuse_qkv=True, fuse_gate_up=True) if fused else None,
        "engine_paged": time_triton(model, prompts, params, args, device, float32_tokens, fuse_qkv=True,
                                    fuse_gate_up=True, kv_cache="paged") if triton and args.paged else None,
    }
    hf = time_hf(model, prompts, args.hf_sequences, args.response_len, device) if args.hf_sequences else None
    if hf:
        print(f"hf generate: {hf}", flush=True)
    bound = floor(model, args.prompts, args.n, args.prompt_len, args.response_len,
                  args.bandwidth_tbs * 1e12, args.peak_tflops * 1e12)
    result = dict(args=vars(args), device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  torch=torch.__version__, engine=ours, engine_not_compiled=eager,
                  engine_sdpa_efficient=ours.pop("efficient"), **prefix_shared, hf_generate=hf, floor=bound,
                  percent_of_floor=100 * bound["seconds"] / ours["seconds"],
                  speedup_vs_hf=ours["tokens_per_s"] / hf["tokens_per_s"] if hf else None,
                  greedy_agreement=ours["greedy_agreement"], logprob_mismatch=ours["logprob_mismatch"],
                  hf_bf16_vs_float32_equal_fraction=hf_vs_float32)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "rollout_benchmark.json"), "w") as handle:
            json.dump(result, handle, indent=2, default=str)
    print_table(result)


def agreement_text(agreement: dict | None) -> str:
    if agreement is None:
        return "greedy agreement skipped"
    return (f"greedy first {agreement['tokens']} equal: {100 * agreement['all_equal_fraction']:.0f}% "
            f"(mean prefix {agreement['mean_matching_prefix']:.1f})")


def table_row(name: str, run: dict) -> tuple[str, ...]:
    return (name, f"{run['tokens']}", f"{run['seconds']:.3f}", f"{run['tokens_per_s']:,.0f}", f"{run['peak_gib']:.1f}")


def print_table(result: dict) -> None:
    ours, hf, bound = result["engine"], result["hf_generate"], result["floor"]
    def compiled(run: dict, name: str) -> str:
        return f"engine (compiled, {name})" if run["stats"].get("compiled") else f"engine ({name})"

    rows = [table_row(compiled(ours, "sdpa"), ours)]
    prefix_shared = [result[key] for key in ("engine_triton", "engine_triton_fused_qkv",
                                             "engine_triton_fused_qkv_gate_up", "engine_paged") if result.get(key)]
    rows += [table_row(compiled(shared, shared["stats"].get("attention")), shared) for shared in prefix_shared]
    if result["engine_sdpa_efficient"]:
        rows.append(table_row("engine (SDPA mem-efficient)", result["engine_sdpa_efficient"]))
    if result["engine_not_compiled"]:
        rows.append(table_row("engine (not compiled)", result["engine_not_compiled"]))
    if hf:
        rows.append(table_row(f"hf generate ({hf['sequences']} seqs)", hf))
    rows.append(("floor (computed)", f"{ours['tokens']}", f"{bound['seconds']:.3f}", f"{bound['tokens_per_s']:,.0f}", "-"))
    print(f"\n{'':56} {'tokens':>8} {'seconds':>8} {'tok/s':>10} {'peak GiB':>9}")
    for row in rows:
        print(f"{row[0]:56} {row[1]:>8} {row[2]:>8} {row[3]:>10} {row[4]:>9}")
    speedup = f"{result['speedup_vs_hf']:.1f}x" if result["speedup_vs_hf"] else "n/a"
    mismatch = result["logprob_mismatch"]
    print(f"% of floor: {result['percent_of_floor']:.1f}   speedup vs HF: {speedup}   "
          f"{agreement_text(result['greedy_agreement'])}   "
          f"logprob |diff| mean {mismatch['mean_abs']:.2e} max {mismatch['max_abs']:.2e}")
    for shared in prefix_shared:
        mismatch = shared["logprob_mismatch"]
        print(f"{shared['stats'].get('attention')}: % of floor {100 * bound['seconds'] / shared['seconds']:.1f}   "
              f"vs sdpa: {shared['tokens_per_s'] / ours['tokens_per_s']:.2f}x   "
              f"{agreement_text(shared['greedy_agreement'])}   "
              f"logprob |diff| mean {mismatch['mean_abs']:.2e} max {mismatch['max_abs']:.2e}")
    if result["hf_bf16_vs_float32_equal_fraction"] is not None:
        engines = [("sdpa", result["greedy_agreement"])] + [(r["stats"].get("attention"), r["greedy_agreement"])
                                                             for r in prefix_shared]
        print(f"greedy first {result['greedy_agreement']['tokens']} equal to HF float32: HF bf16 "
              f"{100 * result['hf_bf16_vs_float32_equal_fraction']:.0f}%, "
              + ", ".join(f"engine {name} {100 * a['vs_float32_equal_fraction']:.0f}%" for name, a in engines))
    print(f"compile + first call: {ours['first_call_s']:.1f} s (once per engine; not in tok/s); "
          f"graph warm-up + capture inside the timed run: {ours['stats'].get('warmup_s', 0):.3f} s")


if __name__ == "__main__":
    main()
