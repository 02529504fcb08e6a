"""Partial rollouts (`trainer.partial_rollout`): new weights taken over in the middle of a batch.

The thread worker of the asynchronous pipeline generates a batch with the version its schedule names
(`async_pipeline.needed_version`); the trainer may publish a newer one while that batch is being generated. Without
partial rollouts (`off`) the worker finishes the batch with the version it started with. With them it generates in
segments (`SEGMENTS` per response) and, between two segments, takes over the newest published version:

- `continue`: the sequences in flight go on under the new weights; each token records the version that sampled it
  (`token_versions`), and its behaviour log-prob is the one its own version gave, so the trainer's off-policy
  correction (`algorithm.rollout_correction_cap`, ...) stays exact per token;
- `requeue`: the sequences in flight are cut and generated again from their prompts with the new weights; those that
  had finished keep the version that made them.

A segment continues a sequence by prefilling its prompt and the tokens it has so far (its KV cache is made again,
with the weights of the moment: under `continue` that is the point of taking over). Each segment samples with its own
seed (the batch's seed + the segment's number x `SEGMENT_SEED_STRIDE`). Which segment a push lands before depends
on when the trainer publishes it, so a run with partial rollouts is not bitwise reproducible (nor is its resume);
with `trainer.max_staleness=0` no version can land during a batch and the worker does not segment at all.
Built for single-turn batches of the thread worker, without `rollout.stop_strings` (a stop string may span two
segments); `config/checks.py` refuses the rest in one sentence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hybridrl.rollout.base import Generation, SamplingParams

SEGMENTS = 4
"""Segments per response: a push can land at 3 points of a batch; each costs a prefill of every sequence in flight."""
SEGMENT_SEED_STRIDE = 1_000_033
"""Seeds of later segments step by this (the steps' and rounds' seeds step by other primes)."""


@dataclass
class Row:
    """One sequence of the batch as it grows: its prompt, its tokens so far and each token's version."""

    prompt_index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """None while in flight."""


@dataclass
class PartialCounts:
    """What the take-overs did in one batch (`rollout/partial_*` metrics)."""

    takeovers: int = 0
    requeued: int = 0


def segment_length(max_new_tokens: int) -> int:
    return max(1, -(-max_new_tokens // SEGMENTS))


def generate_in_segments(backend: Any, prompt_ids: list[list[int]], params: SamplingParams, version: int,
                         take_newer: Callable[[], int | None], mode: str,
                         ) -> tuple[list[Generation], list[list[int]], PartialCounts]:
    """The batch's generations (prompt-major, `params.n` per prompt, as `backend.generate` returns them), each token's
    version, and the take-overs' counts. `take_newer()` loads the newest published version into the backend's
    weights and returns it, or returns None when there is none newer; called between segments only."""
    step = segment_length(params.max_new_tokens)
    rows = [Row(index) for index in range(len(prompt_ids)) for _ in range(params.n)]
    counts, segment = PartialCounts(), 0
    while any(row.finish_reason is None for row in rows):
        if segment:
            newer = take_newer()
            if newer is not None:
                counts.takeovers += 1
                version = newer
                if mode == "requeue":
                    counts.requeued += restart_in_flight(rows)
        extend(backend, prompt_ids, rows, params, segment, step, version)
        segment += 1
    generations = [Generation(row.prompt_index, row.tokens, row.logprobs, row.finish_reason) for row in rows]
    return generations, [row.versions for row in rows], counts


def restart_in_flight(rows: list[Row]) -> int:
    """Cut the sequences in flight back to their prompts (requeue); how many were cut."""
    cut = [row for row in rows if row.finish_reason is None and row.tokens]
    for row in cut:
        row.tokens, row.logprobs, row.versions = [], [], []
    return len(cut)


def extend(backend: Any, prompt_ids: list[list[int]], rows: list[Row], params: SamplingParams, segment: int,
           step: int, version: int) -> None:
    """One segment for every sequence in flight: up to `step` more tokens, sampled with `version`'s weights. The
    sequences in flight always have the same length (each segment gives each of them `step` tokens unless it ends
    there, and a requeue cuts them all), so one call serves them; the first segment is one call with `params.n`
    samples per prompt, as without partial rollouts."""
    flight = [row for row in rows if row.finish_reason is None]
    done = len(flight[0].tokens)
    assert all(len(row.tokens) == done for row in flight), "sequences in flight grow together"
    seed = None if params.seed is None else params.seed + SEGMENT_SEED_STRIDE * segment
    call = dataclasses.replace(params, seed=seed, max_new_tokens=min(step, params.max_new_tokens - done))
    if len(flight) == len(rows) and done == 0:
        outputs = backend.generate(prompt_ids, call)
    else:
        outputs = backend.generate([prompt_ids[row.prompt_index] + row.tokens for row in flight],
                                   dataclasses.replace(call, n=1))
    for row, output in zip(flight, outputs, strict=True):
        row.tokens += list(output.token_ids)
        row.logprobs += list(output.logprobs)
        row.versions += [version] * len(output.token_ids)
        if output.finish_reason == "stop":
            row.finish_reason = "stop"
        elif len(row.tokens) >= params.max_new_tokens:
            row.finish_reason = "length"


def token_versions_tensor(versions: list[list[int]], response_length: int) -> torch.Tensor:
    """(B, R) version of each response token; positions after a response's end repeat its last version (they are
    masked out of every metric and loss)."""
    out = torch.zeros((len(versions), response_length), dtype=torch.long)
    for row, own in enumerate(versions):
        if own:
            out[row, :len(own)] = torch.tensor(own)
            out[row, len(own):] = own[-1]
    return out
