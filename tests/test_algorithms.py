"""hybridrl.algorithms against values worked out by hand (float64, explicit tensors)."""

import math
import typing

import pytest
import torch

from hybridrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    aggregate_loss,
    discounted_returns,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    masked_whiten,
    outcome_to_token_rewards,
    policy_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    value_loss,
)
from hybridrl.config.schema import AlgorithmConfig

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, t(expected) if not isinstance(expected, torch.Tensor) else expected,
                               atol=atol, rtol=0)


# --- masked statistics -----------------------------------------------------------------------


def test_masked_mean_ignores_padding_and_handles_empty():
    x, mask = t([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]]), t([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 3.0)  # (1 + 3 + 5) / 3
    close(masked_mean(x, mask, dim=-1), [2.0, 5.0])
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_whiten_uses_bessel_corrected_std():
    # [1, 2, 3, 4]: mean 2.5, variance (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3.
    x, mask = t([[1.0, 2.0, 100.0], [3.0, 4.0, -100.0]]), t([[1, 1, 0], [1, 1, 0]])
    s = math.sqrt(5 / 3)
    close(masked_whiten(x, mask), [[-1.5 / s, -0.5 / s, 0.0], [0.5 / s, 1.5 / s, 0.0]])


# --- advantages ------------------------------------------------------------------------------


def test_outcome_to_token_rewards_puts_score_on_last_valid_token():
    scores = t([2.0, 3.0, 4.0, 5.0])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])
    close(outcome_to_token_rewards(scores, mask), [[0, 2, 0], [0, 0, 3], [4, 0, 0], [0, 0, 0]])


def test_grpo_and_dr_grpo():
    # Groups [1, 0] and [1, 1]: centred [0.5, -0.5] and [0, 0]; std of [1, 0] with Bessel = sqrt(0.5).
    scores, mask = t([1.0, 0.0, 1.0, 1.0]), t([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv, returns = grpo_advantages(scores, mask, group_size=2)
    r = 0.5 / math.sqrt(0.5)  # 0.7071
    close(adv, [[r, r], [-r, 0], [0, 0], [0, 0]], atol=1e-5)
    close(returns, adv)
    adv, _ = grpo_advantages(scores, mask, group_size=2, normalize_std=False)
    close(adv, [[0.5, 0.5], [-0.5, 0], [0, 0], [0, 0]])


def test_group_size_must_divide_batch():
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(t([1.0, 0.0, 1.0, 1.0]), torch.ones(4, 2, dtype=F64), group_size=3)


def test_rloo_leave_one_out_baseline():
    # Group [1, 0, 0]: baselines [0, .5, .5]. Group [2, 2, 5]: baselines [3.5, 3.5, 2].
    scores, mask = t([1.0, 0.0, 0.0, 2.0, 2.0, 5.0]), torch.ones(6, 2, dtype=F64)
    mask[0, 1] = 0
    adv, returns = rloo_advantages(scores, mask, group_size=3)
    close(adv[:, 0], [1.0, -0.5, -0.5, -1.5, -1.5, 3.0])
    close(adv[0, 1], 0.0)
    close(returns, adv)


def test_discounted_returns_skip_masked_positions():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0], [1.0, 9.0, 1.0]])
    mask = t([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    # gamma 0.5. Row 2: the hole at t=1 is skipped, so G_0 = 1 + 0.5 * 1 = 1.5.
    close(discounted_returns(rewards, mask, 0.5), [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0], [1.5, 0.0, 1.0]])


def test_reinforce_pp_whitens_returns_over_batch_tokens():
    rewards, mask = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]), t([[1, 1, 1], [1, 1, 0]])
    # Returns (gamma 0.5): [.25, .5, 1], [1, 2]; mean .95, deviations [-.7, -.45, .05, .05, 1.05],
    # Bessel variance 1.8 / 4 = .45.
    s = math.sqrt(0.45)
    adv, returns = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    close(adv, [[-0.7 / s, -0.45 / s, 0.05 / s], [0.05 / s, 1.05 / s, 0.0]])
    close(returns, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])  # the return-to-go itself, not whitened


