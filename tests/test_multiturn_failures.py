"""Multi-turn episodes when something goes wrong: environments that fail while others are still stepping, and
observations cut by the budget."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from hybridrl.envs.base import EnvironmentCodeError, StepResult
from hybridrl.envs.rendering import ObservationRenderer
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine import multiturn as engine_multiturn
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.multiturn import EpisodeBudget, EpisodeRun, make_sessions
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


class FixedLatency:
    """A remote tool of one fixed latency: its answers come back as far apart as its calls were started."""

    def __init__(self, row):
        self.steps = 0

    async def reset(self):
        return [{"role": "user", "content": "hi"}]

    async def step(self, text):
        self.steps += 1
        await asyncio.sleep(0.03)
        return StepResult([{"role": "tool", "name": "t", "content": "ok"}], done=self.steps >= 3)


def test_a_pause_while_tools_start_does_not_split_the_turns_that_ended_together(monkeypatch):
    """The host stalls for 15 ms in the middle of recording 8 ended turns (a stand-in for a collection or a slow
    decode), so the second half's tools start, and answer, 15 ms after the first half's: those answers are expected
    (each call is as old as the first answer's was) and the 8 still resume as one wave per turn boundary."""
    text_of = EpisodeRun.turn_text  # what the harvest asks of each ended turn before starting its tool

    def stalling(self, ids, reason):
        if self.session.sample == 4:
            time.sleep(0.015)
        return text_of(self, ids, reason)

    monkeypatch.setattr(EpisodeRun, "turn_text", stalling)
    monkeypatch.setattr(engine_multiturn, "_START_EVERY", 1)  # each call starts as soon as its turn is recorded
    engine = BuiltinBackend(make_model("llama"), tokenizer=TOKENIZER, sync_every=16)
    episodes = engine.generate_episodes(make_sessions(FixedLatency, [{}] * 8, n=1, name="fixed.py:FixedLatency"),
                                        ObservationRenderer(TOKENIZER),
                                        SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True),
                                        EpisodeBudget())
    assert [episode.num_turns for episode in episodes] == [3] * 8
    assert engine.last_stats["resume_waves"] == 2 and engine.last_stats["decode_steps"] == 3 * (5 - 1)
