"""A rollout worker ends with its run. The thread worker's intermittent resume difference came from a worker left
running by a run stopped early: it generated the next batch after `train()` had returned, and the Hugging Face
backend's `generate` reseeds torch's default generator (one per process), so a later run's `generate` in the same
process (the resumed run) sampled other tokens. Here the bad interleaving is forced, not waited for."""

import os
import signal
import threading

from test_async_pipeline import learning_metrics, make_trainer

from hybridrl.training import async_pipeline

SETTINGS = dict(trainer__max_staleness=2, trainer__total_steps=6)


def stop_after_step(trainer, step):
    """SIGTERM from inside the update of `step`: the run stops after that step, whatever the worker is doing."""
    update = trainer.update

    def update_then_stop(batch):
        metrics = update(batch)
        if trainer.step_count == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    trainer.update = update_then_stop


def test_a_worker_held_before_its_next_batch_generates_nothing_after_its_run_stopped(tmp_path, monkeypatch):
    """The worker is held just before generating the batch of step 5 (it has version 2, pushed after step 2) until
    `train()` has returned; let go, it must not generate (the old code did, then waited for version 3 forever).
    The same trainer's next `train()` then continues from its checkpoint and gives the uninterrupted run's metrics."""
    full = make_trainer(tmp_path / "full", **SETTINGS).train()
    released, calls, late = threading.Event(), [], []
    generate_batch = async_pipeline.generate_batch

    def held_before_step_5(*args):
        calls.append(1)
        if len(calls) != 5:
            return generate_batch(*args)
        released.wait(60)
        batch = generate_batch(*args)
        late.append(batch)
        return batch

    monkeypatch.setattr(async_pipeline, "generate_batch", held_before_step_5)
    trainer = make_trainer(tmp_path / "cut", **SETTINGS)
    stop_after_step(trainer, 2)
    trainer.train()
    assert trainer.stopped_by == "SIGTERM" and trainer.step_count == 2
    worker = trainer.pipeline.worker
    released.set()
    worker.join(10)
    assert not late, "the worker of a stopped run generated a batch after its run had ended"
    assert not worker.is_alive()
    monkeypatch.undo()
    del trainer.update  # the class's again
    assert learning_metrics(trainer.train()) == learning_metrics(full)


def test_a_run_stopped_early_ends_its_rollout_process(tmp_path):
    """The process worker of a stopped run waited for a version that never came, holding its model, until the
    interpreter exited; now it is ended with the run, and the same trainer continues from its checkpoint."""
    full = make_trainer(tmp_path / "full", trainer__rollout_worker="process", **SETTINGS).train()
    trainer = make_trainer(tmp_path / "cut", trainer__rollout_worker="process", **SETTINGS)
    stop_after_step(trainer, 2)
    trainer.train()
    assert trainer.stopped_by == "SIGTERM" and trainer.step_count == 2
    assert not trainer.pipeline.worker.process.is_alive()
    del trainer.update
    assert learning_metrics(trainer.train()) == learning_metrics(full)
