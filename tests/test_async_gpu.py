"""The rollout workers on a GPU (run with `pytest -m gpu`): the built-in engine makes its KV cache, compiled decode
and CUDA graphs on the thread worker's thread; a run stopped by SIGTERM ends its worker and resumes like one that
never stopped. The process worker on the trainer's GPU (its pushes staged through the CPU over gloo) samples the
thread worker's tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import contains_seven, tiny_actor, toy_prompts
from test_async_pipeline import FAST, learning_metrics
from test_async_stop import stop_after_step

from hybridrl.data.datasets import PromptDataset
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
