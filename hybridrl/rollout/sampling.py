"""Token sampling on device, with no host synchronisation (safe inside a CUDA graph).

Choices:
- Randomness comes in as one uniform number per row (`uniforms`, drawn by the caller from a seeded
  `torch.Generator`), and a token is drawn by inverting the CDF of the filtered distribution. The
  graph then holds no RNG state of its own, and the only per-step random draw is B floats.
- The returned log-prob is `log_softmax(logits / T)` of the chosen token *before* top-k/top-p/min-p
  filtering (T = 1 when greedy), as `base.Generation.logprobs` defines it.
- Filters follow the order of Hugging Face's logits processors: top-k, then top-p, then min-p, all
  on the temperature-scaled distribution; each keeps at least the most likely token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplerSettings:
    """The static part of `SamplingParams` that shapes the sampling computation."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, settings: SamplerSettings, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> tokens (B,) int64, logprobs (B,) float32. `uniforms` (B,) in [0, 1), unused if greedy."""
    logits = logits.float()
    if settings.greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        return tokens, logprobs
    if settings.temperature != 1.0:
        logits = logits / settings.temperature
    log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)  # (B, 1)
    probs = torch.exp(logits - log_normalizer)  # (B, V)
    tokens = _draw(probs, settings, uniforms)
    logprobs = logits.gather(1, tokens[:, None])[:, 0] - log_normalizer[:, 0]
    return tokens, logprobs


def _draw(probs: torch.Tensor, settings: SamplerSettings, uniforms: torch.Tensor) -> torch.Tensor:
    """Filter, then invert the CDF with one uniform per row."""
    if settings.top_k <= 0 and settings.top_p >= 1.0:
        if settings.min_p > 0:
            probs = _min_p_filter(probs, settings.min_p)
        return _invert_cdf(probs, uniforms)
    # Work on the candidates sorted by probability: top-k via topk, otherwise a full sort.
    if settings.top_k > 0:
        candidate_probs, candidate_ids = torch.topk(probs, min(settings.top_k, probs.shape[-1]), dim=-1)
    else:
        candidate_probs, candidate_ids = torch.sort(probs, dim=-1, descending=True)
    if settings.top_p < 1.0:
        # Renormalise inside the top-k set first (HF applies top-p to the top-k-filtered softmax).
        kept_mass = candidate_probs.sum(-1, keepdim=True)
        mass_before = torch.cumsum(candidate_probs, dim=-1) - candidate_probs
        candidate_probs = candidate_probs.masked_fill(mass_before >= settings.top_p * kept_mass, 0.0)
    if settings.min_p > 0:
        candidate_probs = _min_p_filter(candidate_probs, settings.min_p)
    choice = _invert_cdf(candidate_probs, uniforms)
    return candidate_ids.gather(1, choice[:, None])[:, 0]


def _min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def _invert_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i]; zero-weight entries can never be chosen."""
    cdf = torch.cumsum(weights, dim=-1)  # (B, V)
    target = uniforms[:, None] * cdf[:, -1:]
    index = (cdf <= target).sum(dim=-1)
    return index.clamp_(max=weights.shape[-1] - 1)
