"""What the asynchronous pipeline's tests share: the metrics two runs must agree on, and a reward that fails on a
chosen batch (the worker's scoring raising mid-run, in one process or in rank 0 of several)."""

from __future__ import annotations

from conftest import contains_seven


def learning_metrics(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """What must agree between runs: everything but clocks and memory."""
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in history]


def reward_failing_on_batch(batch: int):
    """`contains_seven`, under its name (so the metrics are named alike), raising "the grader is down" on its
    `batch`-th call (from 1): the worker scores one batch per call."""
    calls = []

    def failing(prompts, completions, **columns):
        calls.append(1)
        if len(calls) == batch:
            raise ValueError("the grader is down")
        return contains_seven(prompts, completions)

    failing.__name__ = "contains_seven"
    return failing
