"""Multi-turn episodes when something goes wrong: environments that fail while others are still stepping, and
observations cut by the budget."""

from __future__ import annotations

import threading
import time

import pytest

from hybridrl.envs.base import EnvironmentCodeError, StepResult
from hybridrl.envs.rendering import ObservationRenderer
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.hf import HFBackend
from hybridrl.rollout.multiturn import EpisodeBudget, make_sessions
from tests.test_multiturn import IM_END, TOKENIZER, assert_same_episodes, make_model


class FailsBesideSlowSteps:
    """A synchronous environment: sample 0's first step raises at once, the others' steps take a while (in their
    worker threads); close() records whether its own step was still running."""

    closed_while_stepping: list[bool] = []

    def __init__(self, row):
        self.sample, self.stepping = row["sample"], threading.Event()

    def reset(self):
        return [{"role": "user", "content": "hi"}]

    def step(self, text):
        if self.sample == 0:
            raise RuntimeError("lost the connection")
        self.stepping.set()
        time.sleep(0.4)
        self.stepping.clear()
        return StepResult([{"role": "tool", "content": "ok"}])

    def close(self):
        FailsBesideSlowSteps.closed_while_stepping.append(self.stepping.is_set())


def test_environments_are_closed_only_after_their_pending_steps_have_finished():
    """The engine's loop ends at sample 0's error while the other steps still run in their threads: each of
    those environments is closed after its step returns, never beside it."""
    FailsBesideSlowSteps.closed_while_stepping = []
    engine = BuiltinBackend(make_model("llama"), tokenizer=TOKENIZER)
    sessions = make_sessions(FailsBesideSlowSteps, [{"sample": i} for i in range(3)], n=1, name="slow.py:Env")
    with pytest.raises(EnvironmentCodeError, match="lost the connection"):
        engine.generate_episodes(sessions, ObservationRenderer(TOKENIZER),
                                 SamplingParams(max_new_tokens=3, temperature=0), EpisodeBudget())
    assert FailsBesideSlowSteps.closed_while_stepping == [False, False, False]
