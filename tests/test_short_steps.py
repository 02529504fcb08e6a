"""benchmarks/profiling/short_steps.py: its clocks count nested work once, its --profile spec, and a --tiny run on
CPU through the built-in engine (the per-step table, the split before the first decode step, the profiles)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.profiling.short_steps import Clocks, profiled_phases

ROOT = Path(__file__).resolve().parents[1]


def test_nested_timed_calls_are_exclusive():
    clocks = Clocks()
    inner = clocks.timed("compile", lambda name: time.sleep(0.05), label=lambda args: args[0])

    def outer_work():
        time.sleep(0.02)
        inner("decode piece")

    clocks.phase = "rollout"
    clocks.timed("warm-up run", outer_work)()
    seconds, items = clocks.take()
    assert 0.05 <= seconds[("rollout", "compile")] < 0.09
    assert 0.02 <= seconds[("rollout", "warm-up run")] < 0.045  # its own 20 ms, not the 50 ms it called
    assert [item[:3] for item in items] == [("rollout", "compile", "decode piece")]  # only labelled kinds listed
    assert clocks.take() == ({}, [])


def test_profile_spec():
    assert profiled_phases("1:rollout,last:update", 8) == {(1, "rollout"), (8, "update")}
    assert profiled_phases("none", 8) == set()
    with pytest.raises(SystemExit, match="STEP:PHASE"):
        profiled_phases("1:reward", 8)


def test_tiny_run_splits_the_rollout_and_profiles_the_chosen_phases(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.profiling.short_steps", "--tiny", "--steps", "2",
                           "--profile", "1:rollout,last:update", "--out-dir", str(tmp_path / "runs")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 1 rollout: top 20 by self CPU time" in done.stdout
    assert "step 2 update: top 20 by self CPU time" in done.stdout
    assert "step 1 update: top" not in done.stdout
    report = json.loads((tmp_path / "short_steps.json").read_text())
    first, second = report["steps"]
    assert first["profiled"] == ["rollout"] and second["profiled"] == ["update"]
    assert first["engine"]["decode_steps"] == 5  # 6 new tokens: the first from the prefill
    for row in report["steps"]:
        parts = row["parts"]
        assert parts["set-up"] > 0 and parts["prefill"] > 0  # the engine ran (not the hf backend)
        assert parts["compile"] == parts["capture"] == 0  # CPU: nothing compiled, no CUDA graphs
        assert row["before_decode"] == pytest.approx(sum(parts.values()))
        assert row["rollout"] >= row["before_decode"] + row["decode"]
        assert row["update"] > 0


def test_first_step_refuses_an_unknown_variant():
    from benchmarks.profiling.first_step import VARIANTS, main

    from benchmarks.profiling.first_step import variant_settings

    with pytest.raises(SystemExit, match="unknown warm"):
        main(["--variants", "plain,fresh-jit+warm"])
    assert {"plain", "cprofile", "no-cuda-cache", "fresh-pyc", "fresh-jit", "cudnn"} <= set(VARIANTS)
    assert variant_settings("fresh-jit+cudnn+cprofile") == (
        ["trainer.cudnn_attention=true", "--cprofile-step1", "40"], {"CUDA_CACHE_PATH": "{scratch}/nv"})


def test_short_steps_loads_a_given_model_and_profiles_step_one(tmp_path):
    from benchmarks.time_to_accuracy import build_model

    build_model("tiny", "cpu", tmp_path / "model")
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.profiling.short_steps", "--tiny", "--steps", "2",
                           "--profile", "none", "--model-dir", str(tmp_path / "model"), "--cprofile-step1", "5",
                           "--out-dir", str(tmp_path / "runs")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("under cProfile, by") == 2 and "step 2 under cProfile" not in done.stdout
    assert not (tmp_path / "runs" / "tiny" / "init").exists()  # the given model, none built
