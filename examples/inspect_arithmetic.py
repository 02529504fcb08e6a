"""What a model answers on the arithmetic task: exact match, digits right, and the period style.

    python examples/inspect_arithmetic.py runs/demo/sft/model runs/demo/grpo/model --data runs/demo/data/eval.jsonl

Greedy answers to every problem of the file; "digits right" ignores a trailing period, so the gap between
the two columns is what the answer format costs under the exact-match verifier.
"""

from __future__ import annotations

import argparse
import json

from hybridrl.models.loading import load_hf_model
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.hf import HFBackend


def inspect(model_path: str, rows: list[dict]) -> dict[str, float]:
    model, tokenizer = load_hf_model(model_path)
    prompts = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows]
    generations = HFBackend(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    answers = [tokenizer.decode(g.token_ids, skip_special_tokens=True).strip() for g in generations]
    truths = [row["answer"] for row in rows]
    return {"exact": sum(a == t for a, t in zip(answers, truths)) / len(rows),
            "digits_right": sum(a.rstrip(".") == t for a, t in zip(answers, truths)) / len(rows),
            "with_period": sum(a.endswith(".") for a in answers) / len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="Hugging Face model directories")
    parser.add_argument("--data", default="runs/demo/data/eval.jsonl")
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.data)]
    print(f"{'model':50s} {'exact':>7s} {'digits right':>13s} {'with period':>12s}")
    for path in args.models:
        result = inspect(path, rows)
        print(f"{path:50s} {result['exact']:7.1%} {result['digits_right']:13.1%} {result['with_period']:12.1%}")


if __name__ == "__main__":
    main()
