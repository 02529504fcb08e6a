"""The asynchronous pipeline (`trainer.max_staleness`) on tiny CPU models: k = 0 through it is the synchronous loop
bitwise; k = 1 trains on batches exactly one version old, overlaps a slow reward with the update, and resumes
exactly from a checkpoint that holds its queued batches; a failing worker ends the run naming it."""

import copy
import json
import os
import signal
import threading
import time

import pytest
import torch
from async_cases import learning_metrics, reward_failing_on_batch
from conftest import contains_seven, tiny_actor, toy_prompts

from hybridrl.config.schema import ConfigError
from hybridrl.data.datasets import PromptDataset
from hybridrl.rewards import RewardError
from hybridrl.training.async_pipeline import AsyncPipeline, Trajectories, needed_version
from hybridrl.training.trainer import RLTrainer

FAST = dict(rollout__max_new_tokens=4, rollout__num_samples_per_prompt=4, trainer__prompts_per_step=8,
            actor__micro_batch_size=16, trainer__device="cpu", logging__sinks=["jsonl"], trainer__save_model=False,
            actor__lr=1e-3, trainer__hang_timeout_s=60)


def make_trainer(tmp_path, reward=contains_seven, **overrides):
    actor = tiny_actor()
    dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
    return RLTrainer(actor=actor, reward_fn=reward, dataset=dataset,
                     **{**FAST, "trainer__output_dir": str(tmp_path), **overrides})


def test_needed_version_is_k_behind_and_never_negative():
    assert [needed_version(step, 0) for step in (1, 2, 3)] == [0, 1, 2]
    assert [needed_version(step, 2) for step in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]


