"""The rollout workers on a GPU (run with `pytest -m gpu`): the built-in engine makes its KV cache, compiled decode
and CUDA graphs on the thread worker's thread, and its captures leave the default CUDA generator to a thread that
draws from it meanwhile (on the CPU: when the trainer must hold the capture lock); a run stopped by SIGTERM ends its
worker and resumes like one that never stopped. The process worker on the trainer's GPU (its pushes staged through
the CPU over gloo) samples the thread worker's tokens; on a second GPU (two GPUs needed) it is pushed to over NCCL
and samples them too."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import contains_seven, tiny_actor, toy_prompts
from test_async_pipeline import FAST, learning_metrics, make_trainer
from test_async_stop import stop_after_step

from hybridrl.data.datasets import PromptDataset
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.graph_rng import CAPTURE_LOCK, draws_random_numbers
from hybridrl.training.async_pipeline import RolloutWorker, draws_beside_captures
from hybridrl.training.rollout_process import ProcessWorker
from hybridrl.training.trainer import RLTrainer


def gpu_trainer(out, device: str, **overrides) -> RLTrainer:
    actor = tiny_actor(hidden_size=64)  # heads of 16: what the engine's kernels take
    dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
    return RLTrainer(actor=actor, reward_fn=contains_seven, dataset=dataset, **{
        **FAST, "trainer__device": device, "model__dtype": "float32", "rollout__backend": "builtin",
        "trainer__max_staleness": 1, "trainer__total_steps": 4, "algorithm__rollout_correction_cap": 2.0,
        "trainer__output_dir": str(out), **overrides})


def check_stop_and_resume(tmp_path, device: str) -> None:
    full_trainer = gpu_trainer(tmp_path / "full", device)
    full = full_trainer.train()
    assert not full_trainer.pipeline.worker.is_alive()
    cut = gpu_trainer(tmp_path / "cut", device)
    stop_after_step(cut, 2)
    cut.train()
    assert cut.stopped_by == "SIGTERM" and cut.step_count == 2 and not cut.pipeline.worker.is_alive()
    resumed = gpu_trainer(tmp_path / "cut", device).train()
    assert [row["rollout/staleness_max"] for row in resumed] == [0.0, 1.0, 1.0, 1.0]
    assert_same_tokens(resumed, full)


def assert_same_tokens(history, reference) -> None:
    """The same sampled tokens (rewards, lengths); the rest within float noise of another process or schedule."""
    for ours, theirs in zip(learning_metrics(history), learning_metrics(reference), strict=True):
        assert ours.keys() == theirs.keys()
        same_tokens = [key for key in ours if key.startswith(("reward/", "rollout/response_length"))]
        assert {key: ours[key] for key in same_tokens} == {key: theirs[key] for key in same_tokens}
        assert all(ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6) for key in ours), (ours, theirs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_thread_worker_on_cuda_stops_with_its_run_and_resumes_exactly(tmp_path):
    check_stop_and_resume(tmp_path, "cuda")


def test_the_same_check_on_cpu(tmp_path):
    """The GPU test's own logic, on the CPU (the built-in engine's PyTorch paths)."""
    check_stop_and_resume(tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_process_worker_on_cuda_samples_the_thread_workers_tokens(tmp_path):
    thread = gpu_trainer(tmp_path / "thread", "cuda").train()
    process = gpu_trainer(tmp_path / "process", "cuda", trainer__rollout_worker="process").train()
    assert [row["rollout/staleness_max"] for row in process] == [0.0, 1.0, 1.0, 1.0]
    assert process[-1]["perf/weight_broadcast_s"] > 0
    assert_same_tokens(process, thread)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL push needs the rollout process on a second GPU "
                                                          "(NCCL refuses two ranks on one GPU)")
def test_process_worker_on_a_second_gpu_pushes_over_nccl_and_samples_the_thread_workers_tokens(tmp_path):
    """Training on GPU 0, rollout on GPU 1 (`trainer.device_mesh.rollout`): the process worker's weights link is NCCL
    (buckets from GPU 0 into the worker model's tensors on GPU 1), and it samples what the thread worker does."""
    mesh = {"actor": [0], "rollout": [1]}
    thread = gpu_trainer(tmp_path / "thread", "cuda", trainer__device_mesh=mesh).train()
    trainer = gpu_trainer(tmp_path / "process", "cuda", trainer__device_mesh=mesh, trainer__rollout_worker="process")
    process = trainer.train()
    assert trainer.pipeline.worker.push_link[0] == "nccl"
    assert [row["rollout/staleness_max"] for row in process] == [0.0, 1.0, 1.0, 1.0]
    assert process[-1]["perf/weight_broadcast_s"] > 0
    assert_same_tokens(process, thread)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_partial_rollout_takes_weights_over_mid_batch_on_cuda(tmp_path, monkeypatch):
    """The engine (CUDA graphs reading the model's own tensors) continues a batch under weights loaded between two
    of its segments: each sequence's first token is version 0, the other three version 1."""
    from test_async_partial import forced_takeover

    forced_takeover(monkeypatch)
    history = gpu_trainer(tmp_path, "cuda", trainer__total_steps=3, trainer__partial_rollout="continue",
                          rollout__ignore_eos=True).train()
    assert [row["rollout/partial_takeovers"] for row in history] == [0.0, 1.0, 0.0]
    assert history[1]["rollout/staleness_token_mean"] == 0.25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_engines_captures_leave_the_default_generator_to_a_thread_that_draws(tmp_path):
    """Another thread draws from the default CUDA generator (dropout, as a LoRA adapter's in the trainer's forward)
    in a loop, holding the capture lock per draw as the trainer holds it while training, while the engine captures
    its decode graphs here: no draw fails ("Offset increment outside graph capture"), and the engine samples the
    tokens it samples with nobody drawing (its graphs name a generator of its own, and draw nothing)."""
    backend = gpu_trainer(tmp_path, "cuda").parts.rollout
    prompts = [[10 + index, 11, 12] for index in range(6)]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    alone = [generation.token_ids for generation in backend.generate(prompts, params)]
    stop, errors, draws = threading.Event(), [], [0]

    def draw() -> None:
        values = torch.ones(4096, device="cuda")
        while not stop.is_set():
            try:
                with CAPTURE_LOCK:
                    torch.nn.functional.dropout(values, 0.1, training=True)
            except RuntimeError as error:
                errors.append(str(error))
                return
            draws[0] += 1

    drawing = threading.Thread(target=draw)
    drawing.start()
    try:
        together = []
        for _ in range(3):  # nothing kept between the calls (`kept_runs.py`): each captures its graphs again
            backend.release_memory(keep_small=False)
            together.append([generation.token_ids for generation in backend.generate(prompts, params)])
    finally:
        stop.set()
        drawing.join()
    assert errors == [] and draws[0] > 0
    assert backend.last_stats.get("graphs_captured", 0) > 0  # every call captured its graphs anew
    assert all(tokens == alone for tokens in together)


def test_the_trainer_holds_the_capture_lock_only_when_it_draws_beside_a_thread_workers_captures():
    def trainer(device: str, rollout: str, dropout: float):
        actor, _ = tiny_actor()
        actor.model.layers[0].mlp.add_module("adapter_dropout", torch.nn.Dropout(dropout))  # as a LoRA adapter's
        config = SimpleNamespace(trainer=SimpleNamespace(device_mesh=None, rollout_device=rollout))
        return SimpleNamespace(config=config, parts=SimpleNamespace(device=torch.device(device), actor=actor,
                                                                   critic=None))

    assert not draws_random_numbers(tiny_actor().model)  # hybridrl's models draw nothing by themselves
    assert draws_random_numbers(trainer("cpu", "", 0.1).parts.actor)
    assert draws_beside_captures(trainer("cuda:0", "", 0.1), RolloutWorker)
    assert draws_beside_captures(trainer("cuda:1", "cuda:1", 0.1), RolloutWorker)
    assert not draws_beside_captures(trainer("cuda:0", "", 0.0), RolloutWorker)  # nothing drawn
    assert not draws_beside_captures(trainer("cuda:0", "cuda:1", 0.1), RolloutWorker)  # another GPU's generator
    assert not draws_beside_captures(trainer("cuda:0", "", 0.1), ProcessWorker)  # captures in another process
    assert not draws_beside_captures(trainer("cpu", "", 0.1), RolloutWorker)  # no graphs on the CPU


def test_a_trainer_that_draws_beside_captures_updates_holding_the_capture_lock(tmp_path, monkeypatch):
    from hybridrl.training import async_pipeline

    monkeypatch.setattr(async_pipeline, "draws_beside_captures", lambda trainer, worker_class: True)  # as on a GPU
    trainer = make_trainer(tmp_path, trainer__total_steps=2, trainer__max_staleness=1)
    update, held = trainer.update, []

    def free_elsewhere() -> bool:  # whether another thread (the worker's) could take the lock now
        taken = []

        def try_it() -> None:
            taken.append(CAPTURE_LOCK.acquire(blocking=False))
            if taken[0]:
                CAPTURE_LOCK.release()

        other = threading.Thread(target=try_it)
        other.start()
        other.join()
        return taken[0]

    def update_and_look(batch):
        held.append(not free_elsewhere())
        return update(batch)

    trainer.update = update_and_look
    trainer.train()
    assert held == [True, True] and free_elsewhere()
