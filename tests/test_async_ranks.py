"""One rollout process beside two training processes (FSDP over gloo, `trainer.num_gpus=2`,
`trainer.rollout_worker=process`): with max_staleness=0 the pipeline gives the synchronous two-process run's metrics
bitwise (the worker makes each rank's share of the prompts with that rank's seed, rank 0 hands the scored batch to
rank 1); with k=1 every version the worker generates with has the checksum of the trainer's gathered weights of
that version (the worker reports its own after each push); a reward raising in rank 0's scoring thread stops both
ranks after they save the finished steps; through the CLI (torchrun), a run killed with SIGKILL resumes exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from async_cases import learning_metrics, reward_failing_on_batch
from conftest import contains_seven, tiny_actor, toy_prompts

from hybridrl.config.schema import ConfigError
from hybridrl.data.datasets import PromptDataset
from hybridrl.parallel import weight_push
from hybridrl.training import rollout_process
from hybridrl.training.rollout_process import free_port
from hybridrl.training.async_pipeline import AsyncPipeline
from hybridrl.training.trainer import RLTrainer

SETTINGS = dict(rollout__max_new_tokens=4, rollout__num_samples_per_prompt=4, trainer__prompts_per_step=4,
                actor__micro_batch_size=8, trainer__device="cpu", logging__sinks=["jsonl"], trainer__save_model=False,
                actor__lr=1e-3, trainer__hang_timeout_s=120, trainer__num_gpus=2, trainer__total_steps=3,
                trainer__rollout_worker="process")


def make_trainer(out: str, reward=contains_seven, **overrides) -> RLTrainer:
    actor = tiny_actor()
    dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
    return RLTrainer(actor=actor, reward_fn=reward, dataset=dataset,
                     **{**SETTINGS, "trainer__output_dir": out, **overrides})


def serve_and_record(port: int, job: dict) -> None:
    """The rollout process, reporting the checksum of its weights after each version it receives."""
    push, received = rollout_process.push_weights, [job["version"]]

    def push_and_record(model, source, group=None):
        metrics = push(model, source, group=group)
        received[0] += 1
        with open(os.path.join(job["config"].trainer.output_dir, f"worker_v{received[0]}.sha256"), "w") as file:
            file.write(weight_push.weights_checksum(model))
        return metrics

    rollout_process.push_weights = push_and_record
    rollout_process.serve_rollouts(port, job)


class RecordingWorker(rollout_process.ProcessWorker):
    serve = staticmethod(serve_and_record)


def run_rank(rank: int, port: int, out: str, mode: str) -> None:
    """One training rank: `sync` (the synchronous loop), `k0` (the pipeline with max_staleness=0), `k1`, or `fails`
    (k=1, the reward raising on the batch of step 3; each rank writes what it raised)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), HYBRIDRL_WATCHDOG="0")
    torch.set_num_threads(1)
    if mode == "fails":
        try:
            make_trainer(out, reward=reward_failing_on_batch(3), trainer__max_staleness=1, trainer__total_steps=4).train()
        except Exception as error:
            with open(os.path.join(out, f"error_rank{rank}.txt"), "w") as file:
                file.write(f"{type(error).__name__}: {error}")
        return
    trainer = make_trainer(out, **({"trainer__max_staleness": 1} if mode == "k1" else {}))
    if mode == "k0":
        trainer.pipeline = AsyncPipeline(trainer, 0, rollout_process.ProcessWorker)
    if mode == "k1":
        trainer.pipeline = AsyncPipeline(trainer, 1, RecordingWorker)
        push = trainer.pipeline.push

        def push_and_record(version):  # the trainer's gathered weights of each version it publishes
            metrics = push(version)
            copy = weight_push.unsharded_copy(trainer.parts.actor, trainer.parts.setup)
            if copy is not None:
                with open(os.path.join(out, f"trainer_v{version}.sha256"), "w") as file:
                    file.write(weight_push.weights_checksum(copy))
            return metrics

        trainer.pipeline.push = push_and_record
    trainer.train()


