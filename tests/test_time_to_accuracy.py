"""benchmarks/time_to_accuracy.py: its targets, times and ratios on curves worked out by hand, and the whole flow on
CPU with a tiny model (without TRL, and with it where /tmp/trl-venv exists)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import time_to_accuracy as tta

ROOT = Path(__file__).resolve().parent.parent
TRL_PYTHON = Path("/tmp/trl-venv/bin/python")


def side(accuracy: dict[int, float], seconds: dict[int, float], step_seconds: list[float]) -> dict:
    """A worker's result as its JSON comes back (keys as strings)."""
    return {"accuracy": {str(k): v for k, v in accuracy.items()},
            "seconds_at_eval": {str(k): v for k, v in seconds.items()}, "step_seconds": step_seconds}


def test_targets_times_and_ratios_by_hand():
    trl = side({0: 0.20, 5: 0.30, 10: 0.40, 15: 0.38, 20: 0.42}, {0: 0.0, 5: 5.0, 10: 10.0, 15: 15.0, 20: 20.0},
               [1.5] + [1.0] * 19)
    ours = side({0: 0.20, 5: 0.39, 10: 0.41}, {0: 0.0, 5: 1.0, 10: 2.0}, [0.6] + [0.2] * 9)
    lines, figures = tta.summary({"trl": trl, "hybridrl": ours}, samples_per_step=256)
    goals = figures["targets"]
    # TRL's final accuracy is the mean of its last 3 evaluations, 40%: a gain of 20 points, half at 30%, 90% at 38%
    assert [round(g["accuracy"], 6) for g in goals.values()] == [0.30, 0.38, 0.40]
    assert goals["50% of TRL's gain"]["trl"] == (5, 5.0) and goals["50% of TRL's gain"]["hybridrl"] == (5, 1.0)
    assert goals["90% of TRL's gain"]["trl"] == (10, 10.0) and goals["90% of TRL's gain"]["hybridrl"] == (5, 1.0)
    assert [g["ratio"] for g in goals.values()] == [5.0, 10.0, 5.0]
    # without the first steps (TRL 1.5 s, hybridrl 0.6 s): (5 - 1.5) / (1 - 0.6), (10 - 1.5) / 0.4, 8.5 / (2 - 0.6)
    assert [g["ratio_without_first_step"] for g in goals.values()] == pytest.approx([8.75, 21.25, 8.5 / 1.4])
    assert figures["steps"]["trl"] == {"steps": 20, "first_step_s": 1.5, "median_step_s": 1.0}
    assert "to 40.0% (100% of TRL's gain): trl 10.0 s (step 10), hybridrl 2.0 s (step 10): hybridrl 5.00x faster" \
        in "\n".join(lines)
    assert "step 5 (1280 samples, 1.0 s) 39.0%" in lines[2]
    assert lines[-1] == "median step: TRL / hybridrl = 5.00x (same samples per step)"


def test_a_side_that_never_reaches_a_target_has_no_ratio_and_no_gain_means_no_target():
    trl = side({0: 0.20, 5: 0.40}, {0: 0.0, 5: 5.0}, [1.0] * 5)
    ours = side({0: 0.20, 5: 0.25}, {0: 0.0, 5: 1.0}, [0.2] * 5)
    lines, figures = tta.summary({"trl": trl, "hybridrl": ours}, samples_per_step=4)
    assert figures["targets"]["100% of TRL's gain"]["hybridrl"] is None
    assert "ratio" not in figures["targets"]["100% of TRL's gain"]
    assert "hybridrl not reached" in lines[-2]
    flat = side({0: 0.20, 5: 0.20}, {0: 0.0, 5: 5.0}, [1.0] * 5)
    lines, figures = tta.summary({"trl": flat, "hybridrl": ours}, samples_per_step=4)
    assert figures["targets"] == {} and any("TRL did not gain" in line for line in lines)


def test_the_budget_leaves_each_side_its_load_time_and_evaluations():
    # 200 s left, two sides: 200 - 5 - 2 x 20 = 155 s, of which 1 / 1.3 trains
    assert tta.training_seconds(200, sides=2) == pytest.approx(155 / 1.3)
    assert tta.training_seconds(100, sides=1) == pytest.approx(75 / 1.3)


def run_tiny(tmp_path: Path, *extra: str) -> tuple[str, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(tmp_path / "out"))
    result = subprocess.run([sys.executable, "-m", "benchmarks.time_to_accuracy", "--tiny", "--out-dir",
                             str(tmp_path / "runs"), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, json.loads((tmp_path / "out" / "time_to_accuracy.json").read_text())


def test_tiny_run_without_trl_says_so_and_runs_sft_then_hybridrl(tmp_path):
    stdout, report = run_tiny(tmp_path, "--trl-python", str(tmp_path / "no-python"))
    assert "TRL skipped" in stdout and "no TRL curve" in stdout
    assert list(report["phases"]) == ["model", "sft", "hybridrl", "summary"]
    assert [point["step"] for point in report["phases"]["sft"]["curve"]] == [0, 2, 4]
    hybridrl = report["phases"]["hybridrl"]
    # --tiny evaluates every 1000th step: steps 1-3 are evaluated because the dense schedule names them
    assert set(hybridrl["accuracy"]) == {"0", "1", "2", "3"} and len(hybridrl["step_seconds"]) == 3
    assert "hybridrl: 3 steps of 4 samples" in stdout


@pytest.mark.skipif(not TRL_PYTHON.exists(), reason="TRL's venv (/tmp/trl-venv) is not on this machine")
def test_tiny_run_with_trl_gives_both_curves(tmp_path):
    stdout, report = run_tiny(tmp_path, "--trl-python", str(TRL_PYTHON))
    assert list(report["phases"]) == ["model", "sft", "trl", "hybridrl", "summary"]
    assert set(report["phases"]["trl"]["accuracy"]) == {"0", "1", "2", "3"}
    assert "trl: 3 steps of 4 samples" in stdout and "median step: TRL / hybridrl" in stdout


def test_a_worker_cut_by_the_budget_keeps_its_curve_up_to_its_last_evaluation(tmp_path, monkeypatch):
    """run_side passes the worker a partial_path; a worker killed at its timeout leaves the curve it wrote there."""
    def fake_worker(side, spec, out, trl_python):
        partial = {"side": side, "accuracy": {"0": 0.25}, "seconds_at_eval": {"0": 0.0}, "step_seconds": []}
        return [sys.executable, "-c", f"import json, time; open({spec['partial_path']!r}, 'w').write("
                                      f"json.dumps({partial!r})); time.sleep(60)"]

    monkeypatch.setattr(tta, "worker_command", fake_worker)
    result = tta.run_side("trl", {"threads": 1}, tmp_path, "python", timeout=3)
    assert result["error"] == "cut after 3 s (the run's --budget)" and result["accuracy"] == {"0": 0.25}
