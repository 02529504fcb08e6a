"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): keep only the prompt groups whose samples did not
all score alike, and generate more prompts until the step has enough of them.

A group whose scores are all equal has group-relative advantages of 0: it teaches nothing yet dilutes a
token-mean loss. This module is bookkeeping only (no models): the trainer hands it a function that rolls out
and scores a fresh batch of prompts, and gets back the groups to train on and what was discarded. The number
of generation rounds is bounded, so a task the policy always solves (or never does) cannot loop forever; the
step then trains on the informative groups it found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Sequence, TypeVar

import torch

from hybridrl.algorithms import uniform_groups

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