def test_staleness_zero_through_the_pipeline_equals_the_synchronous_loop_bitwise(tmp_path):
    synchronous = make_trainer(tmp_path / "sync", trainer__total_steps=3).train()
    trainer = make_trainer(tmp_path / "async", trainer__total_steps=3)
    trainer.pipeline = AsyncPipeline(trainer, max_staleness=0)
    through_pipeline = trainer.train()
    assert learning_metrics(through_pipeline) == [{**row, "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
                                                  for row in learning_metrics(synchronous)]
    # The worker generates with its own copy of the weights, pushed after each update: equal to the trainer's.
    worker = trainer.pipeline.worker
    assert worker.version == 2  # the batch of step 3 was generated with version 2
    assert worker.model is not trainer.parts.actor


def test_staleness_one_trains_on_batches_one_version_old_and_differs_from_synchronous(tmp_path):
    history = make_trainer(tmp_path / "a", trainer__total_steps=4, trainer__max_staleness=1,
                           algorithm__rollout_correction_cap=2.0).train()
    assert [row["rollout/staleness_max"] for row in history] == [0.0, 1.0, 1.0, 1.0]
    assert all("perf/weight_push_s" in row and "actor/rollout_correction_weight" in row for row in history)
    # From step 2 on the sampler's policy is one update behind: pi_old / pi_sampler moves away from 1.
    assert abs(history[0]["actor/rollout_correction_weight"] - 1.0) < 1e-4
    assert history[-1]["rollout/logprob_diff_mean"] > 1e-4
    # Reproducible: a second run gives the same metrics (the versions are a schedule, not a race).
    again = make_trainer(tmp_path / "b", trainer__total_steps=4, trainer__max_staleness=1,
                         algorithm__rollout_correction_cap=2.0).train()
    assert learning_metrics(again) == learning_metrics(history)


def test_the_worker_in_its_own_process_gives_the_thread_workers_metrics(tmp_path):
    """`trainer.rollout_worker=process`: a spawned process (gloo rank 1) generates; each version reaches it in a
    bucketed broadcast and the batches come back to be scored. Same schedule, same metrics as the thread."""
    settings = dict(trainer__total_steps=4, trainer__max_staleness=1, algorithm__rollout_correction_cap=2.0)
    thread = make_trainer(tmp_path / "thread", **settings).train()
    process = make_trainer(tmp_path / "process", trainer__rollout_worker="process", **settings).train()
    assert [row["rollout/staleness_max"] for row in process] == [0.0, 1.0, 1.0, 1.0]
    assert process[-1]["perf/weight_broadcast_s"] > 0  # versions 1 and 2 were broadcast (steps 3 and 4 need them)
    # Bitwise: the same tokens and the same sampler log-probs (the worker's parameters keep `requires_grad`, without
    # which some log-probs were rounded differently).
    assert learning_metrics(process) == learning_metrics(thread)


def test_a_slow_reward_overlaps_with_the_update(tmp_path):
    """The reward sleeps; with k=1 the worker generates and scores the next batch while the trainer computes
    log-probs and updates, so the trainer's wait for a batch (`timing/rollout_s`) is shorter than the worker's
    time for it by at least half of what could overlap (the trainer's own phases, or the worker's time where that
    is shorter). Without overlap the wait would be at least the worker's whole time."""
    def slow_reward(prompts, completions, **columns):
        time.sleep(0.3)
        return contains_seven(prompts, completions)

    history = make_trainer(tmp_path, reward=slow_reward, trainer__total_steps=4, trainer__max_staleness=1).train()
    later = history[1:]  # the first batch has nothing to overlap with
    assert all(row["timing/worker_reward_s"] >= 0.3 for row in later)
    waited = sum(row["timing/rollout_s"] for row in later)
    worked = [row["timing/worker_generate_s"] + row["timing/worker_reward_s"] for row in later]
    trained = [row["timing/logprobs_s"] + row["timing/advantages_s"] + row["timing/update_s"] for row in history[:-1]]
    could_overlap = sum(min(work, train) for work, train in zip(worked, trained))
    assert could_overlap > 0.05, trained  # the check below would say nothing
    assert waited < sum(worked) - 0.5 * could_overlap, (waited, worked, trained)


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_checkpoint_holds_the_queue_and_resume_equals_an_uninterrupted_run(tmp_path, worker):
    """SIGTERM (sent when the worker scores the batch of step 4, so the trainer stops after step 2 or 3, whichever it
    is in) saves a checkpoint with the batches generated ahead; resuming gives the uninterrupted run's metrics."""
    settings = dict(trainer__max_staleness=2, trainer__total_steps=6, trainer__rollout_worker=worker)
    full = make_trainer(tmp_path / "full", **settings).train()
    scored = []

    def reward_then_stop(prompts, completions, **columns):
        scored.append(1)
        if len(scored) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return contains_seven(prompts, completions)

    reward_then_stop.__name__ = "contains_seven"  # the metric's name, as in the uninterrupted run
    cut = make_trainer(tmp_path / "cut", reward=reward_then_stop, **settings)
    cut.train()
    assert cut.stopped_by == "SIGTERM" and 1 <= cut.step_count < 6
    saved = json.loads((tmp_path / "cut" / "checkpoints" / f"step_{cut.step_count:06d}" / "trainer.json").read_text())
    assert [item["step"] for item in saved["pipeline"]["queued"]] == [cut.step_count + 1, cut.step_count + 2]
    resumed = make_trainer(tmp_path / "cut", **settings).train()
    assert learning_metrics(resumed) == learning_metrics(full)


def test_resuming_with_more_steps_than_the_checkpoint_queued_for_stays_within_the_bound(tmp_path):
    make_trainer(tmp_path, trainer__max_staleness=2, trainer__total_steps=2, trainer__save_every=2).train()
    history = make_trainer(tmp_path, trainer__max_staleness=2, trainer__total_steps=4).train()
    assert [row["rollout/staleness_max"] for row in history] == [0.0, 1.0, 0.0, 1.0]


def test_trajectories_round_trip_through_json_exactly(tmp_path):
    trainer = make_trainer(tmp_path, trainer__total_steps=1, trainer__max_staleness=1)
    trainer.pipeline.start(1)
    item = trainer.pipeline.worker.wait_for(1, 60)
    again = Trajectories.from_json(item.to_json())
    for name in ("input_ids", "attention_mask", "sampler_logp", "scores", "truncated", "prompt_index"):
        first, second = getattr(item.batch, name), getattr(again.batch, name)
        assert first.dtype == second.dtype and torch.equal(first, second), name
    assert again.batch.texts == item.batch.texts and again.batch.sampling == item.batch.sampling
    assert torch.equal(again.versions, item.versions) and again.indices == item.indices


def test_a_failing_worker_ends_the_run_naming_it(tmp_path):
    def broken_reward(prompts, completions, **columns):
        raise ValueError("the grader is down")

    trainer = make_trainer(tmp_path, reward=broken_reward, trainer__total_steps=2, trainer__max_staleness=1)
    with pytest.raises(RewardError, match="the grader is down .* in the rollout worker .* batch of step 1"):
        trainer.train()


def test_a_raising_reward_in_the_worker_saves_the_finished_steps_and_the_fixed_run_resumes(tmp_path):
    """As in the synchronous loop: the reward raises on the batch of step 4, the run stops at step 4 with the
    reward's sentence after saving steps 1-3; with the reward fixed, the same command resumes at step 4."""
    settings = dict(trainer__total_steps=5, trainer__max_staleness=1)
    full = make_trainer(tmp_path / "full", **settings).train()
    with pytest.raises(RewardError, match="the grader is down .* The 3 finished step.s. are saved"):
        make_trainer(tmp_path / "cut", reward=reward_failing_on_batch(4), **settings).train()
    saved = json.loads((tmp_path / "cut" / "checkpoints" / "step_000003" / "trainer.json").read_text())
    assert saved["pipeline"]["queued"] == []  # the batch of step 4 failed: the resumed worker makes it anew
    resumed = make_trainer(tmp_path / "cut", **settings).train()
    assert learning_metrics(resumed)[:3] == learning_metrics(full)[:3] and len(resumed) == 5
    assert resumed[3]["rollout/staleness_max"] == 0.0  # made with the checkpoint's weights, newer than the schedule's


def test_a_killed_rollout_process_ends_the_run_naming_it(tmp_path):
    trainer = None

    def reward_then_kill(prompts, completions, **columns):
        os.kill(trainer.pipeline.worker.process.pid, signal.SIGKILL)
        return contains_seven(prompts, completions)

    trainer = make_trainer(tmp_path, reward=reward_then_kill, trainer__total_steps=4, trainer__max_staleness=1,
                           trainer__rollout_worker="process")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rollout worker \(process \d+, rank 1\) failed .* went away"):
        trainer.train()
    assert time.monotonic() - start < FAST["trainer__hang_timeout_s"]


def test_a_hanging_worker_ends_the_run_naming_it_within_the_hang_timeout(tmp_path):
    def stuck_reward(prompts, completions, **columns):
        time.sleep(30)
        return contains_seven(prompts, completions)

    trainer = make_trainer(tmp_path, reward=stuck_reward, trainer__total_steps=2, trainer__max_staleness=1,
                           trainer__hang_timeout_s=2)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rollout worker .* produced nothing for 2 s before the batch of step 1"):
        trainer.train()
    assert time.monotonic() - start < 2 + 10  # the bound, the worker's start-up and one poll


def test_max_staleness_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="trainer.max_staleness must be >= 0"):
        make_trainer(tmp_path, trainer__max_staleness=-1)


