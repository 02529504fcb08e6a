"""Held-out accuracy for `learning_vs_trl.py`: one evaluator for both trainers, so the comparison measures the
policies and not two evaluation codes.

`greedy_accuracy`: greedy decoding with Hugging Face `generate` (left-padded batches; float32 on CPU, on a GPU
under bf16 autocast, the compute dtype of both trainers there, so TRL's float32 master weights and hybridrl's bf16
weights are read alike), the completion decoded without special tokens, and exact match of the stripped text
against the stripped answer, as hybridrl's `eval/accuracy` and the `exact_match` reward define it.
`sampled_pass_rates`: k samples per problem at the training temperature, pass@1 (the share of samples right: what
the RL reward averages) and pass@k (the share of problems with at least one right: the headroom that RL on that
reward can turn into pass@1). It imports only torch (its caller passes a model and a tokenizer), so the TRL worker
runs it in TRL's own virtual environment, where hybridrl is not installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

BATCH = 250


def read_rows(path: str | Path) -> list[dict]:
    """The JSONL rows of a task file (`prompt`, `answer`, ...)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@torch.no_grad()
def completions(model, tokenizer, rows: list[dict], max_new_tokens: int, **sampling) -> Iterator[tuple[dict, list[str]]]:
    """(row, its completions) for each of `rows`, generated in batches of BATCH left-padded prompts (one completion
    each, or `num_return_sequences`); the model is in eval mode meanwhile and the tokenizer's padding side restored."""
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    per_row = sampling.get("num_return_sequences", 1)
    try:
        for start in range(0, len(rows), BATCH):
            part = rows[start:start + BATCH]
            inputs = tokenizer([row["prompt"] for row in part], return_tensors="pt", padding=True,
                               add_special_tokens=False).to(model.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=model.device.type == "cuda"):
                output = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id, **sampling)
            texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            for i, row in enumerate(part):
                yield row, texts[i * per_row:(i + 1) * per_row]
    finally:
        tokenizer.padding_side = side
        model.train(was_training)


def is_right(text: str, row: dict) -> bool:
    return text.strip() == str(row["answer"]).strip()


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int) -> float:
    """Share of `rows` whose greedy completion, stripped, equals the row's stripped `answer`."""
    right = sum(is_right(texts[0], row) for row, texts in completions(model, tokenizer, rows, max_new_tokens,
                                                                      do_sample=False))
    return right / len(rows)


def sampled_pass_rates(model, tokenizer, rows: list[dict], max_new_tokens: int, k: int, temperature: float,
                       seed: int) -> dict[str, float]:
    """{"pass@1": share of the k samples per row that are right, f"pass@{k}": share of rows with one right}."""
    torch.manual_seed(seed)
    hits = [sum(is_right(text, row) for text in texts) for row, texts in completions(
        model, tokenizer, rows, max_new_tokens, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
        num_return_sequences=k)]
    return {"pass@1": sum(hits) / (k * len(rows)), f"pass@{k}": sum(h > 0 for h in hits) / len(rows)}
