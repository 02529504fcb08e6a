"""Checkpoints resume exactly: a run killed (SIGKILL) after step k and resumed gives, for steps k+1..n,
the same metrics bitwise and the same final parameters as a run that was never interrupted; a
damaged newest checkpoint is skipped for the previous one; SIGTERM finishes the step and saves."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import contains_seven, tiny_actor, toy_prompts
from safetensors import SafetensorError

from hybridrl.checkpoint.store import CheckpointError, check_checkpoint, find_checkpoint, resolve_resume
from hybridrl.data.datasets import PromptDataset
from hybridrl.training.trainer import RLTrainer

TESTS = Path(__file__).resolve().parent
TOTAL, KILL_AFTER = 5, 3
SETTINGS = dict(rollout__max_new_tokens=4, rollout__num_samples_per_prompt=4, trainer__prompts_per_step=4,
                actor__micro_batch_size=16, trainer__device="cpu", logging__sinks=["jsonl"],
                trainer__save_model=False, trainer__total_steps=TOTAL, actor__lr=1e-2, algorithm__kl_coef=0.1,
                actor__lr_schedule="cosine", trainer__save_every=1, trainer__keep_last_n=3)

# The child process trains the same run; its reward blocks forever in step KILL_AFTER + 1, after the
# checkpoint of step KILL_AFTER is complete, so the parent kills it at a known point.
CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import torch
    from conftest import contains_seven, tiny_actor, toy_prompts
    from hybridrl.data.datasets import PromptDataset
    from hybridrl.training.trainer import RLTrainer
    calls = []
    def reward(prompts, completions, **columns):
        calls.append(1)
        if len(calls) > {kill_after}:
            time.sleep(600)
        return contains_seven(prompts, completions)
    reward.__name__ = "contains_seven"
    actor = tiny_actor()
    RLTrainer(actor=actor, reward_fn=reward, dataset=PromptDataset(toy_prompts(), actor.tokenizer, max_length=16),
              trainer__output_dir={out!r}, **{settings!r}).train()
""")


def make_trainer(out: Path, **overrides) -> RLTrainer:
    actor = tiny_actor()
    dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
    return RLTrainer(actor=actor, reward_fn=contains_seven, dataset=dataset, trainer__output_dir=str(out),
                     **{**SETTINGS, **overrides})


def comparable(history):
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in history]


