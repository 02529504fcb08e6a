"""The decode step's LM head and sampler on the grpo-0.5b shape (512 rows, hidden 896, vocabulary 151936, bf16):
whole logits then the sampler's block pass, against the LM head in vocabulary slices each reduced right after its
matmul (`BuiltinBackend(lm_head_chunks=...)`, `sampling.sample_from_hidden`). The whole logits are 155 MB, more
than the H200's L2; a slice of a quarter is 39 MB.

Two measurements: the LM head + compiled `sample_and_record` alone in a CUDA graph (µs per step, and how often the
sliced variant draws the same token as the whole one: bf16 matmuls over different slices may round differently),
then whole rollouts (`rollout.py`'s shape, default engine) with each `lm_head_chunks` value, alternating in one
process, best of `--repeats` each.

    python3 benchmarks/lm_head_sampler.py [--chunks 1,2,4,8] [--repeats 3] [--no-rollout]
"""

from __future__ import annotations

import argparse
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
from hybridrl.rollout.decode_state import DecodeState, compiled_sample_and_record  # noqa: E402
from hybridrl.rollout.sampling import SamplerSettings  # noqa: E402

ROWS, HIDDEN, VOCAB, RESPONSE = 512, 896, 151936, 256


def time_head_and_sampler(chunk_options: list[int]) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    lm_head = (torch.randn(VOCAB, HIDDEN, device="cuda") * 0.05).to(torch.bfloat16)
    sampler, settings = compiled_sample_and_record(), SamplerSettings(temperature=1.0)
    state = DecodeState(ROWS, RESPONSE, [], "cuda")
    state.uniform_table.uniform_()
    tokens = {}
    for chunks in chunk_options:
        def step(chunks=chunks):
            state.gen_len.zero_()
            state.done.zero_()
            head = dict(lm_head=lm_head, lm_head_chunks=chunks) if chunks > 1 else {}
            scores = hidden if chunks > 1 else F.linear(hidden, lm_head)
            sampler(scores, settings, state.uniform_table, state.done, state.gen_len, state.last_token,
                    state.out_tokens, state.out_logprobs, state.stop_ids, state.max_new_tokens, **head)

        step()
        tokens[chunks] = state.last_token.clone()
        agree = (tokens[chunks] == tokens[chunk_options[0]]).float().mean().item()
        print(f"LM head + sampler, {chunks} slice(s): {graph_time_us(step):7.1f} us per step; "
              f"same token as {chunk_options[0]} slice(s) in {100 * agree:.1f}% of rows", flush=True)
    print(f"LM head alone (whole): {graph_time_us(lambda: F.linear(hidden, lm_head)):7.1f} us", flush=True)


def time_rollouts(chunk_options: list[int], repeats: int) -> None:
    model = build_model("cuda")
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (64, 256), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=RESPONSE, temperature=1.0, n=8, seed=0, ignore_eos=True)
    engines = {chunks: BuiltinBackend(model, lm_head_chunks=chunks) for chunks in chunk_options}
    for engine in engines.values():  # compile and capture each once
        engine.generate(prompts, params)
    best = {chunks: float("inf") for chunks in chunk_options}
    for _ in range(repeats):
        for chunks, engine in engines.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(prompts, params)
            torch.cuda.synchronize()
            best[chunks] = min(best[chunks], time.perf_counter() - start)
    print(f"\nrollout (64 prompts x 8, prompt 256, response 256), best of {repeats}, alternating:")
    for chunks, seconds in best.items():
        print(f"  lm_head_chunks {chunks}: {seconds:.3f} s, {ROWS * RESPONSE / seconds:,.0f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-rollout", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/lm_head_sampler.py needs a CUDA GPU.")
    chunk_options = [int(value) for value in args.chunks.split(",")]
    time_head_and_sampler(chunk_options)
    if not args.no_rollout:
        time_rollouts(chunk_options, args.repeats)


if __name__ == "__main__":
    main()
