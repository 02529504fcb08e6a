"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): keep only the prompt groups whose samples did not
all score alike, and generate more prompts until the step has enough of them.

A group whose scores are all equal has group-relative advantages of 0: it teaches nothing yet dilutes a
token-mean loss. `fill_informative_groups` is the bookkeeping (no models): given a function that rolls out and
scores a fresh batch of prompts, it returns the groups to train on and what was discarded; `keep_informative`
turns that into the step's batch for whoever rolls out: `informative_batch` is what the trainer calls after
scoring, with its own rollout and scoring, and the asynchronous rollout worker calls it with its own. The number
of generation rounds is bounded, so a task the policy always solves (or never does) cannot loop forever; the
step then trains on the informative groups it found.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Generic, Sequence, TypeVar

import torch

from hybridrl.algorithms import uniform_groups
from hybridrl.training.batch import RolloutBatch

Group = TypeVar("Group")


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B / group_size,) bool: True for groups whose scores (B,), ordered group-major, are not all equal."""
    return ~uniform_groups(scores, group_size)[::group_size]


@dataclass
class DynamicSample(Generic[Group]):
    kept: list[Group] = field(default_factory=list)
    """Informative groups, in the order generated, at most `target` of them."""
    num_discarded: int = 0
    """Groups left out because all their samples scored alike (the metric of what was dropped)."""
    num_surplus: int = 0
    """Informative groups generated beyond `target` in the last round and not used."""
    num_rounds: int = 0
    """Generation rounds run, the first included."""
    filled: bool = False
    """Whether `target` informative groups were found within the round bound."""


def fill_informative_groups(generate: Callable[[int], Sequence[tuple[Group, Sequence[float]]]], target: int,
                            max_rounds: int) -> DynamicSample[Group]:
    """Call `generate(round_index)` (a fresh batch of prompts rolled out and scored: a list of (group, its
    samples' scores)) until `target` informative groups are kept or `max_rounds` rounds have run.

    Groups are kept in the order generated; the informative ones past `target` are counted as surplus and
    dropped. `result.filled` says whether `target` was reached; if not, the caller trains on fewer groups.
    """
    if target < 1 or max_rounds < 1:
        raise ValueError(f"dynamic sampling needs target >= 1 and max_rounds >= 1; got {target} and {max_rounds}.")
    result: DynamicSample[Group] = DynamicSample()
    while len(result.kept) < target and result.num_rounds < max_rounds:
        for group, scores in generate(result.num_rounds):
            if len(set(float(s) for s in scores)) <= 1:
                result.num_discarded += 1
            elif len(result.kept) < target:
                result.kept.append(group)
            else:
                result.num_surplus += 1
        result.num_rounds += 1
    result.filled = len(result.kept) == target
    return result


def concatenate_batches(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Rows of several rollout batches in one, re-padded to the widest prompt and response (prompts stay
    left-padded, responses right-padded, as `build_rollout_batch` lays them out); `prompt_index` is renumbered
    so that each batch's prompts stay distinct. Only fields set before the log-prob passes are expected."""
    if len(batches) == 1:
        return batches[0]
    prompt_width = max(b.input_ids.shape[1] - b.response_length for b in batches)
    response_width = max(b.response_length for b in batches)
    values: dict[str, Any] = {}
    for f in fields(RolloutBatch):
        parts = [getattr(b, f.name) for b in batches]
        if f.name == "texts":
            values[f.name] = [text for part in parts for text in part]
        elif f.name == "columns":  # multi-turn episodes' reward columns, row-aligned like the texts
            values[f.name] = None if any(part is None for part in parts) else {
                key: [value for part in parts for value in part[key]] for key in parts[0]}
        elif f.name == "sampling":
            values[f.name] = parts[0]
        elif any(part is None for part in parts):
            values[f.name] = None
        else:
            values[f.name] = torch.cat([_widened(f.name, part, b, prompt_width, response_width, pad_token_id)
                                        for part, b in zip(parts, batches)])
    offsets = torch.tensor([0] + [int(b.prompt_index.max()) + 1 for b in batches[:-1]]).cumsum(0)
    values["prompt_index"] = torch.cat([b.prompt_index + offset.to(b.prompt_index.device)
                                        for b, offset in zip(batches, offsets)])
    return RolloutBatch(**values)


def _widened(name: str, tensor: torch.Tensor, batch: RolloutBatch, prompt_width: int, response_width: int,
             pad_token_id: int) -> torch.Tensor:
    """One field of `batch` padded to the new widths: a (B, P + R) field gains columns on the left of the prompt
    and the right of the response, a (B, R) field on the right. Position ids repeat their edge values (as the
    batch builder pads them); token ids take the pad id; everything else zeros."""
    if tensor.dim() == 1:
        return tensor
    width = batch.input_ids.shape[1]
    left = prompt_width - (width - batch.response_length) if tensor.shape[1] == width else 0
    right = response_width - batch.response_length
    if left == 0 and right == 0:
        return tensor
    if name == "position_ids":
        return torch.cat([tensor[:, :1].expand(-1, left), tensor, tensor[:, -1:].expand(-1, right)], dim=1)
    fill = pad_token_id if name == "input_ids" else 0
    return torch.nn.functional.pad(tensor, (left, right), value=fill)


def keep_informative(batch: RolloutBatch, next_round: Callable[[int], RolloutBatch], target: int, max_rounds: int,
                     pad_token_id: int) -> tuple[RolloutBatch, dict[str, float]]:
    """The scored `batch` reduced to its informative groups, refilled from `next_round(round_index)` (fresh prompts
    rolled out and scored) up to `target` groups or `max_rounds` rounds; with the `rollout/dynamic_sampling_*`
    counts. Who rolls out is the caller's: the trainer (`informative_batch`) or the asynchronous rollout worker.

    When no round yields an informative group, the first round's batch is trained on as it is (its advantages
    are all 0, so the policy term does nothing), and `rollout/dynamic_sampling_kept_groups` says 0."""
    group_size = batch.sampling.n
    rounds = [batch]

    def generate(round_index: int) -> list[tuple[tuple[RolloutBatch, torch.Tensor], list[float]]]:
        if round_index > 0:
            rounds.append(next_round(round_index))
        scored = rounds[round_index]
        rows = torch.arange(len(scored)).reshape(-1, group_size)
        scores = scored.scores.reshape(-1, group_size).tolist()
        return [((scored, group_rows), group_scores) for group_rows, group_scores in zip(rows, scores)]

    result = fill_informative_groups(generate, target, max_rounds)
    counts = {"rollout/dynamic_sampling_discarded_groups": result.num_discarded,
              "rollout/dynamic_sampling_kept_groups": len(result.kept),
              "rollout/dynamic_sampling_rounds": result.num_rounds,
              "rollout/dynamic_sampling_filled": float(result.filled)}
    if not result.kept:
        return batch, counts
    pieces = [source.select(torch.cat([rows for s, rows in result.kept if s is source]))
              for source in rounds if any(s is source for s, _ in result.kept)]
    return concatenate_batches(pieces, pad_token_id), counts


def informative_batch(trainer: Any, timer: Any, batch: RolloutBatch, timings: Any,
                      reward_metrics: dict[str, float]) -> tuple[RolloutBatch, Any, dict[str, float]]:
    """`algorithm.dynamic_sampling` in the trainer's step (`keep_informative`, the extra rounds rolled out and
    scored by the trainer, timed in its rollout and reward phases). Returns the batch, the rollout timings summed
    over rounds, and the first round's reward metrics (the policy's reward, unfiltered) with the
    `rollout/dynamic_sampling_*` counts. Off: everything as given."""
    config = trainer.config
    if not config.algorithm.dynamic_sampling:
        return batch, timings, reward_metrics
    all_timings = [timings]

    def next_round(round_index: int) -> RolloutBatch:
        prompts = trainer.parts.dataset.batch(next(trainer.sampler))
        trainer.generation_round = round_index  # a fresh sampling seed for this round
        try:
            with timer("rollout"):
                scored, round_timings = trainer.rollout(prompts)
        finally:
            trainer.generation_round = 0
        all_timings.append(round_timings)
        with timer("reward"):
            trainer.score(scored, prompts)
        return scored

    batch, counts = keep_informative(batch, next_round, config.trainer.prompts_per_step,
                                     config.algorithm.dynamic_sampling_max_rounds, trainer.parts.pad_token_id)
    timings = type(timings)(weight_sync_s=sum(t.weight_sync_s for t in all_timings),
                            engine_phases=_summed([t.engine_phases for t in all_timings]),
                            episodes=timings.episodes)  # multi-turn metrics: the first round's, like `reward/*`
    return batch, timings, {**reward_metrics, **counts}


def _summed(dicts: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for values in dicts:
        for key, value in values.items():
            total[key] = total.get(key, 0.0) + value
    return total
