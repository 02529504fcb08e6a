"""The one interface every rollout backend implements, and the records it returns.

A backend turns tokenized prompts into sampled responses with the sampler's own per-token
log-probabilities, so the trainer can measure sampler/trainer drift every step. Outputs are ordered
prompt-major: the `n` samples of prompt 0, then those of prompt 1, and so on.
"""

from __future__ import annotations

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


@dataclass
class Generation:
    """One sampled response."""

    prompt_index: int
    token_ids: list[int]
    """Response tokens, including the stop token when one ended it; nothing after a stop string."""
    logprobs: list[float]
    """log_softmax(logits / temperature) of each response token, taken before top-p/top-k/min-p
    filtering (temperature 1 when greedy), so it is directly comparable to the trainer's log-probs."""
    finish_reason: FinishReason
    text: str | None = None
    """The response decoded, when the trainer had it decoded where it was generated (several processes each
    decode their own share: `distributed.generate_sharded`); backends leave it None."""


class RolloutBackend(Protocol):
    """What the trainer calls. Backends read the actor's weights; they do not own a copy."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample `params.n` responses for each prompt; returns len(prompts) * n generations, prompt-major."""
        ...

    def release_memory(self) -> None:
        """Free whatever the rollout phase allocated (KV cache, graphs) before training resumes."""
        ...
