"""The tensor math of RL post-training: advantage estimators, PPO losses, KL and entropy.

Every function takes tensors and plain numbers (no models, no config objects), so each is tested
against hand-computed values and the trainer picks variants by dict lookup.

Conventions: B = sequences, T = response-token positions. `mask (B, T)` is 1.0 on real response
tokens and 0.0 on padding; masked positions never contribute to a loss, mean or return, but must
hold finite values. `scores (B,)` are outcome rewards per sequence, ordered group-major: the
`group_size` samples of prompt 0, then those of prompt 1, and so on.

Choices:
- Standard deviations (GRPO's group std, whitening) use Bessel's correction, as `torch.std` does,
  to match verl and TRL so learning curves compare across libraries.
- Masked positions are transparent to the backward recursions (return-to-go, GAE): they neither
  receive a value nor break the chain, so a mask with holes (tool output inside a response)
  discounts over the policy's own tokens only.
- Advantages are computed under `no_grad`: they are targets, never differentiated.
- `approx_kl` in `policy_loss` is Schulman's k3 estimate of KL(old || new) on the sampled tokens:
  unbiased for samples from the old policy and never negative.
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` where `mask` is 1; 0 where nothing is valid, so an empty batch gives no NaN."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Shift and scale `x` to mean 0, std 1 over valid positions (Bessel-corrected); padding -> 0.

    Whitening keeps the policy-gradient scale independent of the reward scale.
    """
    mean = masked_mean(x, mask)
    num_valid = mask.sum()
    variance = (((x - mean) ** 2) * mask).sum() / (num_valid - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(variance + eps) * mask


# ---------------------------------------------------------------------------------------------
# Advantage estimators; each returns (advantages (B, T), returns (B, T)), zero on padding
# ---------------------------------------------------------------------------------------------


def _grouped(scores: Tensor, group_size: int) -> Tensor:
    """(B,) -> (B / group_size, group_size), checking the batch is whole groups."""
    if group_size < 1 or scores.numel() % group_size != 0:
        raise ValueError(
            f"{scores.numel()} scores cannot be split into groups of {group_size}; the batch must hold "
            "num_samples_per_prompt samples of each prompt, ordered prompt by prompt."
        )
    return scores.reshape(-1, group_size)


def uniform_groups(scores: Tensor, group_size: int) -> Tensor:
    """(B,) bool: True for samples whose group scored all alike. Their group-relative advantages are 0,
    so they teach nothing, yet they count in a token-mean loss's denominator (DAPO's dynamic sampling
    removes them)."""
    grouped = _grouped(scores, group_size)
    return (grouped.amax(dim=-1) == grouped.amin(dim=-1)).repeat_interleave(group_size)


def policy_loss_mask(mask: Tensor, truncated: Tensor, scores: Tensor, group_size: int, mask_truncated: bool,
                     drop_uniform_groups: bool) -> Tensor | None:
    """The tokens the policy loss counts (B, T), or None for all of `mask`: without the responses cut at
    the length limit (`mask_truncated`) and without groups that scored alike (`drop_uniform_groups`).
    Both still count in their group's baseline, which is computed before."""
    if not (mask_truncated or drop_uniform_groups):
        return None
    keep = torch.ones_like(truncated, dtype=torch.bool)
    if mask_truncated:
        keep &= ~truncated.bool()
    if drop_uniform_groups:
        keep &= ~uniform_groups(scores, group_size).to(keep.device)
    return mask * keep.to(mask.dtype)[:, None]


def outcome_to_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's score (B,) on its last valid token -> (B, T); the rest is 0.

    The outcome is only known once the response ends, so that is where the reward arrives.
    """
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = (positions * (mask > 0)).argmax(dim=-1)  # (B,)
    rewards = torch.zeros_like(mask, dtype=scores.dtype)
    rewards.scatter_(1, last.unsqueeze(1), scores.unsqueeze(1))
    return rewards * mask  # a sequence with no valid token gets nothing


@torch.no_grad()
def grpo_advantages(
    scores: Tensor, mask: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """GRPO: each score minus its group's mean, divided by the group's std (Bessel-corrected).

    `normalize_std=False` is Dr.GRPO, which drops the std because it up-weights prompts that are
    nearly always solved or failed. A group of equal scores gets advantage 0.
    """
    grouped = _grouped(scores, group_size)  # (num_groups, group_size)
    centred = grouped - grouped.mean(dim=-1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=-1, keepdim=True) + eps)
    advantages = centred.reshape(-1, 1) * mask  # (B, T)
    return advantages, advantages


@torch.no_grad()
def rloo_advantages(scores: Tensor, mask: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """RLOO: each score minus the mean of the *other* samples of its prompt.

    Leaving the sample out keeps the baseline independent of the action, so the gradient stays
    unbiased; it equals group_size / (group_size - 1) times the group-centred score.
    """
    grouped = _grouped(scores, group_size)  # (num_groups, group_size)
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt (rollout.num_samples_per_prompt >= 2).")
    baseline = (grouped.sum(dim=-1, keepdim=True) - grouped) / (group_size - 1)
    advantages = (grouped - baseline).reshape(-1, 1) * mask  # (B, T)
    return advantages, advantages


@torch.no_grad()
def remax_advantages(scores: Tensor, baseline_scores: Tensor, mask: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): each score minus the score of the greedy response to
    the same prompt. `scores (B,)` group-major, `baseline_scores (B / group_size,)` one per prompt.

    The greedy response is a baseline that does not depend on the sampled action, so the gradient
    stays unbiased, and one sample per prompt suffices (group_size may be 1).
    """
    grouped = _grouped(scores, group_size)  # (num_groups, group_size)
    if baseline_scores.shape != (grouped.shape[0],):
        raise ValueError(f"ReMax needs one greedy baseline score per prompt: {grouped.shape[0]} prompts, "
                         f"got baseline scores of shape {tuple(baseline_scores.shape)}.")
    advantages = (grouped - baseline_scores.to(grouped)[:, None]).reshape(-1, 1) * mask  # (B, T)
    return advantages, advantages


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go G_t = r_t + gamma * G_{t+1} over valid tokens (B, T); padding -> 0."""
    returns = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(token_rewards.shape[0])  # (B,)
    for t in reversed(range(token_rewards.shape[1])):
        valid = mask[:, t]
        running = valid * (token_rewards[:, t] + gamma * running) + (1 - valid) * running
        returns[:, t] = running * valid
    return returns


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): returns are the discounted return-to-go, advantages those
    returns whitened over all valid tokens of the batch.

    The batch-wide whitening replaces a critic's baseline; it is not per prompt, which the paper
    argues is less prone to overfitting easy prompts than GRPO's group normalisation.
    """
    returns = discounted_returns(token_rewards, mask, gamma)  # (B, T)
    return masked_whiten(returns, mask), returns


@torch.no_grad()
def reinforce_pp_baseline_advantages(scores: Tensor, mask: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline: subtract the group mean, then whiten over batch tokens.

    The group mean removes per-prompt difficulty; the batch-wide (not per-group) std keeps the
    scale stable when a group's scores are nearly equal.
    """
    grouped = _grouped(scores, group_size)
    centred = (grouped - grouped.mean(dim=-1, keepdim=True)).reshape(-1, 1)  # (B, 1)
    advantages = masked_whiten(centred * mask, mask)
    return advantages, advantages


@torch.no_grad()
def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE(gamma, lambda) with a critic; the value after the last valid token is 0 (episode ends).

    returns = raw advantages + values are the critic's targets; the advantages handed to the
    policy are whitened over valid tokens so the update's scale does not track the reward's.
    """
    raw = torch.zeros_like(token_rewards)  # (B, T)
    next_value = token_rewards.new_zeros(token_rewards.shape[0])  # (B,)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(token_rewards.shape[1])):
        valid = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        raw[:, t] = advantage * valid
        next_value = valid * values[:, t] + (1 - valid) * next_value
        next_advantage = valid * advantage + (1 - valid) * next_advantage
    returns = (raw + values) * mask
    return masked_whiten(raw, mask), returns


class AdvantageEstimator(Protocol):
    """The one signature of `ADVANTAGE_ESTIMATORS`; each estimator reads the arguments it needs.

    `scores (B,)` are outcome rewards; `token_rewards (B, T)` are those scores on the last token
    minus any in-reward KL penalty; `values (B, T)` come from the critic (None without one);
    `baseline_scores (B,)` are the scores of the greedy response to each row's prompt (ReMax; None otherwise).
    """

    def __call__(
        self, *, scores: Tensor, token_rewards: Tensor, values: Tensor | None, mask: Tensor,
        group_size: int, gamma: float, lam: float, normalize_std: bool, baseline_scores: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]: ...


def _grpo(*, scores, token_rewards, values, mask, group_size, gamma, lam, normalize_std,
          baseline_scores=None):
    return grpo_advantages(scores, mask, group_size, normalize_std=normalize_std)


def _dr_grpo(*, scores, token_rewards, values, mask, group_size, gamma, lam, normalize_std,
             baseline_scores=None):
    return grpo_advantages(scores, mask, group_size, normalize_std=False)


def _rloo(*, scores, token_rewards, values, mask, group_size, gamma, lam, normalize_std,
          baseline_scores=None):
    return rloo_advantages(scores, mask, group_size)


def _reinforce_pp(*, scores, token_rewards, values, mask, group_size, gamma, lam, normalize_std,
                  baseline_scores=None):
    return reinforce_pp_advantages(token_rewards, mask, gamma)


def _reinforce_pp_baseline(*, scores, token_rewards, values, mask, group_size, gamma, lam, normalize_std,
                           baseline_scores=None):
    return reinforce_pp_baseline_advantages(scores, mask, group_size)


def _ppo(*, scores, token_rewards, values, mask, group_size, gamma, lam, normalize_std,
         baseline_scores=None):
    if values is None:
        raise ValueError("algorithm.name='ppo' needs critic values; configure a critic or pick a critic-free estimator.")
    return gae_advantages(token_rewards, values, mask, gamma, lam)


def _remax(*, scores, token_rewards, values, mask, group_size, gamma, lam, normalize_std, baseline_scores=None):
    if baseline_scores is None:
        raise ValueError("algorithm.name='remax' needs the greedy responses' scores (the trainer's greedy rollout).")
    return remax_advantages(scores, baseline_scores[::group_size], mask, group_size)  # rows are group-major


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
    "ppo": _ppo,
    "remax": _remax,
}
"""Config name (`algorithm.name`) -> estimator; call with keywords only."""

# ---------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------
# Each mode divides a sum by a normaliser. By default the normaliser comes from the tensor at hand;
# passing the normaliser of the whole mini-batch makes the sum of micro-batch losses (and of their
# gradients) equal to the loss of the mini-batch in one piece, however unevenly it was split.

Normalizer = float | Tensor | None


def _token_mean(loss: Tensor, mask: Tensor, num_tokens: Normalizer, num_sequences: Normalizer,
                max_length: int | None) -> Tensor:
    return (loss * mask).sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)


