"""`model.gradient_checkpointing` recomputes the decoder layers in the update for a model loaded from a directory too
(transformers' `from_pretrained` returns it in eval mode, where a layer is never checkpointed), and in PPO's critic,
a copy of the actor made in eval mode."""

from __future__ import annotations

import pytest
import torch

from conftest import contains_seven, tiny_actor, toy_prompts
from hybridrl import PromptDataset
from hybridrl.models.loading import decoder_layers, load_hf_model, save_hf_model
from hybridrl.training.logprobs import response_logprobs
from hybridrl.training.trainer import RLTrainer


def layer_runs_in_one_backward(model, critic: bool = False) -> int:
    """How often the first decoder layer's MLP starts in one forward + backward of the update's log-prob pass (or the
    critic's values): twice when the layer is recomputed in the backward (checkpointed), once when its activations
    were kept. A pre-hook: torch stops a recompute once the last saved tensor is made again, before the MLP's forward
    returns."""
    runs = []
    handle = decoder_layers(model.backbone if critic else model)[0].mlp.register_forward_pre_hook(
        lambda *args: runs.append(1))
    ids = torch.randint(3, 20, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(2, 12)
    if critic:
        model(ids, torch.ones_like(ids), positions).sum().backward()
    else:
        logp, _ = response_logprobs(model, ids, torch.ones_like(ids), positions, 4, real_tokens=24)
        logp.sum().backward()
    model.zero_grad(set_to_none=True)
    handle.remove()
    return len(runs)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_loaded_model_is_checkpointed_exactly_when_asked(tmp_path, checkpointing):
    actor = tiny_actor()
    save_hf_model(actor.model, actor.tokenizer, tmp_path / "model")
    loaded = load_hf_model(str(tmp_path / "model"))
    assert not loaded.model.training  # what makes the case: transformers hands a loaded model over in eval mode
    trainer = RLTrainer(actor=loaded, reward_fn=contains_seven,
                        dataset=PromptDataset(toy_prompts(), loaded.tokenizer, max_length=16), algorithm__name="ppo",
                        model__gradient_checkpointing=checkpointing, trainer__device="cpu", trainer__total_steps=1,
                        trainer__prompts_per_step=2, rollout__num_samples_per_prompt=2, rollout__max_new_tokens=4,
                        trainer__save_model=False, trainer__output_dir=str(tmp_path / "run"), logging__sinks=[])
    model, critic = trainer.parts.actor, trainer.parts.critic
    expected = 2 if checkpointing else 1
    assert layer_runs_in_one_backward(model) == expected
    assert layer_runs_in_one_backward(critic, critic=True) == expected  # PPO's critic: a copy, made in eval mode
    trainer.step()  # a rollout switches the model to generation and back: still checkpointed after it
    assert layer_runs_in_one_backward(model) == expected
    assert layer_runs_in_one_backward(critic, critic=True) == expected


def test_a_policy_with_dropout_in_its_config_runs_without_it(tmp_path):
    """Train mode (which checkpointing needs) would switch on a loaded model's dropout, and an on-policy PPO ratio
    would then differ from 1 (two forwards, two masks): the actor and the critic run with every dropout at 0, and two
    log-prob passes agree exactly (with attention dropout 0.5 in the config they differed before)."""
    actor = tiny_actor()
    actor.model.config.attention_dropout = 0.5
    save_hf_model(actor.model, actor.tokenizer, tmp_path / "model")
    loaded = load_hf_model(str(tmp_path / "model"))
    trainer = RLTrainer(actor=loaded, reward_fn=contains_seven,
                        dataset=PromptDataset(toy_prompts(), loaded.tokenizer, max_length=16), algorithm__name="ppo",
                        model__gradient_checkpointing=True, trainer__device="cpu", trainer__total_steps=1,
                        trainer__prompts_per_step=2, rollout__num_samples_per_prompt=2, rollout__max_new_tokens=4,
                        trainer__save_model=False, trainer__output_dir=str(tmp_path / "run"), logging__sinks=[])
    model = trainer.parts.actor
    assert model.training and decoder_layers(model)[0].self_attn.attention_dropout == 0.0
    assert decoder_layers(trainer.parts.critic.backbone)[0].self_attn.attention_dropout == 0.0
    ids = torch.randint(3, 20, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(2, 12)
    first, _ = response_logprobs(model, ids, torch.ones_like(ids), positions, 4, real_tokens=24)
    second, _ = response_logprobs(model, ids, torch.ones_like(ids), positions, 4, real_tokens=24)
    assert torch.equal(first, second)
