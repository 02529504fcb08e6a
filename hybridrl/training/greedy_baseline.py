"""ReMax's baseline (Li et al. 2023, arXiv:2310.10505): the score of the greedy response to each prompt of the step.

`algorithm.name=remax` subtracts it from each sample's score (`algorithms.remax_advantages`). The greedy response
does not depend on the sampled ones, so the gradient stays unbiased, and it needs no group of samples or critic:
its price is one more rollout per step, one greedy response per prompt (`rollout.eval_temperature`, which the
config check keeps at 0), scored by the same rewards. Other algorithms skip it.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.training.batch import RolloutBatch

USES_GREEDY_BASELINE = frozenset({"remax"})
"""The `algorithm.name`s whose advantages need `RolloutBatch.baseline_scores`."""


def attach_greedy_baseline(trainer: Any, timer: Any, batch: RolloutBatch, prompts: dict[str, Any]) -> dict[str, float]:
    """For ReMax: roll out the step's prompts greedily (timed as `timing/baseline_s`), score the responses, and
    put each row's prompt's score in `batch.baseline_scores` (B,); returns `reward/greedy_baseline_mean`. For
    every other algorithm: nothing."""
    if trainer.config.algorithm.name not in USES_GREEDY_BASELINE:
        return {}
    with timer("baseline"):
        greedy, _ = trainer.rollout(prompts, evaluation=True)  # one response per prompt
        rows = greedy.prompt_index.tolist()
        columns = {key: [values[i] for i in rows] for key, values in prompts["columns"].items()}
        scores, _ = trainer._score([prompts["raw_prompts"][i] for i in rows], greedy.texts, columns, 1)
    per_prompt = torch.zeros(len(prompts["raw_prompts"]), dtype=scores.dtype)
    per_prompt[greedy.prompt_index.cpu()] = scores.cpu()
    batch.baseline_scores = per_prompt[batch.prompt_index.cpu()].to(batch.scores.device)
    return {"reward/greedy_baseline_mean": scores.mean().item()}
