"""What RL changed on the carry task: each model's greedy answers to the held-out problems sorted into right, the
teacher's slip (`tasks.slipped_answer`: the carry forgotten, or the smaller digit subtracted from the larger) and
other errors, apart for the problems that need a carry or borrow and those that do not.

    python -m benchmarks.skill_task runs/demo_carry/sft/model runs/demo_carry/grpo/model --data runs/demo_carry/data/eval.jsonl

A model that RL moved from the slip to the right answer on problems it never trained on has learned when to carry:
the units digits decide it, so no answer format or single token can stand in for it (unlike the demo's period).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.greedy_accuracy import completions, read_rows
from hybridrl.data.tasks import slipped_answer
from hybridrl.models.loading import load_hf_model

KINDS = ("right", "slip", "other")


def operands(prompt: str) -> tuple[int, str, int]:
    """(a, operator, b) of a prompt like "37+58=" (operands are never negative, so the first sign is the operator)."""
    body = prompt.rstrip("=")
    operator = "+" if "+" in body else "-"
    a, b = body.split(operator)
    return int(a), operator, int(b)


def classify(text: str, row: dict) -> str:
    """"right", "slip" (the teacher's slip on this problem) or "other"."""
    text = text.strip()
    if text == row["answer"]:
        return "right"
    slipped = slipped_answer(*operands(row["prompt"]))
    return "slip" if slipped is not None and text == str(slipped) else "other"


def breakdown(model, tokenizer, rows: list[dict], max_new_tokens: int = 6) -> dict[str, dict[str, float]]:
    """{"carry": shares of KINDS on problems needing a carry or borrow, "no carry": on the others, "all": on all}."""
    counts = {group: dict.fromkeys(KINDS, 0) for group in ("carry", "no carry", "all")}
    for row, (text,) in completions(model, tokenizer, rows, max_new_tokens, do_sample=False):
        kind = classify(text, row)
        group = "no carry" if slipped_answer(*operands(row["prompt"])) is None else "carry"
        counts[group][kind] += 1
        counts["all"][kind] += 1
    return {group: {kind: n / max(1, sum(c.values())) for kind, n in c.items()} for group, c in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="Hugging Face model directories")
    parser.add_argument("--data", default="runs/demo_carry/data/eval.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = read_rows(args.data)
    print("| model | problems | " + " | ".join(KINDS) + " |\n| --- | --- | " + " | ".join("---:" for _ in KINDS) + " |")
    for path in args.models:
        model, tokenizer = load_hf_model(path)
        for group, shares in breakdown(model, tokenizer, rows).items():
            print(f"| {path} | {group} | " + " | ".join(f"{100 * shares[kind]:.1f}" for kind in KINDS) + " |")


if __name__ == "__main__":
    main()
