"""Multi-turn rollouts: what every backend shares, and the slow reference loop on any backend's `generate`.

An episode alternates assistant turns (sampled; in the loss, with behaviour log-probs) with observations from an
environment (rendered token-exactly by `envs.rendering.ObservationRenderer`; out of the loss), until the
environment says done or a budget ends it. `EpisodeRun` is one episode's bookkeeping, the same for every backend:
the prompt ids from the environment's first messages, the turn limit the budgets leave, what a finished turn adds
(the sampled ids as they were sampled; the text is decoded only to hand it to the environment), and what a step
result adds (the observation ids, cut to `max_observation_tokens` with a marker) or why the episode ends.

`generate_episodes_reference` is the plain loop: generate one turn for every live episode from its whole sequence
so far (each turn recomputes the whole context), step all their environments at once, append the observations,
repeat. Obviously right and slow; the built-in engine (`engine/multiturn.py`) does the same with the KV cache kept
across turns, and tests compare the two.

Choices:
- The environment is stepped after every assistant turn, also the last one a budget allows, so its reward for
  that turn is recorded; then `done` wins, then `max_turns`, then the token budget (`done_reason`).
- An observation that does not leave room for one more sampled token ends the episode (`max_tokens`) unshown.
- A truncated observation keeps its first ids, then the marker's ids, then the ids the template writes after the
  observation's content (its closing and the next turn's generation prompt), so the next assistant turn opens as it
  would have; that opening is kept whole even when `max_observation_tokens` is smaller than it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hybridrl.envs.base import (EnvironmentCodeError, EnvironmentFactory, EnvironmentSession, StepResult, defined_at,
                                run_sync, start_task)
from hybridrl.envs.episode import Episode
from hybridrl.envs.rendering import ChatTemplateError, ObservationRenderer
from hybridrl.rollout.base import FinishReason, SamplingParams


@dataclass(frozen=True)
class EpisodeBudget:
    """What ends an episode besides its environment."""

    max_turns: int = 4
    """Assistant turns per episode."""
    max_episode_tokens: int = 4096
    """All tokens of an episode: prompt, assistant turns and observations."""
    max_observation_tokens: int = 512
    """Ids one observation may add; longer ones are cut and end with `truncation_marker`."""
    truncation_marker: str = "\n... [observation truncated]\n"

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_episode_tokens < 2 or self.max_observation_tokens < 1:
            raise ValueError(f"EpisodeBudget needs max_turns >= 1, max_episode_tokens >= 2 and "
                             f"max_observation_tokens >= 1; got {self.max_turns}, {self.max_episode_tokens} and "
                             f"{self.max_observation_tokens}.")


def make_sessions(factory: EnvironmentFactory, rows: Sequence[dict[str, Any]], n: int, name: str) -> list[EnvironmentSession]:
    """One session per episode, prompt-major: the `n` samples of row 0, then those of row 1, ..."""
    return [EnvironmentSession(factory, row, name=name, sample=i * n + j) for i, row in enumerate(rows)
            for j in range(n)]


class PromptOverBudgetError(EnvironmentCodeError):
    """An episode's first messages render to a prompt that leaves no token to sample under `max_episode_tokens`.
    An `EnvironmentCodeError`, so the trainer handles it as one (finished steps saved, every rank told)."""


class ObservationTemplateError(EnvironmentCodeError):
    """The chat template could not render one observation token-exactly (`ChatTemplateError`) mid-run. An
    `EnvironmentCodeError`, so the trainer handles it as one (finished steps saved, every rank told)."""


def _special_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's special ids (a Hugging Face tokenizer rebuilds `all_special_ids` on every access, so this is
    asked only for a turn that ended on a stop id)."""
    return set(getattr(tokenizer, "all_special_ids", []) or [])


def _preview(messages: Sequence[dict[str, Any]], width: int = 60) -> str:
    """The last message's text, shortened: which data row it is, for an error message."""
    text = " ".join(str(messages[-1].get("content", "")).split()) if messages else ""
    return repr(text if len(text) <= width else text[:width - 3] + "...")