def test_rollout_device_cpu_is_the_run_without_it_bitwise(tmp_path):
    """`trainer.rollout_device` names the worker's device: on a CPU machine "cpu" takes the cross-device path
    (the copy placed by name, the push copied to it, batches moved back) and must change no bit."""
    settings = dict(trainer__total_steps=3, trainer__max_staleness=1, algorithm__rollout_correction_cap=2.0)
    default = make_trainer(tmp_path / "default", **settings).train()
    trainer = make_trainer(tmp_path / "cpu", trainer__rollout_device="cpu", **settings)
    placed = trainer.train()
    assert learning_metrics(placed) == learning_metrics(default)
    assert all(row["perf/weight_push_s"] >= 0 for row in placed)
    worker = trainer.pipeline.worker
    assert worker.device == torch.device("cpu") and worker.version == 1
    assert all(parameter.device == worker.device for parameter in worker.model.parameters())


@pytest.mark.parametrize("overrides, words", [
    (dict(trainer__rollout_device="cuda:7"), "is not a device this process can see"),
    (dict(trainer__rollout_device="gpu0"), "is not a device this process can see"),
    (dict(trainer__rollout_device="cpu", trainer__max_staleness=0), "trainer.max_staleness > 0"),
    (dict(trainer__rollout_device="cpu", trainer__device_mesh={"rollout": [1]}), "keep trainer.device_mesh.rollout"),
])
def test_a_rollout_device_that_cannot_work_is_refused_in_one_sentence(tmp_path, overrides, words):
    settings = {"trainer__max_staleness": 1, **overrides}
    if torch.cuda.device_count() > 7 and overrides["trainer__rollout_device"] == "cuda:7":
        pytest.skip("this machine sees a cuda:7")
    with pytest.raises(ConfigError, match="trainer.rollout_device=") as error:
        make_trainer(tmp_path, **settings)
    assert words in str(error.value)


KILLED_RUN = '''
import sys, time
sys.path.insert(0, {tests!r})
from test_async_pipeline import make_trainer
from conftest import contains_seven

def contains_seven_slowly(prompts, completions, **columns):
    time.sleep(0.2)  # steps long enough for the test to kill the run between checkpoints
    return contains_seven(prompts, completions)

contains_seven_slowly.__name__ = "contains_seven"
make_trainer({out!r}, reward=contains_seven_slowly, trainer__max_staleness=2, trainer__total_steps=8,
             trainer__save_every=1, trainer__keep_last_n=0).train()
'''


def test_kill_9_and_resume_equals_an_uninterrupted_run(tmp_path):
    """SIGKILL at an arbitrary point after the third checkpoint; the resumed run (from the newest complete
    checkpoint, with its queued batches) gives the uninterrupted run's metrics."""
    import subprocess
    import sys
    from pathlib import Path

    settings = dict(trainer__max_staleness=2, trainer__total_steps=8)
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN.format(tests=str(Path(__file__).parent), out=str(tmp_path / "cut")))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (tmp_path / "cut" / "checkpoints" / "step_000003" / "COMPLETE").exists():
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.kill()
    process.wait()
    saved = sorted(p.name for p in (tmp_path / "cut" / "checkpoints").glob("step_*"))
    assert "step_000008" not in saved, "the run finished before it was killed; nothing was tested"
    resumed = make_trainer(tmp_path / "cut", **settings).train()
    full = make_trainer(tmp_path / "full", **settings).train()
    assert learning_metrics(resumed) == learning_metrics(full)