def test_reinforce_pp_baseline_centres_per_group_then_whitens_over_batch():
    # Centred [.5, -.5, 0, 0] on 2 tokens each: 8 tokens, mean 0, variance 4 * .25 / 7 = 1/7.
    scores, mask = t([1.0, 0.0, 1.0, 1.0]), t([[1, 1, 0]] * 4)
    adv, _ = reinforce_pp_baseline_advantages(scores, mask, group_size=2)
    a = 0.5 * math.sqrt(7)
    close(adv, [[a, a, 0], [-a, -a, 0], [0, 0, 0], [0, 0, 0]])


def test_gae_three_steps_by_hand():
    # gamma .9, lam .8, rewards [0, 0, 1], values [.5, .6, .7]:
    # t=2: delta = 1 - .7 = .3 -> A = .3
    # t=1: delta = .9 * .7 - .6 = .03 -> A = .03 + .72 * .3 = .246
    # t=0: delta = .9 * .6 - .5 = .04 -> A = .04 + .72 * .246 = .21712
    # Row 1 ends after one token: A = 1 - .4 = .6 (values on padding are ignored).
    # Row 2 has a hole at t=1, which is skipped: t=2 as row 0 (A = .3); t=0: delta = .9 * .7 - .5
    # = .13 -> A = .13 + .72 * .3 = .346.
    rewards = t([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 5.0, 1.0]])
    values = t([[0.5, 0.6, 0.7], [0.4, 9.0, 9.0], [0.5, 9.0, 0.7]])
    mask = t([[1, 1, 1], [1, 0, 0], [1, 0, 1]])
    adv, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(returns, [[0.71712, 0.846, 1.0], [1.0, 0.0, 0.0], [0.846, 0.0, 1.0]])
    raw = t([0.21712, 0.246, 0.3, 0.6, 0.346, 0.3])  # the valid tokens, whitened together
    mean = raw.sum() / 6
    std = torch.sqrt(((raw - mean) ** 2).sum() / 5)
    w = ((raw - mean) / std).tolist()
    close(adv, [[w[0], w[1], w[2]], [w[3], 0.0, 0.0], [w[4], 0.0, w[5]]], atol=1e-5)


def test_advantage_estimators_match_config_names_and_functions():
    assert set(ADVANTAGE_ESTIMATORS) == set(typing.get_args(typing.get_type_hints(AlgorithmConfig)["name"]))
    scores, mask = t([1.0, 0.0, 1.0, 1.0]), t([[1, 1], [1, 0], [1, 1], [1, 1]])
    values = t([[0.1, 0.2], [0.3, 0.0], [0.5, 0.6], [0.7, 0.8]])
    token_rewards = outcome_to_token_rewards(scores, mask)
    kwargs = dict(scores=scores, token_rewards=token_rewards, values=values, mask=mask, group_size=2,
                  gamma=0.9, lam=0.8, normalize_std=True, baseline_scores=t([0.5, 0.5, 1.0, 1.0]))
    expected = {
        "grpo": grpo_advantages(scores, mask, 2),
        "dr_grpo": grpo_advantages(scores, mask, 2, normalize_std=False),
        "rloo": rloo_advantages(scores, mask, 2),
        "reinforce_pp": reinforce_pp_advantages(token_rewards, mask, 0.9),
        "reinforce_pp_baseline": reinforce_pp_baseline_advantages(scores, mask, 2),
        "ppo": gae_advantages(token_rewards, values, mask, 0.9, 0.8),
        "remax": remax_advantages(scores, t([0.5, 1.0]), mask, 2),  # one greedy score per prompt
    }
    for name, (adv, returns) in expected.items():
        got_adv, got_returns = ADVANTAGE_ESTIMATORS[name](**kwargs)
        close(got_adv, adv)
        close(got_returns, returns)
    with pytest.raises(ValueError, match="critic"):
        ADVANTAGE_ESTIMATORS["ppo"](**{**kwargs, "values": None})


# --- aggregation -----------------------------------------------------------------------------

LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = t([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, 2.5),  # (1 + 2 + 3 + 4) / 4
        ("token-mean", {"num_tokens": 8}, 1.25),  # 10 / 8
        ("seq-mean-token-mean", {}, 3.0),  # mean(2, 4)
        ("seq-mean-token-mean", {"num_sequences": 4}, 1.5),  # (2 + 4) / 4
        ("seq-mean-token-sum", {}, 5.0),  # (6 + 4) / 2
        ("seq-mean-token-sum", {"num_sequences": 4}, 2.5),  # (6 + 4) / 4
        ("seq-mean-token-sum-norm", {}, 10 / 6),  # (6 / 3 + 4 / 3) / 2
        ("seq-mean-token-sum-norm", {"max_length": 5}, 1.0),  # (6 / 5 + 4 / 5) / 2
    ],
)
def test_aggregate_loss_modes(mode, kwargs, expected):
    close(aggregate_loss(LOSS, MASK, mode, **kwargs), expected)