class EpisodeRun:
    """One episode being generated: its session, its `Episode` and the conversation as text."""

    def __init__(self, session: EnvironmentSession, renderer: ObservationRenderer, budget: EpisodeBudget,
                 messages: list[dict[str, Any]], stop_ids: set[int]):
        self.session, self.renderer, self.budget, self.stop_ids = session, renderer, budget, stop_ids
        self.messages = [dict(m) for m in messages]
        self.prompt_ids: list[int] = renderer.prompt_ids(self.messages)
        self._episode: Episode | None = None
        self._unrecorded: tuple[StepResult, list[int]] | None = None  # a step taken, its record not made yet
        self._unrecorded_len = 0
        self.last_turn_ids: list[int] = []
        self.num_turns = 0  # assistant turns recorded (the episode's `num_turns`, without counting its spans)
        self.done = False
        if len(self.prompt_ids) >= budget.max_episode_tokens:
            raise PromptOverBudgetError(
                f"the first messages environment {session.name!r} gave sample {session.sample} ({_preview(messages)}) "
                f"render to a prompt of {len(self.prompt_ids)} tokens, which leaves none to sample under "
                f"max_episode_tokens={budget.max_episode_tokens}; raise env.max_episode_tokens above "
                f"{len(self.prompt_ids)} or shorten that data row's prompt.")

    @property
    def episode(self) -> Episode:
        """The record, made from the prompt at first use (`make_record`)."""
        if self._episode is None:
            self.make_record()
        return self._episode

    def make_record(self) -> None:
        """Start the episode's record with its prompt. The engine makes hundreds at a call's start: it does so once the
        first decode block is launched, while the GPU runs it, not before with the GPU waiting."""
        self._episode = Episode(messages=self.messages)
        self._episode.add_prompt(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the episode so far, the observation of a step taken but not yet recorded included."""
        return (len(self.prompt_ids) if self._episode is None else len(self._episode.token_ids)) + self._unrecorded_len

    def turn_limit(self, max_new_tokens: int) -> int:
        """Tokens the next assistant turn may sample: the per-turn cap or what the episode budget leaves."""
        return min(max_new_tokens, self.budget.max_episode_tokens - self.num_tokens)

    def add_turn(self, ids: Sequence[int], logprobs: Sequence[float], finish_reason: FinishReason, *,
                 as_lists: bool = False) -> str:
        """Append the sampled ids as they are; returns the turn's text for the environment (without a special stop
        token, which the chat template writes itself). `as_lists`: `ids` and `logprobs` are already fresh lists of
        Python ints and floats (a `.tolist()`), taken as they are (converting each element again costs the engine's
        harvest more host time than the rest of recording a turn)."""
        if not as_lists:
            ids, logprobs = [int(t) for t in ids], [float(x) for x in logprobs]
        text = self.turn_text(ids, finish_reason)
        self.record_turn(ids, logprobs, text)
        return text

    def turn_text(self, ids: list[int], finish_reason: FinishReason) -> str:
        """The text of sampled `ids` for the environment, without a special stop token (the template writes it)."""
        strip = (finish_reason == "stop" and ids and ids[-1] in self.stop_ids
                 and ids[-1] in _special_ids(self.renderer.tokenizer))
        return self.renderer.tokenizer.decode(ids[:-1] if strip else ids, skip_special_tokens=False)

    def record_turn(self, ids: list[int], logprobs: list[float], text: str) -> None:
        """Append a turn whose `text` is `turn_text(ids, ...)`: the ids and log-probs as they are (lists of Python ints
        and floats), and the assistant message. The engine's harvest does this after it has started every ended turn's
        environment step, which needs only the text."""
        self.record_step()
        self.episode.add_sampled(ids, logprobs)
        self.num_turns += 1
        self.last_turn_ids = ids
        self.messages.append({"role": "assistant", "content": text})

    def add_step(self, result: StepResult) -> list[int] | None:
        """Record the environment's answer; the observation ids to feed next, or None when the episode is over."""
        ids = self.take_step(result)
        self.record_step()
        return ids

    def take_step(self, result: StepResult) -> list[int] | None:
        """`add_step` less the record of an observation to feed (its message, ids, reward and tool calls), which
        `record_step` makes later (`num_tokens` counts its ids meanwhile; the next `record_turn` makes it first). The
        engine takes hundreds of steps as their answers come in, each turn boundary's last one with the GPU waiting,
        and makes the records once the next decode block runs."""
        if result.done or self.num_turns >= self.budget.max_turns:
            self._record_result(result)
            return self._end("done" if result.done else "max_turns")
        if not result.observation:
            raise EnvironmentCodeError(f"environment {self.session.name!r} returned no observation with done=False"
                                       f"{defined_at(self.session.env.step)} in step {self.session.num_steps} for "
                                       f"sample {self.session.sample}; return the messages to show the model, or "
                                       "done=True.")
        try:
            ids = self.renderer.observation_ids(self.messages, result.observation, self.last_turn_ids)
        except ChatTemplateError as error:
            raise ObservationTemplateError(
                f"the chat template cannot render the observation environment {self.session.name!r} gave in step "
                f"{self.session.num_steps} for sample {self.session.sample} ({_preview(result.observation)}): {error}"
            ) from error
        ids = self._truncated(ids, result.observation)
        if self.num_tokens + len(ids) >= self.budget.max_episode_tokens:
            self._record_result(result)
            return self._end("max_tokens")  # unshown, so not in `messages` either (as with done and max_turns)
        self._unrecorded, self._unrecorded_len = (result, ids), len(ids)
        return ids

    def record_step(self) -> None:
        """Make the record of the observation `take_step` returned, if it is not made yet."""
        if self._unrecorded is None:
            return
        (result, ids), self._unrecorded, self._unrecorded_len = self._unrecorded, None, 0
        self._record_result(result)
        self.messages.extend(result.observation)
        self.episode.add_observation(ids)

    def _record_result(self, result: StepResult) -> None:
        if result.reward is not None:
            self.episode.reward = float(result.reward)
        if result.info:
            self.episode.tool_calls.extend(result.info.get("tool_calls", ()))

    def _truncated(self, ids: list[int], observation: list[dict[str, Any]]) -> list[int]:
        """`ids` cut to `max_observation_tokens`: first ids + marker + the template's next-turn opening."""
        limit = self.budget.max_observation_tokens
        if len(ids) <= limit:
            return ids
        opening = self.renderer.next_turn_opening([*self.messages, *observation])
        room = max(0, limit - len(opening))
        marker = self.renderer.encode(self.budget.truncation_marker)[:room]
        return ids[:room - len(marker)] + marker + opening

    def _end(self, reason: str) -> None:
        """Nothing more to feed: `add_step` returns this None."""
        self.episode.done_reason, self.done = reason, True


