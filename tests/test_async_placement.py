"""Where the asynchronous rollout worker runs: `trainer.device_mesh.rollout` (the placement key, one CUDA device
apart from the training processes') or `trainer.rollout_device` (a device by name, `cpu` included), for the thread
and the process worker alike. On a CPU machine the placement is checked by its rules and its mapping onto the
worker's device; `rollout_device=cpu` runs the process worker's cross-device path and must change no bit."""

import logging
from types import SimpleNamespace

import pytest
import torch
from test_async_pipeline import learning_metrics, make_trainer

from hybridrl.config.schema import ConfigError
from hybridrl.parallel.placement import resolve_placement, rollout_device
from hybridrl.training import async_pipeline, rollout_process


def test_the_rollout_role_gets_one_device_of_its_own():
    placement = resolve_placement({"actor": [0], "rollout": [1]}, num_gpus=1, num_visible=2)
    assert placement.rollout == (1,) and placement.actor == (0,) and placement.reward == (0,)
    assert resolve_placement({"actor": [0, 1], "rollout": [2], "reward": [2]}, num_gpus=2, num_visible=3).rollout == (2,)
    assert resolve_placement(None, num_gpus=2, num_visible=2).rollout == ()  # left out: the trainer's device
    assert rollout_device({"actor": [0], "rollout": [1]}) == "cuda:1" and rollout_device({"rollout": 3}) == "cuda:3"
    assert rollout_device({"actor": [0]}) == "" and rollout_device(None) == ""


@pytest.mark.parametrize("mesh, words", [
    ({"actor": [0], "rollout": [0]}, "shares a device with actor=[0]"),
    ({"actor": [0, 1], "rollout": [1]}, "shares a device with actor=[0, 1]"),
    ({"actor": [0], "rollout": [1, 2]}, "the rollout worker runs on one device"),
    ({"actor": [0], "rollout": [7]}, "trainer.device_mesh.rollout uses CUDA device 7"),
    ({"actor": [0], "rollout": [1], "reward": [1, 2]}, "trainer.device_mesh.reward"),
    ({"actor": [0], "rolout": [1]}, "unknown role 'rolout'"),
])
def test_a_rollout_placement_that_cannot_work_is_refused_naming_the_key(mesh, words):
    with pytest.raises(ConfigError, match="trainer.device_mesh") as error:
        resolve_placement(mesh, num_gpus=len(mesh["actor"]), num_visible=3)
    assert words in str(error.value)


def test_the_worker_runs_where_the_mesh_says_else_where_rollout_device_says_else_on_the_trainers_device():
    def trainer(mesh, name):
        config = SimpleNamespace(trainer=SimpleNamespace(device_mesh=mesh, rollout_device=name))
        return SimpleNamespace(config=config, parts=SimpleNamespace(device=torch.device("cpu")))

    assert async_pipeline.rollout_device(trainer({"actor": [0], "rollout": [1]}, "")) == torch.device("cuda", 1)
    assert async_pipeline.rollout_device(trainer({}, "cpu")) == torch.device("cpu")
    assert async_pipeline.rollout_device(trainer({}, "")) == torch.device("cpu")


@pytest.mark.parametrize("overrides, words", [
    (dict(trainer__max_staleness=0), "only the asynchronous pipeline does"),
    (dict(trainer__max_staleness=1, trainer__rollout_device="cuda:1"), "keep trainer.device_mesh.rollout"),
])
def test_a_rollout_device_in_the_mesh_is_refused_where_it_cannot_work(tmp_path, overrides, words):
    with pytest.raises(ConfigError, match=words):
        make_trainer(tmp_path, trainer__device_mesh={"actor": [0], "rollout": [1]}, **overrides)


def test_the_process_worker_on_rollout_device_cpu_is_the_run_without_it_bitwise(tmp_path, caplog):
    settings = dict(trainer__total_steps=3, trainer__max_staleness=1, algorithm__rollout_correction_cap=2.0,
                    trainer__rollout_worker="process")
    default = make_trainer(tmp_path / "default", **settings).train()
    caplog.set_level(logging.INFO, logger=rollout_process.__name__)
    placed = make_trainer(tmp_path / "cpu", trainer__rollout_device="cpu", **settings).train()
    assert learning_metrics(placed) == learning_metrics(default)
    assert "rollout process on cpu: weights pushed over GLOO (the trainer or the rollout process runs on the CPU" \
        in caplog.text


@pytest.mark.parametrize("trainer_device, mesh, rollout, backend, published_on", [
    ("cpu", None, "", "gloo", "cpu"),
    ("cuda:0", {"actor": [0], "rollout": [1]}, "", "nccl", "cuda:0"),  # NCCL sends from the trainer's GPU
    ("cuda:1", None, "cuda:1", "gloo", "cpu"),  # one GPU for both: staged through the CPU, where it is published
])
def test_the_process_worker_pushes_over_nccl_from_the_trainers_gpu_exactly_when_the_worker_has_another(
        monkeypatch, trainer_device, mesh, rollout, backend, published_on):
    monkeypatch.setattr(rollout_process.dist, "is_nccl_available", lambda: True)  # a CPU build has none
    config = SimpleNamespace(trainer=SimpleNamespace(device_mesh=mesh, rollout_device=rollout))
    trainer = SimpleNamespace(config=config, parts=SimpleNamespace(device=torch.device(trainer_device)))
    worker = rollout_process.ProcessWorker(trainer, 1, 1, 2, version=0, lock=None, mailbox=None, model=None)
    assert worker.push_link[0] == backend and worker.weights_device == torch.device(published_on)
