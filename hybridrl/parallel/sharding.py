"""Splitting a batch's work across ranks and putting the pieces back together.

Work is split by rows balanced on token counts, with the same number of rows on every rank, so every
rank runs the same number of forward/backward passes (FSDP collectives must line up). Rollout and
scoring are split by whole prompt groups.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hybridrl.parallel.process_group import DistributedSetup, all_reduce
from hybridrl.rewards import RewardError


def balanced_partition(costs: Sequence[int | float], num_parts: int) -> list[list[int]]:
    """Positions 0..len(costs)-1 in `num_parts` groups whose sizes differ by at most one and whose cost
    sums are balanced (longest first, each to the cheapest group that still has room); each group sorted."""
    count = len(costs)
    capacity = [count // num_parts + (part < count % num_parts) for part in range(num_parts)]
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0.0, part) for part in range(num_parts)]  # (cost so far, part) of parts with room
    order = sorted(range(count), key=lambda i: (-costs[i], i))
    for position in order:
        total, part = heapq.heappop(heap)
        parts[part].append(position)
        if len(parts[part]) < capacity[part]:
            heapq.heappush(heap, (total + float(costs[position]), part))
    return [sorted(part) for part in parts]


def shard_rows(rows: torch.Tensor, num_tokens: torch.Tensor, setup: DistributedSetup) -> torch.Tensor:
    """This rank's share of `rows` (indices into a batch), balanced by `num_tokens[rows]`.

    Every rank gets len(rows) / world_size rows (required to divide: FSDP needs the same number of
    forward passes on every rank). With one process, `rows` itself is returned.
    """
    if not setup.is_distributed:
        return rows
    if len(rows) % setup.world_size:
        raise ValueError(f"{len(rows)} sequences cannot be split evenly over {setup.world_size} ranks; make the "
                         "rollout batch and actor.mini_batch_size multiples of trainer.num_gpus.")
    costs = num_tokens[rows.to(num_tokens.device)].tolist()
    mine = balanced_partition(costs, setup.world_size)[setup.rank]
    return rows[torch.tensor(mine, dtype=torch.long, device=rows.device)]


def shard_batch(batch: Any, setup: DistributedSetup) -> Any:
    """This rank's rows of a `RolloutBatch`, balanced by tokens (prompt + response) per row."""
    if not setup.is_distributed:
        return batch
    return batch.select(shard_rows(torch.arange(len(batch)), batch.attention_mask.sum(1), setup))


def shard_micro_batches(micro_batches: list[torch.Tensor], num_tokens: torch.Tensor,
                        setup: DistributedSetup) -> list[torch.Tensor]:
    """This rank's micro-batches of one mini-batch (given as the one-process micro-batches): the
    mini-batch's rows balanced by `num_tokens` across ranks, cut to the same micro-batch size."""
    if not setup.is_distributed:
        return micro_batches
    return list(shard_rows(torch.cat(micro_batches), num_tokens, setup).split(len(micro_batches[0])))


def match_micro_batch_count(micro_batches: list[torch.Tensor], setup: DistributedSetup) -> list[torch.Tensor]:
    """Split this rank's largest micro-batches until every rank has as many as the rank with the most
    (token-budget grouping may give ranks different counts; FSDP needs equal forward/backward counts).
    Splitting only shrinks micro-batches, so a token budget still holds."""
    if not setup.is_distributed:
        return micro_batches
    count = torch.tensor([len(micro_batches)], device=setup.device)
    target = int(all_reduce(count, setup, op="max").item())
    micro_batches = list(micro_batches)
    while len(micro_batches) < target:
        largest = max(range(len(micro_batches)), key=lambda i: len(micro_batches[i]))
        if len(micro_batches[largest]) < 2:
            raise AssertionError("ranks hold equal row counts, so a split is always possible")
        half = len(micro_batches[largest]) // 2
        micro_batches[largest:largest + 1] = [micro_batches[largest][:half], micro_batches[largest][half:]]
    return micro_batches