def train_two_ranks(out, mode: str) -> list[dict]:
    # spawned, not forked: a fork of a test process that earlier tests left with threads (workers, gloo loops) can
    # inherit a lock held by one of them and hang at its first step
    mp.start_processes(run_rank, args=(free_port(), str(out), mode), nprocs=2, join=True, start_method="spawn")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_one_worker_beside_two_training_processes_equals_the_synchronous_two_process_run_bitwise(tmp_path):
    synchronous = train_two_ranks(tmp_path / "sync", "sync")
    through_pipeline = train_two_ranks(tmp_path / "k0", "k0")
    assert [row["step"] for row in through_pipeline] == [1, 2, 3]
    assert any(row["reward/mean"] > 0 for row in synchronous)  # something was learned from
    expected = [{**row, "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
                for row in learning_metrics(synchronous)]
    assert learning_metrics(through_pipeline) == expected


def test_after_each_push_the_rollout_process_holds_the_trainers_gathered_weights(tmp_path):
    history = train_two_ranks(tmp_path, "k1")
    assert [row["rollout/staleness_max"] for row in history] == [0.0, 1.0, 1.0]
    pushed = sorted(path.name for path in tmp_path.glob("worker_v*.sha256"))
    assert pushed == ["worker_v1.sha256"]  # steps 1-3 need versions 0, 0, 1
    for name in pushed:
        version = name.removeprefix("worker_v").removesuffix(".sha256")
        assert (tmp_path / name).read_text() == (tmp_path / f"trainer_v{version}.sha256").read_text()
    assert (tmp_path / "trainer_v1.sha256").read_text() != (tmp_path / "trainer_v2.sha256").read_text()


def test_several_training_processes_need_the_process_worker(tmp_path):
    with pytest.raises(ConfigError, match="trainer.rollout_worker=process"):
        make_trainer(str(tmp_path), trainer__max_staleness=1, trainer__rollout_worker="thread")


def test_the_cli_runs_two_training_processes_beside_a_rollout_process(tmp_path):
    """`hybridrl train ... trainer.num_gpus=2 trainer.max_staleness=1 trainer.rollout_worker=process` through torchrun
    (bf16, FSDP, a checkpoint after every step: rank 0 saves the queued batch, rank 1 none)."""
    from test_distributed import _cli_overrides, _train

    out = tmp_path / "run"
    _train(tmp_path, [*_cli_overrides(tmp_path, out, steps=3, num_gpus=2), "trainer.max_staleness=1",
                      "trainer.rollout_worker=process", "algorithm.rollout_correction_cap=2.0"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["rollout/staleness_max"] for row in rows] == [0.0, 1.0, 1.0]
    assert all(row["actor/grad_norm"] > 0 for row in rows)
    saved = json.loads((out / "checkpoints" / "step_000002" / "trainer.json").read_text())
    assert [item["step"] for item in saved["pipeline"]["queued"]] == [3]


def test_a_reward_raising_in_rank_0s_worker_stops_every_rank_after_saving_the_finished_steps(tmp_path):
    """Rank 0 scores the worker's batches; its reward raising on the batch of step 3 is raised on both ranks (rank 1:
    the same sentence, from rank 0), which save steps 1-2 together first, as the synchronous loop does."""
    out = tmp_path / "run"
    out.mkdir()
    mp.start_processes(run_rank, args=(free_port(), str(out), "fails"), nprocs=2, join=True, start_method="spawn")
    errors = [(out / f"error_rank{rank}.txt").read_text() for rank in (0, 1)]
    assert all(error.startswith("RewardError") and "the grader is down" in error for error in errors), errors
    assert "The 2 finished step(s) are saved" in errors[0] and "(on training rank 0)" in errors[1], errors
    saved = json.loads((out / "checkpoints" / "step_000002" / "trainer.json").read_text())
    assert saved["step"] == 2 and saved["pipeline"]["queued"] == []


SLOW_REWARD = '''
import time

def contains_seven(prompts, completions, **columns):
    time.sleep(0.3)  # steps long enough to be killed between two checkpoints
    return [float("7" in c) for c in completions]
'''


def test_kill_9_of_every_process_and_resume_equals_an_uninterrupted_two_process_run(tmp_path):
    """`hybridrl train` with 2 training processes beside a rollout process (k=1, a checkpoint per step): SIGKILL to
    the launcher, torchrun, both ranks and the rollout process after the second checkpoint; the same command
    resumes from the newest complete checkpoint (with its queued batch) and gives the uninterrupted run's metrics."""
    import subprocess
    import sys
    import time

    from test_distributed import _cli_overrides, _train

    from hybridrl.parallel.launch import child_pids

    def overrides(out):
        return [*_cli_overrides(tmp_path, out, steps=5, num_gpus=2), "trainer.max_staleness=1",
                "trainer.rollout_worker=process", "algorithm.rollout_correction_cap=2.0", "trainer.keep_last_n=0"]

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    _train(tmp_path, overrides(straight))
    (tmp_path / "rewards.py").write_text(SLOW_REWARD)  # the same reward, slower (its name and values unchanged)
    launcher = subprocess.Popen([sys.executable, "-m", "hybridrl.cli", "train", str(tmp_path / "config.yaml"),
                                 *overrides(cut)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 150
    while not (cut / "checkpoints" / "step_000002" / "COMPLETE").exists():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    family, frontier = [], [launcher.pid]
    while frontier:  # the launcher, torchrun, the ranks and the rollout process
        family += frontier
        frontier = [child for pid in frontier for child in child_pids(pid)]
    for pid in family:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass  # it ended as its parent was killed
    launcher.wait()
    assert not (cut / "checkpoints" / "step_000005").exists(), "the run finished before it was killed"
    _train(tmp_path, overrides(cut))
    rows = {name: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            for name, out in (("straight", straight), ("cut", cut))}
    assert [row["step"] for row in rows["cut"]] == [1, 2, 3, 4, 5]
    assert any("perf/resume_s" in row for row in rows["cut"])  # resumed, not run again from the start
    assert learning_metrics(rows["cut"]) == learning_metrics(rows["straight"])
