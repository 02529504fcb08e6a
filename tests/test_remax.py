"""ReMax through the trainer: a greedy rollout per step gives each prompt its baseline."""

import pytest
import torch
from test_trainer import make_trainer, mean_reward

from hybridrl.config.loading import load_config
from hybridrl.config.schema import ConfigError


def test_each_row_gets_its_prompts_greedy_score_and_the_advantage_is_the_difference(tmp_path):
    trainer = make_trainer(tmp_path, algorithm__name="remax", trainer__total_steps=1, rollout__num_samples_per_prompt=2)
    seen = {}
    advantages = trainer.compute_advantages

    def recording(batch):
        advantages(batch)
        seen["batch"] = batch

    trainer.compute_advantages = recording
    row = trainer.train()[-1]
    batch = seen["batch"]
    assert batch.baseline_scores.shape == batch.scores.shape
    grouped = batch.baseline_scores.reshape(-1, 2)
    assert torch.equal(grouped[:, 0], grouped[:, 1])  # one baseline per prompt
    first_token = batch.advantages[:, 0]
    assert torch.allclose(first_token, batch.scores - batch.baseline_scores)
    assert row["reward/greedy_baseline_mean"] == pytest.approx(grouped[:, 0].mean().item())
    assert row["timing/baseline_s"] > 0


def test_the_greedy_baseline_equals_an_evaluation_rollout_of_the_same_prompts(tmp_path):
    from hybridrl.training.greedy_baseline import attach_greedy_baseline
    from hybridrl.training.trainer import PhaseTimer

    trainer = make_trainer(tmp_path, algorithm__name="remax", rollout__num_samples_per_prompt=2)
    prompts = trainer.parts.dataset.batch([3, 1, 4])
    batch, _ = trainer.rollout(prompts)
    trainer.score(batch, prompts)
    metrics = attach_greedy_baseline(trainer, PhaseTimer(trainer.device), batch, prompts)
    greedy, _ = trainer.rollout(prompts, evaluation=True)
    expected = torch.tensor([float("7" in text) for text in greedy.texts])  # make_trainer's reward: contains_seven
    assert batch.baseline_scores.tolist() == expected.repeat_interleave(2).tolist()
    assert metrics["reward/greedy_baseline_mean"] == pytest.approx(expected.mean().item())
    other = make_trainer(tmp_path / "grpo", rollout__num_samples_per_prompt=2)
    assert attach_greedy_baseline(other, PhaseTimer(other.device), batch, prompts) == {}


def test_reward_rises_with_remax(tmp_path):
    history = make_trainer(tmp_path, algorithm__name="remax", trainer__total_steps=16, actor__lr=1e-2).train()
    first, last = mean_reward(history, lambda h: h[:4]), mean_reward(history, lambda h: h[-4:])
    assert last > first + 0.2, f"reward {first:.2f} -> {last:.2f} did not rise"


def test_remax_needs_a_greedy_baseline_of_its_own_prompts():
    for extra in ({"rollout__eval_temperature": 0.5}, {"algorithm__dynamic_sampling": True}):
        with pytest.raises(ConfigError, match="algorithm.name=remax takes its baseline from a greedy rollout"):
            load_config(None, algorithm__name="remax", **extra)
    load_config(None, algorithm__name="remax", rollout__num_samples_per_prompt=1)  # one sample per prompt is enough
