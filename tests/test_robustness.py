"""Nothing lost, nothing silent: a blowing-up run stops before it is saved, cut-short writes are cleaned up,
full disks and closed pipes end in one sentence, a stop by signal exits 128 + signal."""

import errno
import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import tiny_actor

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



# ----------------------------------------------------------------------------------------------
# `hybridrl train` in a subprocess: closed pipes, stops by signal


def cli_train(tmp_path, *overrides: str) -> list[str]:
    from hybridrl.cli import DEMO_CONFIGS
    from hybridrl.data.tasks import write_arithmetic_task

    data = write_arithmetic_task(tmp_path / "data", num_train=256, num_eval=16, seed=3)
    return [sys.executable, "-m", "hybridrl.cli", "train", str(DEMO_CONFIGS / "arithmetic_grpo.yaml"),
            "model.path=tiny:llama", f"data.train_path={data['train']}", f"data.eval_path={data['eval']}",
            "trainer.device=cpu", f"trainer.output_dir={tmp_path / 'run'}", "trainer.eval_every=0",
            "trainer.prompts_per_step=4", "rollout.num_samples_per_prompt=4", "rollout.max_new_tokens=4",
            "actor.micro_batch_size=16", "logging.sinks=[console,jsonl]", *overrides]


def logged_steps(run) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def test_a_reader_that_closes_the_pipe_loses_no_step(tmp_path):
    """`hybridrl train ... | head`: once the reader is gone the run prints nothing more, and trains, logs,
    checkpoints and saves the model as if its output went to a terminal."""
    train = subprocess.Popen(cli_train(tmp_path, "trainer.total_steps=6", "trainer.save_every=3"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    read_to_step_1 = "import sys\nfor line in sys.stdin:\n    if line.startswith('step 1/'): break"
    reader = subprocess.Popen([sys.executable, "-c", read_to_step_1], stdin=train.stdout)
    train.stdout.close()  # only the reader holds the pipe's read end
    reader.wait(timeout=120)
    _, errors = train.communicate(timeout=120)
    assert train.returncode == 0, errors.decode()[-2000:]
    assert b"BrokenPipeError" not in errors
    run = tmp_path / "run"
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000006"
    assert (run / "model" / "config.json").is_file()


def test_a_sigterm_stop_of_hybridrl_train_exits_143_after_saving(tmp_path):
    train = subprocess.Popen(cli_train(tmp_path, "trainer.total_steps=500", "trainer.save_every=0"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = tmp_path / "run"
    deadline = time.time() + 120
    while not logged_steps(run):
        assert train.poll() is None and time.time() < deadline, train.stdout.read().decode()[-2000:]
        time.sleep(0.05)
    train.send_signal(signal.SIGTERM)
    output = train.communicate(timeout=120)[0].decode()
    assert train.returncode == 128 + signal.SIGTERM, output[-2000:]
    assert "stopped by SIGTERM after step" in output
    step = logged_steps(run)[-1]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{step:06d}"
    assert not (run / "model").exists()  # a stopped run is not finished: only its checkpoint is written


# ----------------------------------------------------------------------------------------------
# The final model: written whole or not at all


def test_a_failed_model_save_leaves_no_config_without_weights_and_keeps_the_old_model(tmp_path, monkeypatch):
    from hybridrl.models.loading import ModelError, load_hf_model, save_hf_model

    actor = tiny_actor()
    target = tmp_path / "model"
    save_hf_model(actor.model, actor.tokenizer, target)
    before = sorted(p.name for p in target.iterdir())
    assert "config.json" in before and any(name.endswith(".safetensors") for name in before)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(actor.tokenizer, "save_pretrained", full_disk)  # the weights and config are written first
    with torch.no_grad():
        next(actor.model.parameters()).add_(1.0)
    with pytest.raises(ModelError, match=rf"^writing {target} failed \(.*No space left on device\): it needs about "):
        save_hf_model(actor.model, actor.tokenizer, target)
    assert sorted(p.name for p in target.iterdir()) == before  # the earlier model, untouched
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary directory left
    reloaded = load_hf_model(str(target), dtype="float32").model
    assert not torch.equal(next(reloaded.parameters()), next(actor.model.parameters()))
    with pytest.raises(ModelError):
        save_hf_model(actor.model, actor.tokenizer, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
