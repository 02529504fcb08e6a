"""LoRA through peft: the reference is the adapter-disabled actor and equals the base model exactly."""

import copy

import pytest
import torch
from conftest import tiny_actor
from test_logprobs import padded_batch

from hybridrl.models.lora import AdapterDisabled, apply_lora
from hybridrl.training.logprobs import response_logprobs

pytest.importorskip("peft")


def test_lora_reference_equals_base_and_actor_differs():
    model, _ = tiny_actor()
    base = copy.deepcopy(model)
    actor = apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():  # a trained adapter: B != 0
        for name, param in actor.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    reference = AdapterDisabled(actor)
    assert list(reference.parameters()) == []  # no second copy of the weights
    ids, mask, positions, response = padded_batch()
    with torch.no_grad():
        ref_logp, _ = response_logprobs(reference, ids, mask, positions, response)
        base_logp, _ = response_logprobs(base, ids, mask, positions, response)
        actor_logp, _ = response_logprobs(actor, ids, mask, positions, response)
    assert torch.allclose(ref_logp, base_logp, atol=1e-6)
    assert not torch.allclose(actor_logp, base_logp, atol=1e-3)
    assert not torch.allclose(reference(input_ids=ids).logits, actor(input_ids=ids).logits)


def test_lora_trainer_updates_only_adapters(tmp_path):
    from test_trainer import make_trainer

    trainer = make_trainer(tmp_path, trainer__total_steps=2, actor__lr=1e-2, model__lora_rank=4,
                           algorithm__kl_coef=0.1)
    assert isinstance(trainer.parts.reference, AdapterDisabled)
    named = dict(trainer.parts.actor.named_parameters())
    before = {name: p.detach().clone() for name, p in named.items()}
    history = trainer.train()
    moved = {name for name, p in named.items() if not torch.equal(before[name], p)}
    assert moved and all("lora_" in name for name in moved)
    assert any("lora_A" in name for name in moved)
    assert history[-1]["actor/kl"] > 0  # the adapter moved the policy away from the reference
