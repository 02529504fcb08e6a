"""What held-out evaluation measures, in one place for RL and SFT.

`eval/accuracy` is exact agreement with the reference answer (the stripped completion equals the
stripped `data.answer_key` column), the number a user compares with a paper's; it is logged only where
the data has that column. Rewards are reported beside it as means (`eval/reward_mean`, and per function
`eval/reward/<name>`), never turned into an "accuracy": a partial-credit reward's share of positive scores
says nothing about correctness. With `eval.num_samples` = k > 1 each held-out prompt is sampled k times:
`eval/accuracy` is then the mean over all k x prompts responses (pass@1 at `rollout.eval_temperature`), and
`eval/pass@k` the share of prompts with at least one agreeing response.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hybridrl.data.datasets import PromptDataset, SFTDataset, collate_sft
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.hf import HFBackend
from hybridrl.training.batch import decode_responses

EVAL_BATCH = 256
"""Held-out prompts generated per call."""


def answer_column(columns: dict[str, list], answer_key: str | None) -> list | None:
    """The reference answers of a batch's columns, or None when the data has no such column."""
    if not answer_key or answer_key not in columns:
        return None
    answers = columns[answer_key]
    return None if all(answer is None for answer in answers) else answers


def exact_agreement(completions: Sequence[str], answers: Sequence[Any]) -> list[bool]:
    """Whether each stripped completion equals its stripped reference answer (a missing answer never agrees)."""
    return [answer is not None and completion.strip() == str(answer).strip()
            for completion, answer in zip(completions, answers)]


def pass_at_k(agree: Sequence[bool], prompt_index: Sequence[int]) -> float:
    """The share of prompts with at least one response that agrees with the reference (`agree[i]` belongs to
    prompt `prompt_index[i]`): pass@k when every prompt has k responses."""
    solved: dict[int, bool] = {}
    for index, correct in zip(prompt_index, agree):
        solved[index] = solved.get(index, False) or correct
    return sum(solved.values()) / len(solved)


def pass_at_k_key(num_samples: int) -> str:
    return f"eval/pass@{num_samples}"


@torch.no_grad()
def sft_eval_loss(model: torch.nn.Module, dataset: SFTDataset, pad_id: int, batch_size: int) -> float:
    """Mean cross-entropy per response token over the whole held-out set (the training loss's definition)."""
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    for start in range(0, len(dataset), batch_size):
        batch = {k: v.to(device) for k, v in collate_sft(list(dataset.items[start:start + batch_size]), pad_id).items()}
        count = int((batch["labels"][:, 1:] != -100).sum())
        total += float(model(**batch).loss) * count
        tokens += count
    return total / max(1, tokens)


def greedy_accuracy(model: torch.nn.Module, tokenizer: Any, dataset: PromptDataset, answer_key: str | None,
                    max_new_tokens: int, limit: int | None = None) -> float | None:
    """Exact-match accuracy of greedy completions on `dataset` through HF `generate` (no engine needed, so SFT
    can call it on any model); None when the data has no `answer_key` column."""
    backend = HFBackend(model, tokenizer)
    indices = list(range(min(limit or len(dataset), len(dataset))))
    agree: list[bool] = []
    for start in range(0, len(indices), EVAL_BATCH):
        batch = dataset.batch(indices[start:start + EVAL_BATCH])
        answers = answer_column(batch["columns"], answer_key)
        if answers is None:
            return None
        generations = backend.generate(batch["prompt_ids"], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
        agree += exact_agreement(decode_responses(tokenizer, generations), answers)
    return sum(agree) / len(agree)