def _seq_mean_token_mean(loss: Tensor, mask: Tensor, num_tokens: Normalizer, num_sequences: Normalizer,
                         max_length: int | None) -> Tensor:
    per_sequence = masked_mean(loss, mask, dim=-1)  # (B,)
    return per_sequence.sum() / (loss.shape[0] if num_sequences is None else num_sequences)


def _seq_mean_token_sum(loss: Tensor, mask: Tensor, num_tokens: Normalizer, num_sequences: Normalizer,
                        max_length: int | None) -> Tensor:
    per_sequence = (loss * mask).sum(dim=-1)  # (B,)
    return per_sequence.sum() / (loss.shape[0] if num_sequences is None else num_sequences)


def _seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, num_tokens: Normalizer, num_sequences: Normalizer,
                             max_length: int | None) -> Tensor:
    per_sequence = (loss * mask).sum(dim=-1) / (loss.shape[-1] if max_length is None else max_length)  # (B,)
    return per_sequence.sum() / (loss.shape[0] if num_sequences is None else num_sequences)


_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate_loss(
    loss: Tensor, mask: Tensor, mode: str, num_tokens: Normalizer = None,
    num_sequences: Normalizer = None, max_length: int | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    - "token-mean": sum over valid tokens / `num_tokens` (default: valid tokens here). Long
      responses weigh more, per token equally (DAPO).
    - "seq-mean-token-mean": mean over each sequence's tokens, then sum / `num_sequences`
      (default: B here). Each response weighs the same (original GRPO).
    - "seq-mean-token-sum": sum over each sequence's tokens, then sum / `num_sequences`: no division
      by any length, so a sequence's weight grows with its length (verl's "seq-mean-token-sum").
    - "seq-mean-token-sum-norm": sum over each sequence's tokens / `max_length` (a constant;
      default T here), then sum / `num_sequences`. Dr.GRPO's fix of the length bias; pass the
      rollout's max response length so the constant does not change with padding.

    For gradient accumulation pass the mini-batch's totals (valid tokens, sequences) to every
    micro-batch: the micro-batch losses then sum to the mini-batch loss.
    """
    if mode not in _AGGREGATIONS:
        raise ValueError(f"Unknown loss aggregation {mode!r}; allowed: {', '.join(_AGGREGATIONS)}.")
    return _AGGREGATIONS[mode](loss, mask, num_tokens, num_sequences, max_length)


# ---------------------------------------------------------------------------------------------
# Losses, KL, entropy
# ---------------------------------------------------------------------------------------------

_KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda log_ratio: log_ratio,
    "k2": lambda log_ratio: 0.5 * log_ratio**2,
    "k3": lambda log_ratio: torch.exp(-log_ratio) + log_ratio - 1,
    "abs": lambda log_ratio: log_ratio.abs(),
}


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimate (B, T) of KL(policy || reference) from tokens sampled by the policy.

    k1 = logp - ref (unbiased, can be negative), k2 = 0.5 * (logp - ref)^2 (biased, low variance),
    k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, never negative; Schulman 2020),
    abs = |logp - ref| (never negative; its gradient pushes every token's log-ratio towards 0 at the same rate).
    """
    if estimator not in _KL_ESTIMATORS:
        raise ValueError(f"Unknown KL estimator {estimator!r}; allowed: {', '.join(_KL_ESTIMATORS)}.")
    return _KL_ESTIMATORS[estimator](logp - ref_logp)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy (...) of softmax(logits (..., V)) as logsumexp(z) - sum(p * z): no log of tiny p.

    Logits must be finite (raw model outputs, not top-k filtered with -inf).
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


