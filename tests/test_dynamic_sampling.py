"""DAPO dynamic sampling bookkeeping, worked by hand."""

import pytest
import torch

from hybridrl.training.dynamic_sampling import fill_informative_groups, informative_groups


def test_informative_groups_are_those_not_all_equal():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.0])
    assert informative_groups(scores, 2).tolist() == [True, False, False, True]
    assert informative_groups(scores, 4).tolist() == [True, True]


def rounds_of(batches):
    calls = []

    def generate(round_index):
        calls.append(round_index)
        return batches[round_index]
    return generate, calls


def test_fill_accumulates_across_rounds_and_counts_what_it_dropped():
    # Round 0: a informative, b all 1, c all 0. Round 1: d informative, e all 1, f and g informative.
    # Target 3: keeps a, d, f; g is surplus; b, c, e discarded; two rounds.
    batches = [[("a", [1, 0]), ("b", [1, 1]), ("c", [0, 0])],
               [("d", [0, 1]), ("e", [1, 1]), ("f", [0.5, 0]), ("g", [1, 0])],
               [("never", [1, 0])]]
    generate, calls = rounds_of(batches)
    result = fill_informative_groups(generate, target=3, max_rounds=5)
    assert result.kept == ["a", "d", "f"] and result.filled
    assert (result.num_discarded, result.num_surplus, result.num_rounds) == (3, 1, 2)
    assert calls == [0, 1]
    # No group of the result has all-equal scores.
    scores = {"a": [1, 0], "d": [0, 1], "f": [0.5, 0]}
    assert all(len(set(scores[g])) > 1 for g in result.kept)


def test_fill_stops_at_the_round_bound():
    generate, calls = rounds_of([[("a", [1, 1])], [("b", [1, 0])], [("c", [0, 1])]])
    result = fill_informative_groups(generate, target=2, max_rounds=2)
    assert result.kept == ["b"] and not result.filled
    assert (result.num_discarded, result.num_surplus, result.num_rounds) == (1, 0, 2)
    assert calls == [0, 1]
    with pytest.raises(ValueError, match="max_rounds >= 1"):
        fill_informative_groups(generate, target=2, max_rounds=0)


def test_concatenated_batches_equal_one_batch_built_from_all_rows():
    """Re-padding to the widest prompt and response gives what `build_rollout_batch` makes from every row at once."""
    from hybridrl.rollout.base import Generation
    from hybridrl.training.batch import build_rollout_batch
    from hybridrl.training.dynamic_sampling import concatenate_batches

    first = [Generation(0, [5, 6], [-0.5, -0.25], "stop"), Generation(0, [7], [-1.0], "stop")]
    second = [Generation(0, [8, 9, 4, 3], [-0.1, -0.2, -0.3, -0.4], "length"), Generation(1, [2], [-2.0], "stop"),
              Generation(1, [3, 3], [-3.0, -3.5], "stop"), Generation(0, [4], [-4.0], "stop")]
    a = build_rollout_batch([[11, 12]], first, pad_token_id=0, max_new_tokens=4)
    b = build_rollout_batch([[13, 14, 15], [16]], second, pad_token_id=0, max_new_tokens=4)
    a.scores, b.scores = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0, 1.0, 0.5])
    a.texts, b.texts = ["x", "y"], ["z", "w", "v", "u"]
    joined = concatenate_batches([a, b], pad_token_id=0)
    shifted = [Generation(g.prompt_index + 1, g.token_values, g.logprob_values, g.finish_reason) for g in second]
    reference = build_rollout_batch([[11, 12], [13, 14, 15], [16]], first + shifted, pad_token_id=0, max_new_tokens=4)
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "sampler_logp", "truncated",
                 "prompt_index"):
        assert torch.equal(getattr(joined, name), getattr(reference, name)), name
    assert joined.scores.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.5] and joined.texts == list("xyzwvu")
    assert joined.old_logp is None


