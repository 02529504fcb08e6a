"""The record of one multi-turn episode: one token sequence with a loss mask that has holes.

    [prompt ........][assistant 1 ....][observation 1 ...][assistant 2 ....] ...
    loss_mask     0 0 0 0 0 0 0 0 1 1 1 1 1 0 0 0 0 0 0 0 1 1 1 1 1
    logprobs      0 0 0 0 0 0 0 0 a b c d e 0 0 0 0 0 0 0 f g h i j

The engine builds it turn by turn (`add_prompt`, `add_sampled`, `add_observation`) from the ids it fed the model
and the ids it sampled; the trainer trains on `token_ids` as they are, so assistant text is never re-tokenized.
`check()` asserts the invariants both sides rely on.

Choices: plain lists (no torch, no numpy), so environments, tests and reward code can build and read episodes
anywhere; the trainer converts them to tensors when it packs a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hybridrl.envs.base import Message


@dataclass
class ToolRecord:
    """One tool call of an episode and what came back."""

    name: str
    """The tool called; empty for a call that could not be parsed."""
    arguments: dict[str, Any]
    result: str
    """The observation text the model was shown (the tool's result or what went wrong)."""
    error: bool = False
    """The tool raised, timed out, was unknown, or the call was malformed."""
    timed_out: bool = False
    malformed: bool = False
    latency_s: float = 0.0
    where: str = ""
    """For a tool that raised: file:line in function of the user's tool code, innermost first."""


@dataclass
class TurnSpan:
    """A half-open range `[start, end)` of `Episode.token_ids` and what produced it."""

    kind: str
    """'prompt', 'assistant' (sampled, in the loss) or 'observation' (rendered from environment messages)."""
    start: int
    end: int


@dataclass
class Episode:
    """One trajectory, as the engine produces it and the trainer consumes it."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """1 on sampled assistant tokens, 0 on prompt and observation tokens."""
    behaviour_logprobs: list[float] = field(default_factory=list)
    """The sampler's log-probability of each sampled token; 0.0 where nothing was sampled."""
    spans: list[TurnSpan] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    """The conversation as text (for reward functions and logs; never re-tokenized for training)."""
    tool_calls: list[ToolRecord] = field(default_factory=list)
    reward: float | None = None
    done_reason: str = ""
    """Why the episode ended: 'done' (the environment said so), 'max_turns', 'max_tokens', ..."""

    def add_prompt(self, ids: list[int]) -> None:
        self._add("prompt", ids, [0.0] * len(ids), mask=0)

    def add_sampled(self, ids: list[int], logprobs: list[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"got {len(ids)} sampled ids with {len(logprobs)} log-probs; give one per token.")
        self._add("assistant", ids, list(logprobs), mask=1)

    def add_observation(self, ids: list[int]) -> None:
        self._add("observation", ids, [0.0] * len(ids), mask=0)

    def _add(self, kind: str, ids: list[int], logprobs: list[float], mask: int) -> None:
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.behaviour_logprobs.extend(logprobs)
        self.spans.append(TurnSpan(kind, start, len(self.token_ids)))

    @property
    def num_turns(self) -> int:
        return sum(span.kind == "assistant" for span in self.spans)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def observation_share(self) -> float:
        """Observation tokens over all tokens after the prompt (0.0 for a single-turn episode)."""
        observed = sum(s.end - s.start for s in self.spans if s.kind == "observation")
        after_prompt = observed + self.num_sampled_tokens
        return observed / after_prompt if after_prompt else 0.0

    def span_ids(self, span: TurnSpan) -> list[int]:
        return self.token_ids[span.start:span.end]

    def check(self) -> None:
        """Raises AssertionError (also under `python -O`) naming the first broken invariant: equal lengths, a 0/1
        mask, log-probs that are finite and <= 0 under the mask and exactly 0 outside it, and spans that tile the
        sequence, start with the prompt, and carry mask 1 exactly on assistant spans."""
        size = len(self.token_ids)
        _require(len(self.loss_mask) == size and len(self.behaviour_logprobs) == size,
                 f"lengths differ: {size} ids, {len(self.loss_mask)} mask values, {len(self.behaviour_logprobs)} "
                 "log-probs")
        for i, (mask, logprob) in enumerate(zip(self.loss_mask, self.behaviour_logprobs)):
            _require(mask in (0, 1), f"loss_mask[{i}] is {mask!r}; it must be 0 or 1")
            if mask:
                _require(math.isfinite(logprob) and logprob <= 0.0, f"sampled token {i} has log-prob {logprob!r}")
            else:
                _require(logprob == 0.0, f"token {i} is not sampled (mask 0) but has log-prob {logprob!r}")
        position = 0
        for span in self.spans:
            _require(span.kind in ("prompt", "assistant", "observation"), f"unknown span kind {span.kind!r}")
            _require(span.start == position and span.end >= span.start, f"spans do not tile the ids at {span}")
            expected = int(span.kind == "assistant")
            _require(all(m == expected for m in self.loss_mask[span.start:span.end]),
                     f"the {span.kind} span {span.start}:{span.end} has mask values other than {expected}")
            position = span.end
        _require(position == size, f"the spans cover {position} of {size} ids")
        _require(not self.spans or self.spans[0].kind == "prompt", "an episode starts with its prompt span")


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Per-batch means under `rollout/`: turns and tool calls per episode, tool errors, timeouts and malformed
    calls per episode, tool latency p50/p95 (seconds), and the observation share of the tokens after prompts."""
    if not episodes:
        return {}
    count = len(episodes)
    calls = [record for episode in episodes for record in episode.tool_calls]
    latencies = sorted(record.latency_s for record in calls if not record.malformed)
    observed = sum(s.end - s.start for e in episodes for s in e.spans if s.kind == "observation")
    sampled = sum(e.num_sampled_tokens for e in episodes)
    metrics = {
        "rollout/turns_per_episode": sum(e.num_turns for e in episodes) / count,
        "rollout/tool_calls_per_episode": len(calls) / count,
        "rollout/tool_errors_per_episode": sum(r.error for r in calls) / count,
        "rollout/tool_timeouts_per_episode": sum(r.timed_out for r in calls) / count,
        "rollout/tool_malformed_per_episode": sum(r.malformed for r in calls) / count,
        "rollout/observation_token_share": observed / (observed + sampled) if observed + sampled else 0.0,
    }
    if latencies:
        metrics["rollout/tool_latency_p50_s"] = _percentile(latencies, 0.50)
        metrics["rollout/tool_latency_p95_s"] = _percentile(latencies, 0.95)
    return metrics


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), on an ascending list."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