# Each policy-loss variant maps (log_ratio (B, T), logp, advantages, mask, settings) to a per-token loss
# (B, T) and its metrics; `policy_loss` wraps them with the ratio level, the rollout corrections and the
# aggregation. `log_ratio` is log(pi / pi_old), per token or (GSPO) the sequence's mean on every token.


def ppo_surrogate(log_ratio: Tensor, logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                  clip_high: float, dual_clip: float | None = None, **_) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), per token (B, T).

    The ratio is clipped to [1 - clip_low, 1 + clip_high]; a larger `clip_high` is DAPO's
    clip-higher, which leaves room to raise unlikely tokens and slows entropy collapse. With
    `dual_clip = c > 1`, tokens with negative advantage have their loss capped at -c * A (Ye et
    al. 2020), so a huge ratio on a bad token cannot blow up the update. Clipped tokens get no gradient.
    """
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)  # pessimistic bound
    dual_clipped = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
    return loss, {"clipfrac": masked_mean((loss != unclipped).to(mask.dtype), mask).detach(),
                  "dual_clipfrac": masked_mean(dual_clipped.to(mask.dtype), mask).detach()}


def cispo_surrogate(log_ratio: Tensor, logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                    clip_high: float, **_) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi, per token.

    The importance weight is clipped and detached instead of the update: every token keeps a gradient
    (A * clipped weight * grad log pi), so rare tokens whose ratio leaves the band (often the "forking"
    tokens of a reasoning chain) are not dropped as PPO drops them. Written as the weight times
    exp(logp - sg(logp)), which is 1 in value and has grad log pi, so the loss reads -weight * A.
    The paper bounds the weight above only; clip_low close to 1 (e.g. 0.99) does the same.
    """
    weight = torch.exp(log_ratio).detach()
    clipped_weight = torch.clamp(weight, 1 - clip_low, 1 + clip_high)
    loss = -advantages * clipped_weight * torch.exp(logp - logp.detach())
    return loss, {"clipfrac": masked_mean((clipped_weight != weight).to(mask.dtype), mask).detach()}