def first_character_parity(prompts, completions, **columns):
    """A reward a random policy earns about half the time: most groups are informative, some are not."""
    return [float(bool(c) and ord(c[0]) % 2 == 1) for c in completions]


def recording_trainer(tmp_path, reward, **overrides):
    """A tiny trainer with dynamic sampling whose scored rounds and trained batches are recorded."""
    from test_trainer import make_trainer

    trainer = make_trainer(tmp_path, reward=reward, algorithm__dynamic_sampling=True, **overrides)
    scored, trained = [], []
    score, advantages = trainer.score, trainer.compute_advantages

    def recording_score(batch, prompts):
        metrics = score(batch, prompts)
        scored.append((trainer.step_count, batch.scores.clone()))
        return metrics

    def recording_advantages(batch):
        trained.append(batch.scores.clone())
        advantages(batch)

    trainer.score, trainer.compute_advantages = recording_score, recording_advantages
    return trainer, scored, trained


def test_the_trainer_trains_on_informative_groups_only_and_counts_the_discarded(tmp_path):
    trainer, scored, trained = recording_trainer(tmp_path, first_character_parity, trainer__total_steps=4,
                                                 algorithm__dynamic_sampling_max_rounds=3, actor__lr=1e-3)
    history = trainer.train()
    group, target = 4, 8  # make_trainer's group size and prompts per step
    total_discarded = 0
    for step, (row, batch_scores) in enumerate(zip(history, trained), start=1):
        rounds = [scores for at, scores in scored if at == step]
        uniform = sum(int(informative_groups(scores, group).logical_not().sum()) for scores in rounds)
        informative = sum(int(informative_groups(scores, group).sum()) for scores in rounds)
        assert row["rollout/dynamic_sampling_rounds"] == len(rounds)
        assert row["rollout/dynamic_sampling_discarded_groups"] == uniform
        assert row["rollout/dynamic_sampling_kept_groups"] == min(informative, target) == len(batch_scores) // group
        assert informative_groups(batch_scores, group).all(), f"step {step} trained on an all-equal group"
        assert row["reward/mean"] == pytest.approx(rounds[0].mean().item())  # the first round's, unfiltered
        total_discarded += uniform
    assert total_discarded > 0, "the test needs some all-equal groups to mean anything"
    assert any(row["rollout/dynamic_sampling_rounds"] > 1 for row in history)


def test_with_no_informative_group_the_step_runs_on_its_first_batch(tmp_path):
    trainer, scored, trained = recording_trainer(tmp_path, lambda prompts, completions, **c: [1.0] * len(completions),
                                                 trainer__total_steps=1, algorithm__dynamic_sampling_max_rounds=2)
    row = trainer.train()[-1]
    assert (row["rollout/dynamic_sampling_kept_groups"], row["rollout/dynamic_sampling_discarded_groups"],
            row["rollout/dynamic_sampling_rounds"], row["rollout/dynamic_sampling_filled"]) == (0, 16, 2, 0.0)
    assert len(trained[0]) == 32 and row["actor/policy_loss"] == 0.0


def test_reward_rises_with_dynamic_sampling(tmp_path):
    from test_trainer import make_trainer, mean_reward  # its reward: contains_seven

    history = make_trainer(tmp_path, trainer__total_steps=16, actor__lr=1e-2, algorithm__dynamic_sampling=True).train()
    first, last = mean_reward(history, lambda h: h[:4]), mean_reward(history, lambda h: h[-4:])
    assert last > first + 0.2, f"reward {first:.2f} -> {last:.2f} did not rise"


def test_dynamic_sampling_needs_groups():
    from hybridrl.config.loading import load_config
    from hybridrl.config.schema import ConfigError

    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling compares the samples"):
        load_config(None, algorithm__dynamic_sampling=True, algorithm__name="reinforce_pp",
                    rollout__num_samples_per_prompt=1)
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds must be at least 1"):
        load_config(None, algorithm__dynamic_sampling_max_rounds=0)
