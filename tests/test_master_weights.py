"""`actor.master_weights=float32`: a float32 master copy of bf16 weights, against a float32 reference update and
against the lean path (bf16 weights, stochastic rounding)."""

import torch
from conftest import contains_seven, tiny_actor, toy_prompts

from hybridrl.config.loading import load_config
from hybridrl.config.schema import ConfigError
from hybridrl.data.datasets import PromptDataset
from hybridrl.training.optim import LeanAdamW, build_optimizer
from hybridrl.training.trainer import RLTrainer

STEPS, LR = 40, 1e-4


def gradients(shapes, steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(steps)]


def trained(params, optimizer, grads, dtype):
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.to(dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def start_weights(shapes, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(0.05 * torch.randn(shape, generator=generator)).to(torch.bfloat16).float() for shape in shapes]


def distance(a, b):
    return sum((x.float() - y.float()).pow(2).sum() for x, y in zip(a, b)).sqrt().item()


def test_master_weights_follow_a_float32_update_more_closely_than_stochastic_rounding():
    shapes = [(64, 32), (32,)]
    grads = gradients(shapes, STEPS)
    reference = [torch.nn.Parameter(w.clone()) for w in start_weights(shapes)]
    trained(reference, torch.optim.AdamW(reference, lr=LR, weight_decay=0.01), grads, torch.float32)
    runs = {}
    for master in (False, True):
        params = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in start_weights(shapes)]
        optimizer = LeanAdamW(params, lr=LR, weight_decay=0.01, master_weights=master)
        trained(params, optimizer, grads, torch.bfloat16)
        runs[master] = (params, optimizer)
    params, optimizer = runs[True]
    masters = [optimizer.state[p]["master"] for p in params]
    assert all(m.dtype == torch.float32 for m in masters)
    # The bf16 weights the model computes with are the master copy rounded to nearest.
    assert all(torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(params, masters))
    master_error = distance(masters, reference)
    lean_error = distance(runs[False][0], reference)
    # The master copy differs from the float32 reference only through the bf16 gradients it was given.
    assert master_error < 0.1 * lean_error, (master_error, lean_error)
    # Its rounded weights are as close as bf16 weights can be: about the rounding of the reference itself.
    rounded_reference = [r.detach().to(torch.bfloat16) for r in reference]
    assert distance(params, reference) < 1.5 * distance(rounded_reference, reference) + 1e-6


def test_the_master_copy_survives_a_state_dict_round_trip_in_float32():
    params = [torch.nn.Parameter(torch.randn(8, 4).to(torch.bfloat16))]
    optimizer = LeanAdamW(params, lr=1e-3, master_weights=True)
    trained(params, optimizer, gradients([(8, 4)], 3), torch.bfloat16)
    saved = optimizer.state_dict()
    fresh = LeanAdamW(params, lr=1e-3, master_weights=True)
    fresh.load_state_dict(saved)
    master = fresh.state[params[0]]["master"]
    assert master.dtype == torch.float32 and torch.equal(master, optimizer.state[params[0]]["master"])


def test_float32_parameters_need_no_master_and_the_lean_path_keeps_none():
    weights = torch.nn.Parameter(torch.randn(4))
    assert isinstance(build_optimizer([weights], 1e-3, master_weights=True), torch.optim.AdamW)  # fused torch AdamW
    bf16 = [torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))]
    lean = build_optimizer(bf16, 1e-3)
    trained(bf16, lean, gradients([(4,)], 1), torch.bfloat16)
    assert "master" not in lean.state[bf16[0]]


def test_trainer_with_bf16_weights_keeps_them_equal_to_the_rounded_master(tmp_path):
    actor = tiny_actor()
    actor.model.to(torch.bfloat16)
    dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
    trainer = RLTrainer(actor=actor, reward_fn=contains_seven, dataset=dataset, rollout__max_new_tokens=4,
                        rollout__num_samples_per_prompt=4, trainer__prompts_per_step=8, actor__micro_batch_size=16,
                        trainer__device="cpu", logging__sinks=["jsonl"], trainer__save_model=False,
                        trainer__output_dir=str(tmp_path), trainer__total_steps=2, actor__lr=1e-3,
                        actor__master_weights="float32")
    trainer.train()
    optimizer = trainer.parts.actor_optimizer
    params = [p for p in trainer.parts.actor.parameters() if p.requires_grad]
    masters = [optimizer.state[p]["master"] for p in params]
    assert all(torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(params, masters))
    assert any(not torch.equal(m, p.detach().float()) for p, m in zip(params, masters))  # it holds more bits


def test_master_weights_refuse_low_precision_state():
    for extra in ({"actor__optimizer_state_dtype": "param"}, {"actor__optimizer_8bit": True}):
        try:
            load_config(None, actor__master_weights="float32", **extra)
        except ConfigError as error:
            assert "actor.master_weights=float32" in str(error)
        else:
            raise AssertionError(f"{extra} was accepted")