def gather_rows(values: torch.Tensor, rows: torch.Tensor, num_rows: int, setup: DistributedSetup) -> torch.Tensor:
    """Reassemble a (num_rows, ...) tensor from every rank's `values` for its `rows` (from `shard_rows`)."""
    if not setup.is_distributed:
        return values
    rows = rows.to(values.device)
    all_values = [torch.empty_like(values) for _ in range(setup.world_size)]
    all_rows = [torch.empty_like(rows) for _ in range(setup.world_size)]
    dist.all_gather(all_values, values.contiguous())
    dist.all_gather(all_rows, rows.contiguous())
    full = values.new_empty((num_rows, *values.shape[1:]))
    full[torch.cat(all_rows)] = torch.cat(all_values)
    return full


def rank_share(num_prompts: int, params: Any, rank: int, world_size: int) -> tuple[int, int, Any]:
    """The prompts [start, stop) that rank `rank` of `world_size` samples for in `generate_sharded`, and its sampling
    settings (its own seed); the asynchronous rollout worker makes every rank's share with these, so that its
    batch is the one the ranks would have made."""
    start, stop = (num_prompts * r // world_size for r in (rank, rank + 1))
    seed = None if params.seed is None else params.seed + 1_000_003 * rank
    return start, stop, dataclasses.replace(params, seed=seed)


def generate_sharded(backend: Any, prompts: list[list[int]], params: Any, setup: DistributedSetup,
                     decode: Callable[[list[Any]], list[str]] | None = None) -> list[Any]:
    """Each rank samples for a contiguous share of `prompts`; every rank returns all generations,
    prompt-major with global `prompt_index`, as `backend.generate(prompts, params)` would.
    `decode(generations) -> texts`: each rank decodes its own share into `Generation.text` before the
    gather, so no rank decodes the whole batch (the tokenizer's time then shrinks with the ranks too).

    Ranks draw from different seeds (seed + rank), so a multi-rank rollout is a different sample
    from a one-process rollout with the same seed, not the same one.
    """
    def with_texts(generations: list[Any]) -> list[Any]:
        if decode is not None and generations:
            for generation, text in zip(generations, decode(generations), strict=True):
                generation.text = text
        return generations

    if not setup.is_distributed:
        return with_texts(backend.generate(prompts, params))
    start, stop, share_params = rank_share(len(prompts), params, setup.rank, setup.world_size)
    local = with_texts(backend.generate(prompts[start:stop], share_params) if stop > start else [])
    for generation in local:
        generation.prompt_index += start
    gathered: list[Any] = [None] * setup.world_size
    dist.all_gather_object(gathered, local)
    return [generation for part in gathered for generation in part]


def score_sharded(score: Any, prompts: list[str], completions: list[str], columns: dict[str, list], group_size: int,
                  setup: DistributedSetup) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """`score(prompts, completions, columns, first_index)` (a `RewardSet.score`) over the batch, each rank
    scoring a contiguous share of whole groups of `group_size` (the samples of one prompt stay together);
    every rank returns the whole batch's scores. A reward error on any rank is raised on every rank, so
    no process waits for one that failed."""
    if not setup.is_distributed:
        return score(prompts, completions, columns)
    groups, world = len(completions) // group_size, setup.world_size
    start, stop = (groups * r // world * group_size for r in (setup.rank, setup.rank + 1))
    if setup.rank == world - 1:
        stop = len(completions)  # a partial last group (not made by the trainer) stays with the last rank
    try:
        if stop > start:
            total, per_function = score(prompts[start:stop], completions[start:stop],
                                        {key: values[start:stop] for key, values in columns.items()}, start)
            outcome: Any = (total.tolist(), per_function)
        else:
            outcome = ([], {})
    except RewardError as error:
        outcome = str(error)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, outcome)
    failures = [part for part in gathered if isinstance(part, str)]
    if failures:
        raise RewardError(failures[0])
    per_function: dict[str, list[float]] = {}
    for _, part in gathered:
        for name, values in part.items():
            per_function.setdefault(name, []).extend(values)
    return torch.tensor([value for total, _ in gathered for value in total], dtype=torch.float32), per_function


