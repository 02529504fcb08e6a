"""Host time between generation and reward, on the grpo-0.5b shape, without a GPU: handing over 512 generations of
256 tokens (64 prompts of 256 tokens, 8 samples each) as the built-in engine's harvest does (numpy rows) and as Python
lists, turning them into the padded batch (`build_rollout_batch`) and decoding their texts
with `grpo_step.py`'s tokenizer (`decode_responses`), for generations holding lists and holding numpy rows (the
batches are checked equal; decoding numpy-held ones includes making the lists). Each is timed best of `--repeats`; with
`--baseline FILE` (a copy of another version's `hybridrl/training/batch.py`) that version's `build_rollout_batch` is
timed beside it on the same generations and checked to give the same tensors.

    python -m benchmarks.profiling.host_batch [--baseline /tmp/old_batch.py] [--repeats 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

from benchmarks.grpo_step import build_tokenizer
from hybridrl.rollout.base import Generation
from hybridrl.training.batch import build_rollout_batch, decode_responses

VOCAB, PROMPTS, SAMPLES, PROMPT_LEN, RESPONSE_LEN = 151936, 64, 8, 256, 256


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("baseline_batch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_batch"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module.build_rollout_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="", help="another version's hybridrl/training/batch.py to time beside this one")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, VOCAB, (PROMPTS, PROMPT_LEN), generator=generator).tolist()
    token_rows = torch.randint(3, VOCAB, (PROMPTS * SAMPLES, RESPONSE_LEN), generator=generator).numpy()
    logprob_rows = (-torch.rand(PROMPTS * SAMPLES, RESPONSE_LEN, generator=generator)).numpy()

    def held_as_lists() -> list[Generation]:
        return [Generation(i // SAMPLES, token_rows[i].tolist(), logprob_rows[i].tolist(), "length")
                for i in range(len(token_rows))]

    def held_as_arrays() -> list[Generation]:
        return [Generation(i // SAMPLES, token_rows[i], logprob_rows[i], "length") for i in range(len(token_rows))]

    generations, array_generations = held_as_lists(), held_as_arrays()
    from_lists, from_arrays = (build_rollout_batch(prompts, g, 1, RESPONSE_LEN) for g in (generations, array_generations))
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "sampler_logp"):
        assert torch.equal(getattr(from_lists, name), getattr(from_arrays, name)), f"{name}: numpy rows differ from lists"
    rows = [("harvest into lists", best_ms(held_as_lists, args.repeats)),
            ("harvest as numpy rows (the engine)", best_ms(held_as_arrays, args.repeats)),
            ("build_rollout_batch (this, lists)", best_ms(lambda: build_rollout_batch(prompts, generations, 1, RESPONSE_LEN),
                                                          args.repeats)),
            ("build_rollout_batch (this, numpy)", best_ms(
                lambda: build_rollout_batch(prompts, array_generations, 1, RESPONSE_LEN), args.repeats))]
    if args.baseline:
        baseline = load_baseline(args.baseline)
        ours, theirs = (f(prompts, generations, 1, RESPONSE_LEN) for f in (build_rollout_batch, baseline))
        for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "sampler_logp"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), f"{name} differs from the baseline's"
        rows.append(("build_rollout_batch (baseline)", best_ms(lambda: baseline(prompts, generations, 1, RESPONSE_LEN),
                                                               args.repeats)))
    tokenizer = build_tokenizer(VOCAB)
    repeats = max(1, args.repeats // 2)
    rows.append((f"decode_responses ({len(generations)}, lists)", best_ms(lambda: decode_responses(tokenizer, generations),
                                                                          repeats)))
    rows.append((f"decode_responses ({len(generations)}, numpy)",
                 best_ms(lambda: decode_responses(tokenizer, held_as_arrays()), repeats)))
    print(f"{len(generations)} generations of {RESPONSE_LEN} tokens, prompts of {PROMPT_LEN}; "
          f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs; best of {args.repeats}")
    for name, ms in rows:
        print(f"  {name:<38} {ms:8.1f} ms")


if __name__ == "__main__":
    main()
