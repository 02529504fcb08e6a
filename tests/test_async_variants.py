"""The asynchronous pipeline with the step's other rollout shapes: DAPO's dynamic sampling (several generation rounds
per step) and multi-turn episodes (`env:`), both made by the thread worker. With max_staleness=0 through the pipeline
each gives the synchronous loop's metrics bitwise (same prompts, seeds and weights, only another thread), so the
worker builds the same batch the trainer would; with k > 0 they run with batches one version old."""

import json

import pytest
from test_async_pipeline import learning_metrics, make_trainer
from test_async_stop import stop_after_step

from hybridrl.config.schema import ConfigError
from hybridrl.training.async_pipeline import AsyncPipeline, Trajectories
from hybridrl.training.rollout_process import ROLLOUT_WORKERS

DYNAMIC = dict(algorithm__dynamic_sampling=True, algorithm__dynamic_sampling_max_rounds=3, trainer__total_steps=3)


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_dynamic_sampling_through_the_pipeline_equals_the_synchronous_loop_bitwise(tmp_path, worker):
    """The process worker makes each further round when the trainer's side, having scored the last, asks for it."""
    synchronous = make_trainer(tmp_path / "sync", **DYNAMIC).train()
    assert max(row["rollout/dynamic_sampling_rounds"] for row in synchronous) > 1  # extra rounds ran, or this is moot
    trainer = make_trainer(tmp_path / "async", **DYNAMIC)
    trainer.pipeline = AsyncPipeline(trainer, max_staleness=0, worker_class=ROLLOUT_WORKERS[worker])
    through_pipeline = trainer.train()
    assert learning_metrics(through_pipeline) == [{**row, "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
                                                  for row in learning_metrics(synchronous)]


def test_dynamic_sampling_with_staleness_one_keeps_only_informative_groups_and_resumes_exactly(tmp_path):
    settings = dict(DYNAMIC, trainer__total_steps=4, trainer__max_staleness=1, algorithm__rollout_correction_cap=2.0)
    full = make_trainer(tmp_path / "full", **settings).train()
    assert [row["rollout/staleness_max"] for row in full] == [0.0, 1.0, 1.0, 1.0]
    for row in full:  # the batch holds informative groups only, whenever one was found
        assert row["rollout/dynamic_sampling_kept_groups"] > 0
        assert row["rollout/dynamic_sampling_rounds"] >= 1
    # Stopped after step 2, the checkpoint holds the batch of step 3 and the data position after all its rounds.
    cut = make_trainer(tmp_path / "cut", **settings)
    stop_after_step(cut, 2)
    cut.train()
    assert cut.stopped_by == "SIGTERM" and cut.step_count == 2
    saved = json.loads((tmp_path / "cut" / "checkpoints" / "step_000002" / "trainer.json").read_text())
    assert [item["step"] for item in saved["pipeline"]["queued"]] == [3]
    resumed = make_trainer(tmp_path / "cut", **settings).train()
    assert learning_metrics(resumed) == learning_metrics(full)


def test_dynamic_sampling_in_the_rollout_process_with_staleness_one_gives_the_thread_workers_metrics(tmp_path):
    settings = dict(DYNAMIC, trainer__total_steps=4, trainer__max_staleness=1, algorithm__rollout_correction_cap=2.0)
    thread = make_trainer(tmp_path / "thread", **settings).train()
    assert sum(row["rollout/dynamic_sampling_rounds"] for row in thread) > 4, "the test needs a refill"
    process = make_trainer(tmp_path / "process", trainer__rollout_worker="process", **settings).train()
    assert learning_metrics(process) == learning_metrics(thread)


def test_dynamic_sampling_with_several_training_processes_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match="built for one training process"):
        make_trainer(tmp_path, trainer__max_staleness=1, trainer__rollout_worker="process", trainer__num_gpus=2,
                     **DYNAMIC)


def test_trajectories_keep_their_rollout_metrics_and_columns_through_json():
    item = Trajectories.from_json({
        "step": 3, "versions": [1, 1], "indices": [4], "reward_metrics": {"reward/mean": 0.5},
        "rollout_metrics": {"rollout/turns_mean": 2.0}, "sampler_state": {"epoch": 0, "position": 8},
        "batch": {"input_ids": {"dtype": "int64", "shape": [2, 1], "values": [5, 6]},
                  "attention_mask": {"dtype": "int64", "shape": [2, 1], "values": [1, 1]},
                  "position_ids": {"dtype": "int64", "shape": [2, 1], "values": [0, 0]},
                  "response_mask": {"dtype": "float32", "shape": [2, 1], "values": [1.0, 1.0]},
                  "sampler_logp": {"dtype": "float32", "shape": [2, 1], "values": [-0.5, -0.25]},
                  "truncated": {"dtype": "bool", "shape": [2], "values": [False, True]},
                  "prompt_index": {"dtype": "int64", "shape": [2], "values": [0, 0]},
                  "columns": {"env_reward": [1.0, None], "messages": [[{"role": "user", "content": "hi"}], []]}}})
    assert item.rollout_metrics == {"rollout/turns_mean": 2.0}
    assert item.batch.columns["env_reward"] == [1.0, None]
    assert Trajectories.from_json(item.to_json()).to_json() == item.to_json()