def test_aggregate_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(LOSS, MASK, "sum")


# --- policy loss -----------------------------------------------------------------------------

# Ratios and advantages of five valid tokens and one padding token; clip_low .2, clip_high .28:
#   A=+1 r=1.1 -> -1.1 (inside);       A=+1 r=1.5 -> -1.28 (clipped)
#   A=-1 r=0.5 -> max(.5, .8) = .8 (clipped); A=-1 r=1.5 -> max(1.5, 1.28) = 1.5 (not clipped)
#   A=+2 r=0.5 -> max(-1, -1.6) = -1 (not clipped)
RATIOS = t([[1.1, 1.5, 0.5], [1.5, 0.5, 50.0]])
ADVANTAGES = t([[1.0, 1.0, -1.0], [-1.0, 2.0, 5.0]])
PPO_MASK = t([[1, 1, 1], [1, 1, 0]])


def test_policy_loss_clip_higher_values_and_metrics():
    logp = torch.log(RATIOS).requires_grad_()
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), ADVANTAGES, PPO_MASK, clip_low=0.2, clip_high=0.28)
    close(loss.detach(), (-1.1 - 1.28 + 0.8 + 1.5 - 1.0) / 5)
    close(metrics["clipfrac"], 0.4)
    close(metrics["dual_clipfrac"], 0.0)
    # k3 of KL(old || new) = r - 1 - log r per token.
    valid = t([1.1, 1.5, 0.5, 1.5, 0.5])
    close(metrics["approx_kl"], (valid - 1 - torch.log(valid)).mean())
    assert not metrics["clipfrac"].requires_grad


def test_policy_loss_gradient_is_zero_for_clipped_tokens():
    logp = torch.log(RATIOS).requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros_like(logp), ADVANTAGES, PPO_MASK, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # d(-A * r)/dlogp = -A * r, divided by the 5 valid tokens; clipped and padding tokens get 0.
    close(logp.grad, [[-1.1 / 5, 0.0, 0.0], [1.5 / 5, -1.0 / 5, 0.0]])


def test_policy_loss_dual_clip_caps_negative_advantages():
    # A=-1 r=5 -> max(5, 1.28) = 5, capped at 3 * 1 = 3 (dual-clipped).
    # A=-1 r=2 -> 2 < 3, unchanged.  A=+1 r=5 -> -1.28 (ordinary clip; dual clip ignores A > 0).
    logp = torch.log(t([[5.0, 2.0, 5.0]])).requires_grad_()
    advantages, mask = t([[-1.0, -1.0, 1.0]]), t([[1, 1, 1]])
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), advantages, mask, 0.2, 0.28, dual_clip=3.0)
    close(loss.detach(), (3.0 + 2.0 - 1.28) / 3)
    close(metrics["clipfrac"], 2 / 3)
    close(metrics["dual_clipfrac"], 1 / 3)
    loss.backward()
    close(logp.grad, [[0.0, 2.0 / 3, 0.0]])  # only the unclipped token: -A * r / 3


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_accumulation_equals_whole_batch(mode):
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 2]
    mask = torch.stack([(torch.arange(5) < n).to(F64) for n in lengths])  # (4, 5)
    old_logp = -torch.rand(4, 5, generator=generator, dtype=F64)
    advantages = torch.randn(4, 5, generator=generator, dtype=F64)
    start = old_logp + 0.3 * torch.randn(4, 5, generator=generator, dtype=F64)
    totals = dict(num_tokens=mask.sum(), num_sequences=4, max_length=5)

    whole = start.clone().requires_grad_()
    whole_loss, _ = policy_loss(whole, old_logp, advantages, mask, 0.2, 0.28, aggregation=mode, **totals)
    whole_loss.backward()

    parts = start.clone().requires_grad_()
    accumulated = 0.0
    for rows in (slice(0, 1), slice(1, 4)):  # uneven split; second micro-batch trimmed to its own T=3
        width = int(mask[rows].sum(-1).max())
        loss, _ = policy_loss(parts[rows, :width], old_logp[rows, :width], advantages[rows, :width],
                              mask[rows, :width], 0.2, 0.28, aggregation=mode, **totals)
        loss.backward()
        accumulated = accumulated + loss.detach()
    close(accumulated, whole_loss.detach(), atol=1e-12)
    close(parts.grad, whole.grad, atol=1e-12)
    # Without the totals the split would not match: guard that the test can fail.
    naive = sum(policy_loss(start[r], old_logp[r], advantages[r], mask[r], 0.2, 0.28, aggregation=mode)[0]
                for r in (slice(0, 1), slice(1, 4)))
    assert not torch.isclose(naive, whole_loss.detach())