_PAUSES = {"count": 0, "was_enabled": True}
_PAUSE_LOCK = threading.Lock()


@contextlib.contextmanager
def collections_paused():
    """Automatic garbage collection off while episodes start and run (in any thread; on again when the last pause
    ends, if it was on before the first). A multi-turn call allocates most of its objects where the GPU waits: at its
    start (sessions reset, episode records) and at turn boundaries (hundreds of tasks, results, messages, the turns'
    lists), so that is where the collector's passes would land, each walking the episodes' long id lists. The engine
    runs the passes that are due itself while the GPU is busy (`collect_due`); what is left waits for the first
    collection after the pause (a whole call's objects, if nothing collected them: tens of milliseconds at 512
    episodes, where the call ends)."""
    with _PAUSE_LOCK:
        if _PAUSES["count"] == 0:
            _PAUSES["was_enabled"] = gc.isenabled()
            gc.disable()
        _PAUSES["count"] += 1
    try:
        yield
    finally:
        with _PAUSE_LOCK:
            _PAUSES["count"] -= 1
            if _PAUSES["count"] == 0 and _PAUSES["was_enabled"]:
                gc.enable()


def collect_due() -> None:
    """The young-generation collection the collector would have run by now (the middle one when it is due, else the
    youngest), if any is due; for a caller that has just launched GPU work, so that the pass runs while the GPU does
    (`collections_paused`). The oldest generation is left to the collector, whose rule for it Python does not
    expose."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    if counts[0] > thresholds[0]:
        gc.collect(1 if counts[1] >= thresholds[1] else 0)


async def start_runs(sessions: Sequence[EnvironmentSession], renderer: ObservationRenderer, budget: EpisodeBudget,
                     stop_ids: set[int]) -> list[EpisodeRun]:
    """Reset every environment at once and render each episode's prompt; if that fails (an environment raises, a
    prompt is over the budget), every session is closed before the error propagates, since no caller holds them
    as runs yet."""
    try:
        with collections_paused():
            return [EpisodeRun(session, renderer, budget, messages, stop_ids)
                    for session, messages in zip(sessions, await _results([session.reset() for session in sessions]))]
    except BaseException:
        await asyncio.gather(*(session.close() for session in sessions), return_exceptions=True)
        raise


async def _results(coroutines: list) -> list:
    """The coroutines' results, run at once as tasks; those that needed no waiting are done as they start (eager tasks,
    Python 3.12+) and are read directly, without a gather's callback per task through the event loop."""
    tasks = [start_task(coroutine) for coroutine in coroutines]
    if all(task.done() for task in tasks):
        return [task.result() for task in tasks]
    return list(await asyncio.gather(*tasks))


