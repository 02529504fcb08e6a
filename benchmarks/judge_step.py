"""GRPO steps with a generative judge as the reward beside the same steps with a cheap reward: a 0.5B-shape judge
(random Qwen2 weights, `hybridrl/judge.py`) colocated with a 0.5B-shape actor on one GPU. Prints a table of the
mean step time (first step left out: it compiles), the judge's share of it and the peak GPU memory of each mode.

    python -m benchmarks.judge_step            # one GPU: 32 prompts x 8 samples, prompt 256 + response 256 tokens
    python -m benchmarks.judge_step --tiny     # tiny shapes on CPU: checks the script, measures nothing

Modes, one after another in this process, each with a fresh actor (same seed): `no-judge` (the cheap
`even_fraction` reward), `judge-yes_no` (one judge forward per sample), `judge-number` (the judge writes up to
--judge-tokens greedy tokens through the built-in engine; a random judge writes no number, so every text is a
parse failure and scores the failure score: the cost is that of a judge that writes its whole budget),
`judge-yes_no-offload` (the judge's weights in host memory between reward calls, `reward.judge_offload`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from benchmarks.grpo_step import SHAPES, build_tokenizer, even_fraction
from hybridrl import PromptDataset
from hybridrl.judge import JudgeReward
from hybridrl.models.loading import HFModel
from hybridrl.training.trainer import RLTrainer

MODES = ("no-judge", "judge-yes_no", "judge-number", "judge-yes_no-offload")


def random_model(shape: str, device: str, seed: int) -> torch.nn.Module:
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, eos_token_id=0, pad_token_id=1,
                         bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                                attn_implementation="sdpa")


def run_mode(mode: str, args: argparse.Namespace, device: str) -> dict:
    shape = "tiny" if args.tiny else "0.5b"
    tokenizer = build_tokenizer(SHAPES[shape]["vocab_size"])
    rng = random.Random(0)
    records = [{"prompt": " ".join(f"t{rng.randrange(100, SHAPES[shape]['vocab_size'])}" for _ in range(args.prompt_len))}
               for _ in range(args.prompts * args.steps)]
    dataset = PromptDataset(records, tokenizer, max_length=args.prompt_len, use_chat_template=False)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    reward = even_fraction
    if mode != "no-judge":  # the judge's words are the tokenizer's `t<i>`; "t3"/"t4" stand for yes/no
        reward = JudgeReward(random_model(shape, device, seed=1), tokenizer, "{prompt} t5 {response} t6",
                             parse=mode.split("-")[1], max_new_tokens=args.judge_tokens, answer_words=("t3", "t4"),
                             offload=mode.endswith("-offload"))
    trainer = RLTrainer(
        actor=HFModel(random_model(shape, device, seed=0), tokenizer), reward_fn=reward, dataset=dataset,
        model__gradient_checkpointing=True, rollout__backend="builtin", rollout__max_new_tokens=args.response_len,
        rollout__num_samples_per_prompt=args.n, rollout__ignore_eos=True, rollout__kv_cache_memory=args.kv_gib,
        trainer__prompts_per_step=args.prompts, trainer__total_steps=args.steps, trainer__device=device,
        trainer__save_model=False, trainer__output_dir=tempfile.mkdtemp(), logging__sinks=["jsonl"],
        actor__lr=1e-6, actor__micro_batch_size=min(32, args.prompts * args.n), algorithm__kl_coef=0.0)
    steps = [{k: float(v) for k, v in trainer.step().items()} for _ in range(args.steps)]
    steady = steps[1:] or steps
    result = dict(mode=mode, step_s=sum(s["timing/step_s"] for s in steady) / len(steady),
                  judge_s=sum(s.get("timing/judge_s", 0.0) for s in steady) / len(steady),
                  parse_failures=sum(s.get("reward/judge_parse_failures", 0.0) for s in steady) / len(steady),
                  peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None)
    print(mode, json.dumps(result), flush=True)
    del trainer, reward
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (checks the script)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=4, help="steps per mode (the first is left out of the mean)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--judge-tokens", type=int, default=16, help="judge-number: tokens the judge may write")
    parser.add_argument("--kv-gib", type=float, default=3.2, help="the actor's rollout KV cache (GiB)")
    args = parser.parse_args()
    if args.tiny:
        args.prompts, args.n, args.prompt_len, args.response_len, args.judge_tokens = 2, 2, 8, 4, 4
        args.steps = min(args.steps, 2)
    device = "cpu" if args.tiny else "cuda"
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}.")
    results = [run_mode(mode, args, device) for mode in modes]
    print(f"{'mode':<14} {'step s':>8} {'judge s':>8} {'parse fail':>10} {'peak GiB':>9}")
    for r in results:
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        print(f"{r['mode']:<14} {r['step_s']:8.3f} {r['judge_s']:8.3f} {r['parse_failures']:10.0f} {peak:>9}")
    if os.environ.get("OUT"):
        report = dict(date=time.strftime("%Y-%m-%d"), device=device, args=vars(args), modes=results)
        Path(os.environ["OUT"], "judge_step.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