def gmpo_surrogate(log_ratio: Tensor, logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                   clip_high: float, **_) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): PPO's objective on the geometric mean of a sequence's
    token ratios, -A_i * exp(mean_t clipped log r_t), the clip taken per token in log space.

    Each token's log-ratio is clipped pessimistically for the sign of the sequence's advantage (to at
    most log(1 + clip_high) when A > 0, at least log(1 - clip_low) when A < 0), then averaged over the
    sequence's tokens. The geometric mean is far less swayed by one extreme token than GRPO's
    arithmetic mean, so wider bounds are stable (the paper uses e^-0.4 .. e^0.4: clip_low 0.33,
    clip_high 0.49). The sequence's loss is placed on each of its tokens; "seq-mean-token-mean"
    aggregation gives the paper's per-sequence mean.
    """
    sequence_advantage = masked_mean(advantages, mask, dim=1)[:, None]  # (B, 1)
    bounded = torch.clamp(log_ratio, math.log(1 - clip_low), math.log1p(clip_high))
    clipped_log_ratio = torch.where(sequence_advantage > 0, torch.minimum(log_ratio, bounded),
                                    torch.maximum(log_ratio, bounded))  # (B, T)
    sequence_ratio = torch.exp(masked_mean(clipped_log_ratio, mask, dim=1))[:, None]  # (B, 1)
    loss = (-sequence_advantage * sequence_ratio).expand_as(logp)
    clipped = (clipped_log_ratio != log_ratio) & (sequence_advantage != 0)
    return loss, {"clipfrac": masked_mean(clipped.to(mask.dtype), mask).detach()}


def sapo_surrogate(log_ratio: Tensor, logp: Tensor, advantages: Tensor, mask: Tensor,
                   sapo_temperatures: tuple[float, float] = (1.0, 1.05), **_) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): -A * (4 / tau) * sigmoid(tau * (r - 1)), per token.

    A smooth gate instead of the hard clip: the gradient weight 4 * s * (1 - s), s = sigmoid(tau * (r - 1)),
    is 1 at r = 1 (PPO's on-policy gradient) and decays smoothly as r leaves 1, so off-policy tokens are
    attenuated, not cut. `sapo_temperatures = (tau_pos, tau_neg)` for positive / other advantages; the
    larger tau_neg (paper: 1.0 and 1.05) damps negative updates faster, which the paper finds stabler.
    Metric `clipfrac`: tokens whose gradient weight fell below one half.
    """
    tau_positive, tau_negative = sapo_temperatures
    tau = torch.where(advantages > 0, tau_positive, tau_negative).to(log_ratio.dtype)  # (B, T)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1))
    loss = -advantages * gate * 4 / tau
    attenuated = 4 * gate * (1 - gate) < 0.5
    return loss, {"clipfrac": masked_mean(attenuated.detach().to(mask.dtype), mask).detach()}


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "ppo": ppo_surrogate,
    "cispo": cispo_surrogate,
    "gmpo": gmpo_surrogate,
    "sapo": sapo_surrogate,
}
"""Config name (`algorithm.policy_loss`) -> per-token surrogate."""