async def close_runs(runs: Sequence[EpisodeRun]) -> None:
    """Close every episode's environment, all of them even when one fails (a failure does not cancel the other
    closes), then raise the first failure."""
    results = await asyncio.gather(*(start_task(run.session.close()) for run in runs if run.session.closes),
                                   return_exceptions=True)
    failures = [result for result in results if isinstance(result, BaseException)]
    if failures:
        raise failures[0]


def check_episode_request(sessions: Sequence[EnvironmentSession], params: SamplingParams) -> None:
    if not sessions:
        raise ValueError("generate_episodes needs at least one environment session (one per episode).")
    if params.n != 1:
        raise ValueError(f"generate_episodes takes one session per episode, so SamplingParams.n must be 1 (got "
                         f"{params.n}); make n sessions per data row instead (`make_sessions(..., n=...)`).")


def generate_episodes_reference(backend: Any, sessions: Sequence[EnvironmentSession], renderer: ObservationRenderer,
                                params: SamplingParams, budget: EpisodeBudget, stop_ids: set[int]) -> list[Episode]:
    """The plain loop over `backend.generate` (one turn of every live episode per call, each from its whole
    sequence so far); `stop_ids` are the ids the backend stops at (its end-of-sequence ids and the params')."""
    check_episode_request(sessions, params)
    runs = run_sync(start_runs(sessions, renderer, budget, stop_ids))
    live, turn = list(runs), 0
    try:
        while live:
            by_limit: dict[int, list[EpisodeRun]] = {}
            for run in live:
                by_limit.setdefault(run.turn_limit(params.max_new_tokens), []).append(run)
            texts: dict[int, str] = {}
            for limit, group in sorted(by_limit.items()):
                seed = None if params.seed is None else params.seed + turn
                turn_params = replace(params, max_new_tokens=limit, seed=seed)
                for run, generation in zip(group, backend.generate([r.episode.token_ids for r in group], turn_params)):
                    texts[id(run)] = run.add_turn(generation.token_ids, generation.logprobs, generation.finish_reason)
            results = run_sync(_step_all([(run.session, texts[id(run)]) for run in live]))
            live = [run for run, result in zip(live, results) if run.add_step(result) is not None]
            turn += 1
    finally:
        run_sync(close_runs(runs))
    return [run.episode for run in runs]


async def _step_all(calls: list[tuple[EnvironmentSession, str]]) -> list[StepResult]:
    return list(await asyncio.gather(*(session.step(text) for session, text in calls)))