def episode_trainer(tmp_path, **overrides):
    from test_agent_training import make_trainer as make_episode_trainer

    return make_episode_trainer(tmp_path, **{"trainer__total_steps": 3, "rollout__backend": "hf", **overrides})


@pytest.mark.parametrize("backend, worker", [("hf", "thread"), ("builtin", "thread"), ("hf", "process"),
                                             ("builtin", "process")])
def test_episodes_through_the_pipeline_equal_the_synchronous_loop_bitwise(tmp_path, backend, worker):
    """`env:` episodes generated by the worker (environment steps and all; the rollout process builds its own
    environments and tool workers) with max_staleness=0: the synchronous loop's metrics, the multi-turn ones included
    (but the engine's idle time, a clock)."""
    def learned(history):
        return [{k: v for k, v in row.items() if k != "rollout/engine_idle_s"} for row in learning_metrics(history)]

    synchronous = episode_trainer(tmp_path / "sync", rollout__backend=backend).train()
    assert all(row["rollout/turns_per_episode"] == 2.0 for row in synchronous)
    trainer = episode_trainer(tmp_path / "async", rollout__backend=backend)
    trainer.pipeline = AsyncPipeline(trainer, max_staleness=0, worker_class=ROLLOUT_WORKERS[worker])
    through_pipeline = trainer.train()
    assert learned(through_pipeline) == [{**row, "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
                                         for row in learned(synchronous)]


def test_episodes_with_staleness_one_and_dynamic_sampling_resume_exactly(tmp_path):
    """Episodes one version old, refilled by dynamic sampling, the trajectory columns queued in the checkpoint."""
    settings = dict(trainer__total_steps=4, trainer__max_staleness=1, algorithm__rollout_correction_cap=2.0,
                    algorithm__dynamic_sampling=True)
    full = episode_trainer(tmp_path / "full", **settings).train()
    assert [row["rollout/staleness_max"] for row in full] == [0.0, 1.0, 1.0, 1.0]
    assert all(row["rollout/turns_per_episode"] == 2.0 for row in full)
    assert sum(row["rollout/dynamic_sampling_rounds"] for row in full) > 4, "the test needs a refill"
    cut = episode_trainer(tmp_path / "cut", **settings)
    stop_after_step(cut, 2)
    cut.train()
    saved = json.loads((tmp_path / "cut" / "checkpoints" / "step_000002" / "trainer.json").read_text())
    assert saved["pipeline"]["queued"][0]["batch"]["columns"]["messages"]  # the episodes' conversations
    resumed = episode_trainer(tmp_path / "cut", **settings).train()
    assert learning_metrics(resumed) == learning_metrics(full)


def test_episodes_in_the_rollout_process_with_staleness_one_give_the_thread_workers_metrics(tmp_path):
    settings = dict(trainer__total_steps=3, trainer__max_staleness=1, algorithm__rollout_correction_cap=2.0)
    thread = episode_trainer(tmp_path / "thread", **settings).train()
    process = episode_trainer(tmp_path / "process", trainer__rollout_worker="process", **settings).train()
    assert [row["rollout/staleness_max"] for row in process] == [0.0, 1.0, 1.0]
    assert all(row["rollout/turns_per_episode"] == 2.0 for row in process)
    assert learning_metrics(process) == learning_metrics(thread)


def test_an_environment_raising_in_the_rollout_process_saves_the_finished_steps_and_names_its_code(tmp_path):
    """The environment is made in the rollout process; its error comes back as the step's record and stops the run
    as in the synchronous loop (the worker and the step named, the finished steps saved)."""
    import re

    from hybridrl.envs.base import EnvironmentCodeError

    with pytest.raises(EnvironmentCodeError) as caught:
        episode_trainer(tmp_path, environment="FailsLater", trainer__total_steps=4, trainer__max_staleness=1,
                        trainer__rollout_worker="process").train()
    message = str(caught.value)
    assert re.search(r"env\.py:FailsLater' raised KeyError: 'no such column'", message), message
    assert re.search(r"rollout worker \(process \d+, rank 1\) while producing the batch of step 3", message), message
    assert re.search(r"The 2 finished step\(s\) are saved", message), message
