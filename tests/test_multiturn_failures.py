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
from hybridrl.rollout.multiturn import EpisodeBudget, make_sessions
from test_multiturn import TOKENIZER, Endless, assert_same_episodes, both, make_model


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


def test_a_truncated_observation_keeps_the_templates_next_turn_opening():
    """Cut to 100 ids, an observation keeps its first ids and the marker, and still ends as the template ends it: the
    tool message's closing and the next assistant turn's opening, so the model's next turn begins where it would
    have (on both backends alike)."""
    budget = EpisodeBudget(max_turns=3, max_episode_tokens=10**4, max_observation_tokens=100)
    _, engine_episodes, reference = both(make_model("llama"), factory=Endless, budget=budget)
    assert_same_episodes(engine_episodes, reference)
    opening = TOKENIZER.encode("\n</tool_response><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    marker = TOKENIZER.encode(budget.truncation_marker, add_special_tokens=False)
    for episode in engine_episodes:
        observations = [episode.span_ids(span) for span in episode.spans if span.kind == "observation"]
        assert len(observations) == 2
        for ids in observations:
            assert len(ids) == 100 and ids[-len(opening):] == opening
            assert ids[-len(opening) - len(marker):-len(opening)] == marker
            assert TOKENIZER.decode(ids[:100 - len(opening) - len(marker)]).endswith("x" * 5)  # the observation's start