def test_a_push_leaves_the_workers_weights_equal_to_the_trainers_in_its_own_tensors(tmp_path):
    from hybridrl.parallel.weight_push import push_tensors, weights_checksum
    from hybridrl.training.async_pipeline import RolloutWorker

    trainer = make_trainer(tmp_path, trainer__total_steps=5, trainer__max_staleness=1)
    pipeline = trainer.pipeline
    worker = RolloutWorker(trainer, 1, first_step=1, last_step=5, version=0, lock=pipeline.lock,
                           mailbox=pipeline.mailbox, model=copy.deepcopy(trainer.parts.actor))  # loaded by hand below
    pipeline.worker = worker  # what `push` publishes for (where: `worker.weights_device`)
    storages = [tensor.data_ptr() for tensor in push_tensors(worker.model)]
    assert weights_checksum(worker.model) == weights_checksum(trainer.parts.actor)
    with torch.no_grad():
        for parameter in trainer.parts.actor.parameters():
            parameter.add_(torch.randn_like(parameter) * 1e-3)  # an update
    assert weights_checksum(worker.model) != weights_checksum(trainer.parts.actor)
    trainer.step_count = 1
    pipeline.push(1)
    assert worker.load_version(1) and worker.version == 1
    assert weights_checksum(worker.model) == weights_checksum(trainer.parts.actor)
    assert storages == [tensor.data_ptr() for tensor in push_tensors(worker.model)]


def test_benchmark_script_runs_both_sides_and_prints_its_table(tmp_path, capsys):
    from benchmarks import async_pipeline

    rows = async_pipeline.main(["--out", str(tmp_path), "--steps", "2", "--seeds", "0", "--eval-samples", "4",
                                "--sft-steps", "2", "--reward-delay-s", "0.01", "--prompts", "2",
                                "--workers", "thread", "process"])
    assert [(row["side"], row["max_staleness"]) for row in rows] == [("synchronous", 0), ("thread", 1), ("process", 1)]
    assert "less wall-clock per step" in capsys.readouterr().out


def test_samples_are_shown_with_the_step_that_trains_on_them(tmp_path):
    """The worker scores ahead; the samples logged with step s (samples.jsonl) are those of the batch step s trains on,
    not of the newest one scored. Forced: step 1's update waits until the worker has scored the batch of step 3."""
    scored, third_scored = [], threading.Event()

    def recording_reward(prompts, completions, **columns):
        scored.append(list(completions))
        if len(scored) == 3:
            third_scored.set()
        return contains_seven(prompts, completions)

    trainer = make_trainer(tmp_path, reward=recording_reward, trainer__total_steps=3, trainer__max_staleness=2,
                           logging__num_samples_to_print=2)
    update = trainer.update

    def update_after_the_third_batch(batch):
        assert third_scored.wait(60)
        return update(batch)

    trainer.update = update_after_the_third_batch
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 1, 2, 2, 3, 3]
    assert [row["completion"] for row in rows] == [text for batch in scored for text in batch[:2]]


def test_held_out_evaluation_and_the_worker_never_score_at_the_same_time(tmp_path):
    """The worker scores while the trainer evaluates between steps: the rewards (a judge's engine, their per-call
    metrics) serve one call at a time. The worker's reward calls are slow, so evaluation after each step would meet
    one in flight."""
    inside, overlaps, count = [0], [], threading.Lock()

    def slow_in_the_worker(prompts, completions, **columns):
        with count:
            inside[0] += 1
            overlaps.append(inside[0])
        if threading.current_thread().name == "hybridrl-rollout-worker":
            time.sleep(0.5)
        with count:
            inside[0] -= 1
        return contains_seven(prompts, completions)

    actor = tiny_actor()
    held_out = PromptDataset(toy_prompts(8), actor.tokenizer, max_length=16)
    RLTrainer(actor=actor, reward_fn=slow_in_the_worker, eval_dataset=held_out,
              dataset=PromptDataset(toy_prompts(), actor.tokenizer, max_length=16),
              **{**FAST, "trainer__output_dir": str(tmp_path), "trainer__total_steps": 3,
                 "trainer__max_staleness": 1, "trainer__eval_every": 1}).train()
    assert len(overlaps) >= 7 and max(overlaps) == 1, overlaps  # 3 batches and 4 evaluations were scored