# --- KL, entropy, value loss -----------------------------------------------------------------


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("k1", [1.0, -1.0, 0.0]),
        ("k2", [0.5, 0.5, 0.0]),
        ("k3", [math.exp(-1), math.e - 2, 0.0]),  # exp(ref - logp) - (ref - logp) - 1
        ("abs", [1.0, 1.0, 0.0]),  # |logp - ref|
    ],
)
def test_kl_penalty_estimators(estimator, expected):
    logp, ref_logp = t([[0.0, -1.0, -0.3]]), t([[-1.0, 0.0, -0.3]])
    close(kl_penalty(logp, ref_logp, estimator), [expected])


def test_kl_penalty_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(t([0.0]), t([0.0]), "k4")


def test_entropy_from_logits():
    logits = t([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e9, -1e9]],
                [[1000.0, 1000.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0]]])
    # Uniform over 4 -> log 4; p = [.25, .75] -> -(.25 log .25 + .75 log .75); huge logits stay finite.
    h2 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    close(entropy_from_logits(logits), [[math.log(4), h2], [math.log(2), 0.0]])


def test_value_loss_clipping():
    # clip .2, old values 0:
    #   v=.5, R=1:   clipped v=.2 -> max(.25, .64) = .64 -> .32 (clipped)
    #   v=.1, R=1:   inside       -> .81 -> .405
    #   v=-.5, R=-1: clipped -.2  -> max(.25, .64) -> .32 (clipped)
    #   v=.5, R=.1:  clipped .2   -> max(.16, .01) -> .08 (clipping would help, so not taken)
    values = t([[0.5, 0.1, -0.5], [0.5, 3.0, 3.0]]).requires_grad_()
    returns = t([[1.0, 1.0, -1.0], [0.1, -7.0, -7.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    loss, metrics = value_loss(values, torch.zeros_like(returns), returns, mask, clip_range=0.2)
    close(loss.detach(), (0.32 + 0.405 + 0.32 + 0.08) / 4)
    close(metrics["value_clipfrac"], 0.5)
    loss.backward()
    # Gradient (v - R) / 4 on the unclipped tokens only.
    close(values.grad, [[0.0, -0.9 / 4, 0.0], [0.4 / 4, 0.0, 0.0]])


def test_rollout_correction_weights_each_token_by_the_capped_ratio():
    # pi_old / pi_sampler = 1 / 0.5 = 2 -> capped at 1.5; 1 / 1 = 1; 1 / 0.25 = 4 -> 1.5. Ratio pi / pi_old = 1.
    logp = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    sampler_logp = torch.log(t([[0.5, 1.0, 0.25]]))
    advantages, mask = t([[1.0, 1.0, -1.0]]), t([[1, 1, 1]])
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), advantages, mask, 0.2, 0.2,
                                sampler_logp=sampler_logp, correction_cap=1.5)
    close(loss.detach(), (-1.5 - 1.0 + 1.5) / 3)
    close(metrics["rollout_correction_weight"], (1.5 + 1.0 + 1.5) / 3)
    close(metrics["rollout_correction_capped"], 2 / 3)
    loss.backward()
    close(logp.grad, [[-1.5 / 3, -1.0 / 3, 1.5 / 3]])  # d(-A * r * w)/dlogp with w detached
    plain, plain_metrics = policy_loss(logp.detach(), torch.zeros_like(logp), advantages, mask, 0.2, 0.2)
    close(plain, (-1.0 - 1.0 + 1.0) / 3)
    assert "rollout_correction_weight" not in plain_metrics


def test_sequence_level_ratio_is_gspo():
    # Sequence 1: token log-ratios 0.2, 0.4 (third token padding) -> mean 0.3, ratio e^0.3 = 1.35 for both,
    # A = +1 clips at 1.28: loss -1.28 each, no gradient. Sequence 2: -0.3, 0, 0.3 -> ratio 1, A = -1: loss r
    # on each of its 3 tokens, each r depending on all 3 log-probs (dr/dlogp = r / 3): gradient 3 * (1/3) / 5.
    old_logp = torch.zeros(2, 3, dtype=F64)
    logp = t([[0.2, 0.4, 9.0], [-0.3, 0.0, 0.3]]).requires_grad_()
    advantages, mask = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]), t([[1, 1, 0], [1, 1, 1]])
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28, ratio_level="sequence")
    close(loss.detach(), (2 * -1.28 + 3 * 1.0) / 5)
    close(metrics["clipfrac"], 2 / 5)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, 0.0], [1 / 5, 1 / 5, 1 / 5]])
    # Per token, sequence 2 differs: e^-0.3 = 0.74 clips at 0.8 and e^0.3 = 1.35 does not (A < 0).
    token_loss, _ = policy_loss(logp.detach(), old_logp, advantages, mask, 0.2, 0.28)
    assert not math.isclose(token_loss.item(), loss.item())