def parameters(trainer):
    return [p.detach().clone() for p in trainer.parts.actor.parameters()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(output dir of a run SIGKILLed while in step KILL_AFTER + 1, (history, final parameters) of the
    uninterrupted run). The uninterrupted run trains here while the child process starts up."""
    out = tmp_path_factory.mktemp("killed")
    script = CHILD.format(tests=str(TESTS), kill_after=KILL_AFTER, out=str(out), settings=SETTINGS)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        trainer = make_trainer(tmp_path_factory.mktemp("reference"), trainer__save_every=0)
        reference = comparable(trainer.train()), parameters(trainer)
        latest = out / "checkpoints" / "latest"  # written after the step's directory is renamed into place
        deadline = time.time() + 60
        while not (latest.exists() and latest.read_text().strip() == f"step_{KILL_AFTER:06d}"):
            assert child.poll() is None, child.stdout.read().decode()
            assert time.time() < deadline, "the child never saved its checkpoint"
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    return out, reference


@pytest.fixture
def killed_run(runs):
    return runs[0]


@pytest.fixture
def reference(runs):
    return runs[1]


def copy_run(source: Path, target: Path) -> Path:
    subprocess.run(["cp", "-r", str(source), str(target)], check=True)
    return target


def resume_and_compare(out: Path, reference, expected_step: int, capsys):
    trainer = make_trainer(out)
    history = trainer.train()
    printed = capsys.readouterr().out
    assert f"resumed from {out / 'checkpoints' / f'step_{expected_step:06d}'} at step {expected_step}" in printed
    assert "perf/resume_s" in history[expected_step]  # the first step after the resume reports it
    ref_history, ref_params = reference
    assert comparable(history) == ref_history  # bitwise: == on floats, including steps 1..k from the checkpoint
    assert all(torch.equal(a, b) for a, b in zip(parameters(trainer), ref_params))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, TOTAL + 1)), "re-run steps must not be duplicated in metrics.jsonl"
    return printed


def test_sigkill_then_resume_is_exact(killed_run, reference, tmp_path, capsys):
    out = copy_run(killed_run, tmp_path / "run")
    assert [p.name for p in sorted((out / "checkpoints").glob("step_*"))] == [
        f"step_{s:06d}" for s in range(1, KILL_AFTER + 1)]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{KILL_AFTER:06d}"
    resume_and_compare(out, reference, KILL_AFTER, capsys)
    kept = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert kept == [f"step_{s:06d}" for s in range(TOTAL - 2, TOTAL + 1)]  # keep_last_n=3


@pytest.mark.parametrize("damage", ["no_marker", "truncated_weights"])
def test_damaged_newest_checkpoint_falls_back(killed_run, reference, tmp_path, capsys, damage):
    out = copy_run(killed_run, tmp_path / "run")
    newest = out / "checkpoints" / f"step_{KILL_AFTER:06d}"
    if damage == "no_marker":
        (newest / "COMPLETE").unlink()
    else:  # a write cut short; a flipped byte is caught the same way, by the checksum
        weights = next((newest / "state").glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    printed = resume_and_compare(out, reference, KILL_AFTER - 1, capsys)
    assert f"checkpoint {newest} is damaged and is skipped" in printed


def test_sigterm_finishes_step_saves_and_returns(tmp_path, capsys):
    calls = []

    def reward(prompts, completions, **columns):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return contains_seven(prompts, completions)

    actor = tiny_actor()
    trainer = RLTrainer(actor=actor, reward_fn=reward, dataset=PromptDataset(toy_prompts(), actor.tokenizer, max_length=16),
                        trainer__output_dir=str(tmp_path), **{**SETTINGS, "trainer__save_every": 0})
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or e.g. Ray's handler if a Ray test ran earlier in this process
    history = trainer.train()
    assert trainer.step_count == 2 and len(history) == 2
    assert "stopped by SIGTERM after step 2" in capsys.readouterr().out
    assert find_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step_000002"
    assert signal.getsignal(signal.SIGTERM) == before  # handlers are put back


def test_resume_off_and_bad_paths(killed_run, tmp_path):
    assert resolve_resume("off", killed_run / "checkpoints") is None
    assert resolve_resume(str(killed_run), tmp_path).name == f"step_{KILL_AFTER:06d}"
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        resolve_resume(str(tmp_path / "nowhere"), tmp_path)
    fresh = make_trainer(copy_run(killed_run, tmp_path / "run"), trainer__resume="off", trainer__total_steps=1,
                         trainer__save_every=0)
    assert [row["step"] for row in fresh.train()] == [1]


@pytest.mark.parametrize("master_weights", ["none", "float32"])
def test_bf16_lean_adamw_resume_is_exact(tmp_path, master_weights):
    """bf16 parameters train with LeanAdamW, whose `step` is a Python int (saved in numbers.json) and whose
    moments (and float32 master copy, `actor.master_weights=float32`) must stay float32 through load_state_dict:
    stopped by SIGTERM after step 2 and resumed, the run ends with the same metrics and weights as a run that
    never stopped."""
    def bf16_trainer(out: Path, reward) -> RLTrainer:
        actor = tiny_actor()
        actor.model.to(torch.bfloat16)
        dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
        return RLTrainer(actor=actor, reward_fn=reward, dataset=dataset, trainer__output_dir=str(out),
                         **{**SETTINGS, "trainer__total_steps": 3, "trainer__save_every": 0,
                            "actor__master_weights": master_weights})

    calls = []

    def stop_after_two(prompts, completions, **columns):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return contains_seven(prompts, completions)
    stop_after_two.__name__ = "contains_seven"  # the same metric names as the straight run

    straight = bf16_trainer(tmp_path / "straight", contains_seven)
    assert type(straight.parts.actor_optimizer).__name__ == "LeanAdamW"
    reference = straight.train()
    assert len(bf16_trainer(tmp_path / "stopped", stop_after_two).train()) == 2
    assert (tmp_path / "stopped" / "checkpoints" / "step_000002" / "state" / "numbers.json").is_file()
    resumed_trainer = bf16_trainer(tmp_path / "stopped", contains_seven)
    resumed = resumed_trainer.train()
    moments = next(iter(resumed_trainer.parts.actor_optimizer.state.values()))
    assert moments["exp_avg"].dtype == torch.float32 and isinstance(moments["step"], int)
    assert ("master" in moments) == (master_weights == "float32")
    assert "master" not in moments or moments["master"].dtype == torch.float32
    assert comparable(resumed) == comparable(reference)
    for a, b in zip(parameters(resumed_trainer), parameters(straight)):
        assert torch.equal(a, b)


def test_leftovers_of_cut_short_writes_are_removed_at_the_next_start(killed_run, reference, tmp_path, capsys):
    out = copy_run(killed_run, tmp_path / "run")
    root = out / "checkpoints"
    cut = root / f".tmp-step_{KILL_AFTER + 1:06d}-999" / "state"  # a write killed half-way
    cut.mkdir(parents=True)
    (cut / "part-00001.safetensors").write_bytes(b"\0" * 4096)
    (root / ".latest.tmp").write_text("step_000004")
    # Killed between the two renames that replace a checkpoint: the old copy is put back.
    newest = root / f"step_{KILL_AFTER:06d}"
    os.rename(newest, root / f".old-step_{KILL_AFTER:06d}-999")
    printed = resume_and_compare(out, reference, KILL_AFTER, capsys)
    assert f"removed 2 leftover(s) of cut-short checkpoint writes under {root}" in printed
    assert f"put back checkpoint {newest}" in printed
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]


def test_every_checkpoint_damaged_refuses_to_start_over_and_keeps_the_metrics(killed_run, tmp_path, capsys):
    out = copy_run(killed_run, tmp_path / "run")
    for directory in (out / "checkpoints").glob("step_*"):
        (directory / "COMPLETE").unlink()
    metrics = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError, match=r"every checkpoint under .* is damaged .*pass trainer.resume=off"):
        make_trainer(out).train()
    assert (out / "metrics.jsonl").read_bytes() == metrics
    assert f"checkpoint {out / 'checkpoints' / 'step_000001'} is damaged and is skipped" in capsys.readouterr().out
    assert resolve_resume("auto", tmp_path / "no_checkpoints_yet") is None  # a first run starts as before


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     SafetensorError("Error while serializing: I/O error: No space left on device")])
def test_a_full_disk_while_saving_ends_in_one_sentence_and_publishes_nothing(tmp_path, monkeypatch, failure):
    from hybridrl.checkpoint import store

    trainer = make_trainer(tmp_path, trainer__total_steps=2)
    real_save_file = store.save_file

    def save_file(tensors, path, *args, **kwargs):
        if trainer.step_count == 2 and "state" in Path(path).parts:
            raise failure
        return real_save_file(tensors, path, *args, **kwargs)

    monkeypatch.setattr(store, "save_file", save_file)
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError) as raised:
        trainer.train()
    message = str(raised.value)
    assert message.startswith(f"writing {root / 'step_000002'} failed (") and "No space left on device" in message
    assert "GiB are free there" in message and "trainer.resume=auto" in message and "\n" not in message
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # no .tmp-step_000002-*
    assert (root / "latest").read_text().strip() == "step_000001"
    assert check_checkpoint(root / "step_000001") is None
