"""The one interface every rollout backend implements, and the records it returns.

A backend turns tokenized prompts into sampled responses with the sampler's own per-token
log-probabilities, so the trainer can measure sampler/trainer drift every step. Outputs are ordered
prompt-major: the `n` samples of prompt 0, then those of prompt 1, and so on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]


@dataclass
class SamplingParams:
    """How to sample; `temperature == 0` means greedy (argmax, log-probs of the unscaled softmax)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    """Force every response to `max_new_tokens` (benchmarks)."""


def as_list(values: Sequence) -> list:
    """A list of Python numbers from a list (itself), a numpy array or a tensor (`tolist`), or any sequence."""
    if isinstance(values, list):
        return values
    return values.tolist() if hasattr(values, "tolist") else list(values)


class Generation:
    """One sampled response.

    `token_ids`: response tokens, including the stop token when one ended it; nothing after a stop string.
    `logprobs`: log_softmax(logits / temperature) of each response token, taken before top-p/top-k/min-p
    filtering (temperature 1 when greedy), so it is directly comparable to the trainer's log-probs.
    `text`: the response decoded, when the trainer had it decoded where it was generated (several processes each
    decode their own share: `sharding.generate_sharded`); backends leave it None.

    A backend may hand over 1-D numpy arrays instead of lists (the built-in engine does: building a large batch's
    Python ints and floats at a sync point costs host time while the GPU idles). `token_ids` and `logprobs` are
    still lists, made on first access; `token_values` and `logprob_values` give what is held, unconverted, to
    readers that take either (the batch builder), and pickling (the gather across processes) keeps arrays.
    """

    __slots__ = ("prompt_index", "_token_ids", "_logprobs", "finish_reason", "text")

    def __init__(self, prompt_index: int, token_ids: Sequence[int], logprobs: Sequence[float],
                 finish_reason: FinishReason, text: str | None = None) -> None:
        self.prompt_index, self.finish_reason, self.text = prompt_index, finish_reason, text
        self._token_ids, self._logprobs = token_ids, logprobs

    @property
    def token_ids(self) -> list[int]:
        self._token_ids = as_list(self._token_ids)  # kept: later reads are free
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: Sequence[int]) -> None:
        self._token_ids = value

    @property
    def logprobs(self) -> list[float]:
        self._logprobs = as_list(self._logprobs)
        return self._logprobs

    @logprobs.setter
    def logprobs(self, value: Sequence[float]) -> None:
        self._logprobs = value

    @property
    def token_values(self) -> Sequence[int]:
        """The token ids as held: a list or a 1-D integer numpy array."""
        return self._token_ids

    @property
    def logprob_values(self) -> Sequence[float]:
        """The log-probs as held: a list or a 1-D float numpy array."""
        return self._logprobs

    def _key(self) -> tuple:
        return self.prompt_index, self.token_ids, self.logprobs, self.finish_reason, self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Generation) and self._key() == other._key()

    __hash__ = None  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        return (f"Generation(prompt_index={self.prompt_index!r}, token_ids={self.token_ids!r}, "
                f"logprobs={self.logprobs!r}, finish_reason={self.finish_reason!r}, text={self.text!r})")

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(self.__slots__, state):
            setattr(self, name, value)


class RolloutBackend(Protocol):
    """What the trainer calls. Backends read the actor's weights; they do not own a copy."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample `params.n` responses for each prompt; returns len(prompts) * n generations, prompt-major."""
        ...

    def release_memory(self) -> None:
        """Free whatever the rollout phase allocated (KV cache, graphs) before training resumes."""
        ...


class EpisodeBackend(Protocol):
    """Multi-turn rollouts (`rollout/multiturn.py`), which the `hf` and `builtin` backends implement.

    `generate_episodes(sessions, renderer, params, budget) -> list[Episode]`: one `envs.episode.Episode` per
    `envs.base.EnvironmentSession` (one session per episode; `params.n` must be 1, so make n sessions per data row),
    in the sessions' order. `params.max_new_tokens` caps each assistant turn; `budget` is a
    `multiturn.EpisodeBudget` (turns, tokens per episode, tokens per observation); `renderer` an
    `envs.rendering.ObservationRenderer` that turns the first messages and each observation into ids.
    """

    def generate_episodes(self, sessions: list, renderer: object, params: SamplingParams, budget: object) -> list:
        ...