def test_rollout_correction_cap_below_one_is_refused():
    from hybridrl.config.loading import load_config
    from hybridrl.config.schema import ConfigError

    with pytest.raises(ConfigError, match="algorithm.rollout_correction_cap must be >= 1"):
        load_config(None, ["algorithm.rollout_correction_cap=0.5"])
    assert load_config(None, ["algorithm.ratio_level=sequence"]).algorithm.ratio_level == "sequence"


def test_uniform_groups_marks_every_sample_of_a_group_that_scored_alike():
    from hybridrl.algorithms import uniform_groups

    assert uniform_groups(t([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2).tolist() == [True, True, False, False, True, True]
    assert uniform_groups(t([0.0, 0.0, 0.0, 1.0]), 4).tolist() == [False] * 4


# --- policy-loss variants, MIS, ReMax ---------------------------------------------------------

from conftest import contains_seven, tiny_actor, toy_prompts  # noqa: E402

from hybridrl.algorithms import POLICY_LOSSES, remax_advantages, sequence_mismatch_mask  # noqa: E402


def test_ppo_is_the_default_policy_loss_and_the_names_match_the_config():
    assert typing.get_args(typing.get_type_hints(AlgorithmConfig)["policy_loss"]) == tuple(POLICY_LOSSES)
    assert AlgorithmConfig().policy_loss == "ppo"


def test_cispo_keeps_every_token_with_a_clipped_detached_weight():
    # Ratios e^0.5 = 1.6487 (clipped to 1.2), 1, e^-0.5 = 0.6065 (clipped to 0.8); A = [1, -1, 1]; token-mean.
    logp = t([[0.5, 0.0, -0.5]]).requires_grad_()
    advantages, mask = t([[1.0, -1.0, 1.0]]), t([[1, 1, 1]])
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), advantages, mask, 0.2, 0.2, loss_type="cispo")
    close(loss.detach(), -(1.2 - 1.0 + 0.8) / 3)
    close(metrics["clipfrac"], 2 / 3)
    loss.backward()
    close(logp.grad, [[-1.2 / 3, 1.0 / 3, -0.8 / 3]])  # -A * weight / 3: no token loses its gradient


def test_gmpo_clips_log_ratios_by_the_advantage_sign_then_takes_the_geometric_mean():
    # Row 0, A = 2, log-ratios [0.5, -0.5, 0]: only the top is clipped, to log 1.2 -> mean (log 1.2 - 0.5) / 3.
    # Row 1, A = -1, log-ratios [0.5, -0.5] (third token padding): only the bottom, to log 0.8 -> (0.5 + log .8) / 2.
    logp = t([[0.5, -0.5, 0.0], [0.5, -0.5, 9.0]]).requires_grad_()
    advantages, mask = t([[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]), t([[1, 1, 1], [1, 1, 0]])
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), advantages, mask, 0.2, 0.2,
                                loss_type="gmpo", aggregation="seq-mean-token-mean")
    row0 = -2 * math.exp((math.log(1.2) - 0.5) / 3)
    row1 = 1 * math.exp((0.5 + math.log(0.8)) / 2)
    close(loss.detach(), (row0 + row1) / 2)
    close(metrics["clipfrac"], 2 / 5)
    loss.backward()
    # d row0 / d logp[0, 1] = row0 / 3 (unclipped), halved by the sequence mean; clipped tokens get none.
    close(logp.grad, [[0.0, row0 / 3 / 2, row0 / 3 / 2], [row1 / 2 / 2, 0.0, 0.0]])