def sequence_mismatch_mask(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """(B,) bool: True for sequences to keep, whose geometric-mean ratio pi_old / pi_sampler over their valid
    tokens lies in [1 / threshold, threshold] (sequence-level masked importance sampling, MIS; Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", and verl's geo_mask). A
    sequence the sampler drew with log-probs far from the trainer's is a sample of another policy: it is
    dropped whole rather than reweighted token by token."""
    log_ratio = masked_mean(old_logp.detach() - sampler_logp, mask, dim=1)  # (B,)
    return log_ratio.abs() <= math.log(threshold)


def policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float,
    dual_clip: float | None = None, aggregation: str = "token-mean", num_tokens: Normalizer = None,
    num_sequences: Normalizer = None, max_length: int | None = None, ratio_level: str = "token",
    sampler_logp: Tensor | None = None, correction_cap: float | None = None, loss_type: str = "ppo",
    sapo_temperatures: tuple[float, float] = (1.0, 1.05), sequence_mask_threshold: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss on (B, T) inputs; returns (scalar loss, detached metrics).

    `loss_type` picks the surrogate in `POLICY_LOSSES` (default PPO's clipped surrogate; see each
    function). `ratio_level="sequence"` is GSPO (Zheng et al. 2025): every token of a sequence uses
    the sequence's ratio, exp of the mean log-ratio over its tokens, so one odd token cannot swing
    the clipping of the others. Two corrections for the rollout engine's numerical mismatch, since the
    tokens were drawn by the sampler, not by the trainer's pi_old, both needing `sampler_logp`:
    `correction_cap` is truncated importance sampling, each token's loss weighted by
    min(pi_old / pi_sampler, cap), detached; `sequence_mask_threshold` zeroes the loss of whole
    sequences that `sequence_mismatch_mask` rejects (they still count in the normaliser, as a weight of
    0 would). Metrics: `clipfrac` (valid tokens the surrogate's clip or gate changed), `dual_clipfrac`
    (PPO), `approx_kl` (k3 of KL(old || new)); with the corrections `rollout_correction_weight` (mean
    weight), `rollout_correction_capped` (fraction of tokens capped), `rollout_correction_masked` (fraction
    of sequences with tokens that were masked).
    """
    if loss_type not in POLICY_LOSSES:
        raise ValueError(f"Unknown policy loss {loss_type!r}; allowed: {', '.join(POLICY_LOSSES)}.")
    log_ratio = logp - old_logp  # (B, T)
    if ratio_level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=1)[:, None].expand_as(logp)
    loss, metrics = POLICY_LOSSES[loss_type](log_ratio, logp, advantages, mask, clip_low=clip_low,
                                             clip_high=clip_high, dual_clip=dual_clip,
                                             sapo_temperatures=sapo_temperatures)
    metrics["approx_kl"] = masked_mean(kl_penalty(old_logp, logp, "k3"), mask).detach()
    if correction_cap is not None:
        weight = torch.exp(old_logp.detach() - sampler_logp)
        metrics["rollout_correction_capped"] = masked_mean((weight > correction_cap).to(mask.dtype), mask).detach()
        weight = weight.clamp(max=correction_cap)
        metrics["rollout_correction_weight"] = masked_mean(weight, mask).detach()
        loss = loss * weight
    if sequence_mask_threshold is not None:
        keep = sequence_mismatch_mask(old_logp, sampler_logp, mask, sequence_mask_threshold)  # (B,)
        has_tokens = (mask.sum(dim=1) > 0).to(mask.dtype)
        metrics["rollout_correction_masked"] = masked_mean((~keep).to(mask.dtype), has_tokens).detach()
        loss = loss * keep.to(loss.dtype)[:, None]
    return aggregate_loss(loss, mask, aggregation, num_tokens, num_sequences, max_length), metrics


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range: float,
    aggregation: str = "token-mean", num_tokens: Normalizer = None, num_sequences: Normalizer = None,
    max_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss 0.5 * max((v - R)^2, (clip(v, old ± c) - R)^2) on (B, T) inputs.

    Taking the larger error keeps the critic from moving far from its rollout-time values in one
    update, as PPO does for the policy. Metric `value_clipfrac`: tokens where the clipped error won.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(error, clipped_error)  # (B, T)
    metrics = {"value_clipfrac": masked_mean((clipped_error > error).to(mask.dtype), mask).detach()}
    return aggregate_loss(loss, mask, aggregation, num_tokens, num_sequences, max_length), metrics
