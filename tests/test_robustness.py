"""Nothing lost, nothing silent: a blowing-up run stops before it is saved, cut-short writes are cleaned up,
full disks and closed pipes end in one sentence, a stop by signal exits 128 + signal."""

import inspect
import math

import pytest
import torch
from conftest import tiny_actor

from hybridrl.training import trainer as trainer_module
from hybridrl.training.divergence import DivergenceGuard, Limits, find_divergence, max_abs_weight
from hybridrl.training.update import TrainingError


def healthy(step: int, **changes: float) -> dict[str, float]:
    return {"step": step, "actor/policy_loss": -0.01, "actor/grad_norm": 0.4, "actor/entropy": 1.1, **changes}


@pytest.mark.parametrize("key", ["actor/policy_loss", "actor/grad_norm", "actor/entropy", "critic/value_loss",
                                 "critic/grad_norm"])
def test_a_non_finite_metric_is_divergence_named_with_its_step(key):
    history = [healthy(1), healthy(2, **{key: float("nan")})]
    problem = find_divergence(history, Limits())
    assert problem is not None and key in problem and "step 2" in problem
    assert ("critic.lr" if key.startswith("critic") else "actor.lr") in problem
    assert find_divergence([healthy(1), healthy(2, **{key: math.inf})], Limits()) is not None


def test_a_healthy_history_passes():
    history = [healthy(1), healthy(2, **{"actor/grad_norm": 50.0, "actor/entropy": 2.0}), healthy(3)]
    assert find_divergence(history, Limits(), max_weight=5.0, start_max_weight=1.0) is None
    assert find_divergence([], Limits()) is None


def test_the_grad_norm_bound_reads_the_logged_norm_before_clipping():
    history = [healthy(1), healthy(2, **{"actor/grad_norm": 2e5})]
    problem = find_divergence(history, Limits(max_grad_norm=1e5))
    assert "actor/grad_norm" in problem and "step 2" in problem and "actor.max_grad_norm" in problem
    assert find_divergence(history, Limits(max_grad_norm=0)) is None  # 0 turns the bound off
    assert find_divergence(history, Limits(max_grad_norm=3e5)) is None


def test_entropy_far_above_its_start_needs_both_the_ratio_and_the_margin():
    limits = Limits(entropy_ratio=3.0, entropy_margin=1.0)
    # 1.1 -> 4.6: 4.2x and 3.5 nats up (the blown-up run of a real model).
    assert "actor/entropy" in find_divergence([healthy(1), healthy(2, **{"actor/entropy": 4.6})], limits)
    # 0.2 -> 0.9: 4.5x but only 0.7 nat up: a sharp policy loosening a little, not noise.
    low = [healthy(1, **{"actor/entropy": 0.2}), healthy(2, **{"actor/entropy": 0.9})]
    assert find_divergence(low, limits) is None
    # 2.0 -> 3.5: 1.5 nat up but under 3x.
    assert find_divergence([healthy(1, **{"actor/entropy": 2.0}), healthy(2, **{"actor/entropy": 3.5})], limits) is None
    # The start is the first step's entropy, not the previous step's.
    creeping = [healthy(s, **{"actor/entropy": e}) for s, e in ((1, 1.0), (2, 2.0), (3, 3.0), (4, 3.5))]
    assert "step 4" in find_divergence(creeping, limits)
    assert find_divergence(creeping[:-1], limits) is None  # 3.0 at step 3 is 3x, not more


def test_weights_far_above_their_start_or_not_finite_are_divergence():
    limits = Limits(max_weight_growth=100.0)
    history = [healthy(1)]
    assert find_divergence(history, limits, max_weight=99.0, start_max_weight=1.0) is None
    assert "grew from 1 at the start to 1e+03" in find_divergence(history, limits, 1001.0, 1.0)
    assert "became nan" in find_divergence(history, limits, float("nan"), 1.0)
    assert "became inf" in find_divergence(history, limits, float("inf"), 1.0)


def test_max_abs_weight_is_the_largest_trainable_value_and_does_not_hide_a_nan():
    model = tiny_actor().model
    reference = max(p.detach().abs().max().item() for p in model.parameters() if p.requires_grad)
    assert max_abs_weight(model) == pytest.approx(reference)
    parameter = next(model.parameters())
    with torch.no_grad():
        parameter[0, 0] = -7e3
    assert max_abs_weight(model) == 7e3
    parameter.requires_grad_(False)  # frozen weights (a 4-bit base) are not checked
    assert max_abs_weight(model) == pytest.approx(max(reference, *(p.detach().abs().max().item()
                                                                    for p in model.parameters() if p.requires_grad)))
    parameter.requires_grad_(True)
    with torch.no_grad():
        parameter[0, 1] = float("nan")
    assert math.isnan(max_abs_weight(model))


def test_the_guard_raises_one_training_error_when_the_weights_blow_up():
    model = tiny_actor().model
    guard = DivergenceGuard(model)
    guard.check([healthy(1)])  # unchanged weights pass
    with torch.no_grad():
        next(model.parameters())[0, 0] = 1e3 * guard.start_max_weight
    with pytest.raises(TrainingError, match=r"the run is diverging: .* at step 2 .*lower actor\.lr.*not saved"):
        guard.check([healthy(1), healthy(2)])
    DivergenceGuard(model, enabled=False).check([healthy(1), healthy(2, **{"actor/grad_norm": float("nan")})])


GUARD_WIRED = "DivergenceGuard" in inspect.getsource(trainer_module)


@pytest.mark.skipif(not GUARD_WIRED, reason="needs the trainer to call training/divergence.py (requests.md)")
def test_a_run_that_blows_up_stops_at_its_first_bad_step_with_the_last_good_checkpoint_intact(tmp_path):
    from test_trainer import make_trainer

    from hybridrl.checkpoint.store import check_checkpoint, step_directories

    run = make_trainer(tmp_path, trainer__total_steps=5, trainer__save_every=1, trainer__save_model=True,
                       actor__lr=1e-3)
    update = run.update

    def update_at_lr_1e3_from_step_3(batch):
        if run.step_count == 3:  # the run's learning rate jumps to actor.lr=1e3 (from here on, as a config would)
            run.parts.actor_scheduler.base_lrs = [1e3 for _ in run.parts.actor_scheduler.base_lrs]
            for group in run.parts.actor_optimizer.param_groups:
                group["lr"] = 1e3
        return update(batch)

    run.update = update_at_lr_1e3_from_step_3
    with pytest.raises(TrainingError, match="at step 3"):
        run.train()
    checkpoints = tmp_path / "checkpoints"
    assert [p.name for p in step_directories(checkpoints)] == ["step_000002", "step_000001"]
    assert (checkpoints / "latest").read_text().strip() == "step_000002"
    assert check_checkpoint(checkpoints / "step_000002") is None
    assert not (tmp_path / "model").exists()

