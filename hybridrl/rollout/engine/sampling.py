"""Token sampling on device, with no host synchronisation (safe inside a CUDA graph).

Choices:
- Randomness comes in as one uniform number per row (`uniforms`, drawn by the caller from a seeded
  `torch.Generator`; the engine draws a table of them per sequence at admission, one per response
  position), and a token is drawn by inverting the CDF of the filtered distribution. The graph then
  holds no RNG state of its own and launches no random draw.
- At large batch every pass over the (B, V) logits costs about as much as a layer's matmuls, so the
  common case (no top-k/top-p/min-p) inverts the CDF in two steps (blocks of ~sqrt(V), then inside
  one block) from per-block maxima and sums, with no full-vocabulary cumsum and, once compiled (the
  engine compiles it with its per-step bookkeeping, `decode_state.sample_and_record`), a single read of the logits. Filtered sampling keeps an eager path over
  unnormalised weights (sorts are needed for top-k/top-p anyway).
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
    if settings.greedy:
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        logprobs = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        return tokens, logprobs
    if settings.top_k <= 0 and settings.top_p >= 1.0 and settings.min_p <= 0:
        return _sample_blocked(logits, settings.temperature, uniforms)
    logits = logits.to(torch.float32, copy=True)  # a private copy: the ops below work in place
    if settings.temperature != 1.0:
        logits.div_(settings.temperature)
    # Unnormalised probabilities, in place (each pass over (B, V) costs as much as a layer's matmuls
    # at large batch): weights = exp(x - max); log p(token) = log(weight) - log(sum of weights).
    weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()  # (B, V)
    log_total = torch.log(weights.sum(-1))
    if settings.top_k <= 0 and settings.top_p >= 1.0:
        sampled = _min_p_filter(weights, settings.min_p)
        tokens = _invert_cdf_blocked(sampled, _block_sums(sampled), uniforms)
    else:
        tokens = _draw_sorted(weights, settings, uniforms)
    logprobs = torch.log(weights.gather(1, tokens[:, None])[:, 0]) - log_total
    return tokens, logprobs


def _sample_blocked(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The common case (no top-k/top-p/min-p) in one pass over the logits: each block of ~sqrt(V)
    entries gets its own max and its sum of exp(x - block max); rescaled to the global max these are
    the block masses, whose CDF picks a block; only that block's exponentials are formed again to
    pick the token. Compiled, the (B, V) pass is one kernel that reads the bf16 logits once."""
    batch, vocab = logits.shape
    size = _block_size(vocab)
    scaled = logits.float().view(batch, -1, size) / temperature  # (B, num_blocks, size)
    block_max = scaled.amax(-1)  # (B, num_blocks)
    block_sums = torch.exp(scaled - block_max[..., None]).sum(-1)
    row_max = block_max.amax(-1, keepdim=True)  # (B, 1)
    block_sums = block_sums * torch.exp(block_max - row_max)  # masses relative to exp(row_max)
    log_total = torch.log(block_sums.sum(-1))
    block_cdf = torch.cumsum(block_sums, dim=-1)
    target = uniforms[:, None] * block_cdf[:, -1:]
    block = (block_cdf <= target).sum(-1).clamp_(max=block_cdf.shape[-1] - 1)  # (B,)
    mass_before = block_cdf.gather(1, block[:, None]) - block_sums.gather(1, block[:, None])  # (B, 1)
    inside = torch.exp(scaled.gather(1, block[:, None, None].expand(batch, 1, size))[:, 0] - row_max)  # (B, size)
    offset = _offset_inside_block(inside, target - mass_before)
    tokens = block * size + offset
    logprobs = scaled.view(batch, vocab).gather(1, tokens[:, None])[:, 0] - row_max[:, 0] - log_total
    return tokens, logprobs


def _block_size(vocab: int) -> int:
    """A divisor of the vocabulary near sqrt(V), so the CDF is inverted in two small steps."""
    target = int(vocab**0.5)
    for size in range(target, 0, -1):
        if vocab % size == 0 and size >= target // 4:
            return size
    return vocab  # no useful divisor: a single block, i.e. a plain cumsum


def _block_sums(weights: torch.Tensor) -> torch.Tensor:
    size = _block_size(weights.shape[-1])
    return weights.view(weights.shape[0], -1, size).sum(-1)


def _invert_cdf_blocked(weights: torch.Tensor, block_sums: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Pick a block by its mass, then a token inside it: the full-vocabulary cumsum is never formed."""
    batch, vocab = weights.shape
    size = _block_size(vocab)
    block_cdf = torch.cumsum(block_sums, dim=-1)  # (B, num_blocks)
    target = uniforms[:, None] * block_cdf[:, -1:]
    block = (block_cdf <= target).sum(-1).clamp_(max=block_cdf.shape[-1] - 1)  # (B,)
    mass_before = block_cdf.gather(1, block[:, None]) - block_sums.gather(1, block[:, None])  # (B, 1)
    inside = weights.view(batch, -1, size).gather(1, block[:, None, None].expand(batch, 1, size))[:, 0]
    return block * size + _offset_inside_block(inside, target - mass_before)


def _offset_inside_block(inside: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """inside (B, size) weights of the chosen block, target (B, 1) mass into it -> offset (B,)."""
    size = inside.shape[-1]
    inside_cdf = torch.cumsum(inside, dim=-1)  # (B, size)
    offset = (inside_cdf <= target).sum(-1)
    # Rounding can put the target past the block's own total; fall back to its last positive entry.
    positive = (inside > 0).int()
    first_positive = torch.argmax(positive, dim=-1)
    last_positive = size - 1 - torch.argmax(positive.flip(-1), dim=-1)
    return torch.minimum(torch.maximum(offset, first_positive), last_positive)


def _draw_sorted(probs: torch.Tensor, settings: SamplerSettings, uniforms: torch.Tensor) -> torch.Tensor:
    """top-k and/or top-p (then min-p) on candidates sorted by probability; invert their CDF."""
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
