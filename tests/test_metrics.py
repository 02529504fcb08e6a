"""Metric sinks: TensorBoard events and W&B offline files hold the metrics; console lines, sample table,
progress bar; `hybridrl plot` writes a PNG; missing optional packages name the extra."""

import importlib.util
import io
import json
import sys
import time

import pytest
import torch

from hybridrl.cli import main
from hybridrl.metrics.sinks import MetricsLogger

STEPS = [{"reward/mean": 0.1 * step, "actor/kl": 0.01 * step, "actor/entropy": 2.0 - 0.1 * step,
          "rollout/response_length_mean": 10 + step, "perf/tokens_per_s": 100.5 + step} for step in range(1, 7)]


def log_steps(logger, steps=STEPS, start=1):
    for step, metrics in enumerate(steps, start=start):
        logger.log(step, metrics)
    logger.close()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="tensorboard is not installed (pip install 'hybridrl[tensorboard]')")
def test_tensorboard_events_hold_the_metrics_and_resume_purges(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_steps(MetricsLogger(tmp_path, ["tensorboard"], total_steps=6))
    logger = MetricsLogger(tmp_path, ["tensorboard"], total_steps=6)  # resume from step 3: 4..6 again, changed
    logger.rewind(3, [])
    log_steps(logger, [{**m, "reward/mean": -1.0} for m in STEPS[3:]], start=4)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"reward/mean", "actor/kl", "perf/tokens_per_s"} <= set(events.Tags()["scalars"])
    rewards = {e.step: e.value for e in events.Scalars("reward/mean")}
    assert sorted(rewards) == [1, 2, 3, 4, 5, 6]
    assert rewards[2] == pytest.approx(0.2) and rewards[5] == -1.0
    assert [e.step for e in events.Scalars("actor/kl")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install 'hybridrl[wandb]')")
def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, ["wandb"], total_steps=6, num_samples_to_print=1, config={"seed": 0})
    logger.add_samples(["1+1="], ["2"], [1.0])
    log_steps(logger)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    # The offline .wandb file is a log of protobuf records; each history record carries the values as JSON text.
    # The wandb service process may still be flushing after finish(): wait until every step's values are written.
    expected = [b"reward/mean", b"perf/tokens_per_s", b"samples"] + [
        json.dumps(metrics[key]).encode() for metrics in STEPS for key in ("reward/mean", "perf/tokens_per_s")]
    deadline = time.time() + 60
    while not all(part in (records := next(runs[0].glob("*.wandb")).read_bytes()) for part in expected) \
            and time.time() < deadline:
        time.sleep(0.2)
    assert b"reward/mean" in records and b"perf/tokens_per_s" in records and b"samples" in records
    for metrics in STEPS:
        assert json.dumps(metrics["reward/mean"]).encode() in records
        assert json.dumps(metrics["perf/tokens_per_s"]).encode() in records


def test_missing_optional_sink_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'hybridrl\[wandb\]'"):
        MetricsLogger(tmp_path, ["wandb"], total_steps=1)


def test_console_lines_samples_and_progress(tmp_path, capsys, monkeypatch):
    logger = MetricsLogger(tmp_path, ["console", "jsonl"], total_steps=6, log_every=3, num_samples_to_print=2)
    logger.add_samples(["12+5=", "3+4=", "9+9="], ["17", "8\nx", "18"], [1.0, 0.0, 1.0])
    log_steps(logger)
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1/6", "3/6", "6/6"]
    assert "12+5=" in out and "8⏎x" in out and "9+9=" not in out  # only num_samples_to_print rows
    assert json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0]) == {
        "step": 1, "prompt": "12+5=", "completion": "17", "reward": 1.0}
    bar = io.StringIO()
    monkeypatch.setattr(sys, "stdout", bar)
    log_steps(MetricsLogger(tmp_path / "tty", ["console"], total_steps=6, progress=True))
    assert "6/6" in bar.getvalue() and "reward=0.6" in bar.getvalue() and "tok/s=106.5" in bar.getvalue()


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed (pip install 'hybridrl[plot]')")
def test_plot_writes_a_png(tmp_path, capsys):
    log_steps(MetricsLogger(tmp_path, ["jsonl"], total_steps=6))
    assert main(["plot", str(tmp_path)]) == 0
    png = (tmp_path / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_plot_of_a_wrong_directory_is_one_sentence_not_a_traceback(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "timing/elapsed_s": 1.0}\n')
    assert main(["plot", str(tmp_path)]) == 2
    assert "none of" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed (pip install 'hybridrl[plot]')")
def test_plot_of_an_sft_run_and_of_a_run_still_writing(tmp_path):
    """An SFT run dir gets its loss panels; a half-written last line (the run is writing it) is skipped."""
    rows = [{"step": s, "sft/loss": 2.0 / s, "sft/grad_norm": 1.0} for s in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 8, "sft/lo')
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")


def test_phase_timer_reports_each_phases_peak_memory(monkeypatch):
    """On CUDA every phase resets the allocator's peak and reads it back; the step's peak is the largest."""
    from hybridrl.training.trainer import PhaseTimer

    allocated = {"peak": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: allocated.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    timer = PhaseTimer(torch.device("cuda"))
    for phase, peak in (("rollout", 3 * 2**30), ("update", 2**30), ("rollout", 2**29)):
        with timer(phase):
            allocated["peak"] = peak
    assert timer.peak_bytes == {"rollout": 3 * 2**30, "update": 2**30}
    assert set(timer.seconds) == {"rollout", "update"}


def test_memory_growth_warning_names_a_steady_rise_once(tmp_path, capsys):
    from hybridrl.metrics.sinks import MetricsLogger, memory_growth_warning

    flat = [{"step": s, "perf/memory_held_gib": 3.0 + (0.5 if s == 1 else 0.01 * (s % 2))} for s in range(1, 40)]
    assert memory_growth_warning(flat) is None  # a first-step bump and jitter are not growth
    logger = MetricsLogger(tmp_path, ["jsonl"], total_steps=60)
    for step in range(1, 60):
        logger.log(step, {"perf/memory_held_gib": 1.0 + 0.033 * step})  # the 33 MiB-per-step leak
    out = capsys.readouterr().out
    assert out.count("GPU memory held between steps grew") == 1
    assert "from 1.10 GiB (step 3) to 2.12 GiB (step 34)" in out