def test_sapo_soft_gate_by_hand():
    # r = 1 on token 0: gate sigmoid(0) = .5 -> loss -A * 4 / tau * .5 = -2 A / tau; gradient weight 4 * .25 = 1.
    # Token 1: A = -1, tau_neg 2, r = e^1: loss = (4 / 2) * sigmoid(2 (e - 1)).
    logp = t([[0.0, 1.0]]).requires_grad_()
    advantages, mask = t([[1.0, -1.0]]), t([[1, 1]])
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), advantages, mask, 0.2, 0.2, loss_type="sapo",
                                sapo_temperatures=(1.0, 2.0), aggregation="seq-mean-token-sum")
    s = 1 / (1 + math.exp(-2 * (math.e - 1)))
    close(loss.detach(), -2.0 + 2 * s)
    close(metrics["clipfrac"], 0.5)  # token 1's weight 4 s (1 - s) = 0.12 < 0.5
    loss.backward()
    close(logp.grad, [[-1.0, 4 * s * (1 - s) * math.e]])  # d/dlogp of -A (4/tau) sigmoid(tau (r - 1))


def test_sequence_mismatch_mask_drops_whole_sequences_outside_the_band():
    # Mean log(pi_old / pi_sampler): row 0 (0.1 + 0.3) / 2 = 0.2 (kept, log 2 = .693); row 1 1.0 (dropped);
    # row 2 -1.0 (dropped: below 1 / 2); the padding value 50 is ignored.
    old = t([[0.1, 0.3], [1.0, 1.0], [-1.0, 50.0]])
    mask = t([[1, 1], [1, 1], [1, 0]])
    assert sequence_mismatch_mask(old, torch.zeros_like(old), mask, 2.0).tolist() == [True, False, False]
    logp = torch.zeros(3, 2, dtype=F64)
    advantages = t([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    loss, metrics = policy_loss(logp, old, advantages, mask, 10.0, 10.0, sampler_logp=torch.zeros_like(old),
                                sequence_mask_threshold=2.0)
    ratio = torch.exp(-old[0])  # row 0 only; the normaliser still counts all 5 tokens
    close(loss, -(ratio.sum()) / 5)
    close(metrics["rollout_correction_masked"], 2 / 3)


def test_remax_subtracts_the_greedy_score_of_the_prompt():
    scores, baseline = t([1.0, 0.0, 0.5, 1.0]), t([0.5, 1.0])
    adv, _ = remax_advantages(scores, baseline, t([[1, 1], [1, 0], [1, 1], [0, 0]]), group_size=2)
    close(adv, [[0.5, 0.5], [-0.5, 0.0], [-0.5, -0.5], [0.0, 0.0]])
    with pytest.raises(ValueError, match="one greedy baseline score per prompt"):
        remax_advantages(scores, t([0.5]), torch.ones(4, 2, dtype=F64), group_size=2)


@pytest.mark.parametrize("loss_type, extra", [
    ("cispo", {}),
    ("gmpo", {"algorithm__loss_aggregation": "seq-mean-token-mean"}),
    ("sapo", {}),
])
def test_reward_rises_with_each_policy_loss(tmp_path, loss_type, extra):
    from hybridrl.data.datasets import PromptDataset
    from hybridrl.training.trainer import RLTrainer

    actor = tiny_actor()
    settings = dict(rollout__max_new_tokens=4, rollout__num_samples_per_prompt=4, trainer__prompts_per_step=8,
                    actor__micro_batch_size=16, trainer__device="cpu", logging__sinks=["jsonl"],
                    trainer__save_model=False, trainer__output_dir=str(tmp_path), trainer__total_steps=16,
                    actor__lr=1e-2, algorithm__policy_loss=loss_type, **extra)
    trainer = RLTrainer(actor=actor, reward_fn=contains_seven,
                        dataset=PromptDataset(toy_prompts(), actor.tokenizer, max_length=16), **settings)
    history = trainer.train()
    first = sum(row["reward/mean"] for row in history[:4]) / 4
    last = sum(row["reward/mean"] for row in history[-4:]) / 4
    assert last > first + 0.2, f"{loss_type}: reward {first:.2f} -> {last:.2f} did not rise"
