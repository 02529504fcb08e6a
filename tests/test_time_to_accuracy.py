"""benchmarks/time_to_accuracy.py: its targets, times and ratios on curves worked out by hand, and the whole flow on
CPU with a tiny model (without TRL, and with it where /tmp/trl-venv exists)."""

import json
import os
import statistics
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
    assert goals["50% of TRL's gain"]["reached"] == {"trl": (5, 5.0), "hybridrl": (5, 1.0)}
    assert goals["90% of TRL's gain"]["reached"] == {"trl": (10, 10.0), "hybridrl": (5, 1.0)}
    assert [g["ratio"] for g in goals.values()] == [{"hybridrl": 5.0}, {"hybridrl": 10.0}, {"hybridrl": 5.0}]
    # without the first steps (TRL 1.5 s, hybridrl 0.6 s): (5 - 1.5) / (1 - 0.6), (10 - 1.5) / 0.4, 8.5 / (2 - 0.6)
    assert [g["ratio_without_first_step"]["hybridrl"] for g in goals.values()] == pytest.approx([8.75, 21.25, 8.5 / 1.4])
    assert figures["steps"]["trl"] == {"steps": 20, "first_step_s": 1.5, "median_step_s": 1.0}
    # each run's own final: TRL (0.40 + 0.38 + 0.42) / 3, hybridrl's two trained evaluations (0.39 + 0.41) / 2
    assert figures["final"] == pytest.approx({"trl": 0.40, "hybridrl": 0.40})
    # the evaluations before TRL's last 3: step 5's alone (30%); hybridrl has none before its last 3
    assert figures["final_before"] == {"trl": pytest.approx(0.30), "hybridrl": None}
    assert "to 40.0% (100% of TRL's gain): trl 10.0 s (step 10), hybridrl 2.0 s (step 10): hybridrl 5.00x faster" \
        in "\n".join(lines)
    assert "step 5 (1280 samples, 1.0 s) 39.0%" in lines[2]
    assert "hybridrl: final 40.0% (mean of its last 3 evaluations), best 41.0%, from 20.0% at step 0" in lines
    assert "trl: final 40.0% (mean of its last 3 evaluations; the 3 before them 30.0%), best 42.0%, from 20.0% at " \
           "step 0" in lines
    assert lines[-1] == "median step: TRL / hybridrl = 5.00x (same samples per step)"


def test_a_side_that_never_reaches_a_target_has_no_ratio_and_no_gain_means_no_target():
    trl = side({0: 0.20, 5: 0.40}, {0: 0.0, 5: 5.0}, [1.0] * 5)
    ours = side({0: 0.20, 5: 0.25}, {0: 0.0, 5: 1.0}, [0.2] * 5)
    lines, figures = tta.summary({"trl": trl, "hybridrl": ours}, samples_per_step=4)
    assert figures["targets"]["100% of TRL's gain"]["reached"]["hybridrl"] is None
    assert figures["targets"]["100% of TRL's gain"]["ratio"] == {}
    assert "hybridrl not reached" in lines[-2]
    flat = side({0: 0.20, 5: 0.20}, {0: 0.0, 5: 5.0}, [1.0] * 5)
    lines, figures = tta.summary({"trl": flat, "hybridrl": ours}, samples_per_step=4)
    assert figures["targets"] == {} and any("TRL did not gain" in line for line in lines)


def test_every_arm_gets_its_ratio_and_the_seeds_their_median_and_range():
    """Two seeds, two hybridrl arms; the master32 arm misses TRL's final in seed 1, so that ratio covers one seed."""
    per_seed = {}
    for seed, (trl_half, ours_half, master_half) in enumerate([(4.0, 1.0, 2.0), (6.0, 3.0, 1.5)]):
        trl = side({0: 0.2, 5: 0.3, 10: 0.4}, {0: 0.0, 5: trl_half, 10: 2 * trl_half}, [1.0] * 10)
        ours = side({0: 0.2, 5: 0.3, 10: 0.4}, {0: 0.0, 5: ours_half, 10: 2 * ours_half}, [0.1] * 10)
        master = side({0: 0.2, 5: 0.3, 10: 0.4 if seed == 0 else 0.35}, {0: 0.0, 5: master_half, 10: 2 * master_half},
                      [0.2] * 10)
        per_seed[seed] = tta.summary({"trl": trl, "hybridrl": ours, "hybridrl-master32": master}, 4)[1]
    # TRL's final is (0.3 + 0.4) / 2 = 0.35 in both seeds, half its gain 0.275: reached at step 5 by every run
    half = "50% of TRL's gain"
    assert per_seed[0]["targets"][half]["ratio"] == {"hybridrl": 4.0, "hybridrl-master32": 2.0}
    assert per_seed[1]["targets"][half]["ratio"] == {"hybridrl": 2.0, "hybridrl-master32": 4.0}
    # the final target (0.35) at step 10 by TRL and hybridrl; master32 reaches 0.35 at step 10 of seed 1 too
    assert per_seed[1]["targets"]["100% of TRL's gain"]["reached"]["hybridrl-master32"] == (10, 3.0)
    lines, figures = tta.across_seeds(per_seed)
    assert figures["targets"][half]["ratio"]["hybridrl"] == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 2}
    assert figures["targets"][half]["ratio"]["hybridrl-master32"] == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 2}
    assert figures["final"]["hybridrl-master32"] == pytest.approx({"median": 0.3375, "min": 0.325, "max": 0.35, "n": 2})
    assert figures["step_ratio"]["hybridrl"] == pytest.approx({"median": 10.0, "min": 10.0, "max": 10.0, "n": 2})
    assert "to 50% of TRL's gain: hybridrl 3.00x (median of 2; 2.00-4.00) faster; hybridrl-master32 3.00x" \
           " (median of 2; 2.00-4.00) faster" in lines
    assert "hybridrl-master32's final accuracy: 33.8% (median of 2; 32.5-35.0)" in lines
    missed = dict(per_seed)
    missed[1] = {**per_seed[1], "targets": {half: {"ratio": {"hybridrl": 2.0}, "ratio_without_first_step": {}}}}
    lines, figures = tta.across_seeds(missed)
    assert figures["targets"][half]["ratio"]["hybridrl-master32"] == {"median": 2.0, "min": 2.0, "max": 2.0, "n": 1}
    assert "hybridrl-master32 2.00x faster (reached it in 1 of 2 seeds)" in lines[0]
    missed[0] = {**per_seed[0], "targets": {half: {"ratio": {"hybridrl": 4.0}, "ratio_without_first_step": {}}}}
    assert "hybridrl-master32 reached it in none of 2 seeds" in tta.across_seeds(missed)[0][0]


def test_the_budget_leaves_each_side_its_load_time_and_evaluations():
    # 200 s left, two sides: 200 - 5 - 2 x 12 = 171 s, of which 1 / 1.3 trains
    assert tta.training_seconds(200, sides=2) == pytest.approx(171 / 1.3)
    assert tta.training_seconds(100, sides=1) == pytest.approx(83 / 1.3)


def test_a_short_budget_cuts_every_queued_run_alike():
    # 200 s left for runs wanting 60, 30, 30: (200 - 5 - 36) / 1.3 = 122.3 s for 120 wanted: ample
    assert tta.fitted_seconds([60, 30, 30], 200) == 60
    # 150 s: (150 - 5 - 36) / 1.3 = 83.8 s for 120 wanted, so 60 x 83.8 / 120
    assert tta.fitted_seconds([60, 30, 30], 150) == pytest.approx(60 * (109 / 1.3) / 120)
    assert tta.fitted_seconds([30, 30], 1000) == 30  # room enough: what it wants
    assert tta.fitted_seconds([30, 30], 20) == 0  # not even the loads fit


def fake_worker_results(calls: list):
    """A run_side that records each run and returns a made-up curve: TRL reaches 50%, each hybridrl arm 75%."""
    def run_side(worker, name, spec, out, trl_python, timeout, start_caches=None):
        calls.append((spec["seed"], worker, name, spec["max_seconds"], spec.get("target_accuracy"),
                      spec["hybridrl_overrides"]))
        top = 0.5 if worker == "trl" else 0.75
        return side({0: 0.25, 5: top, 10: top}, {0: 0.0, 5: 5.0, 10: 10.0}, [1.0] * 10)
    return run_side


def test_seeds_run_trl_first_then_each_arm_stopping_at_that_seeds_trl_final(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(tta, "run_side", fake_worker_results(calls))
    args = tta.parse_args(["--seeds", "2", "--hybridrl-variants", "default,master32", "--budget", "1000",
                           "--trl-seconds", "60", "--hybridrl-seconds", "30", "--hybridrl-overrides", "a=1"])
    results = tta.run_seeds(args, {"threads": 1}, tmp_path, tta.Run(args, tmp_path), has_trl=True)
    final = 0.5  # TRL's final: the mean of its evaluations after step 0 (50% at steps 5 and 10)
    assert calls == [(seed, worker, name, seconds, target, overrides) for seed in (0, 1) for worker, name, seconds,
                     target, overrides in [("trl", "trl", 60, None, []), ("hybridrl", "hybridrl", 30, final, ["a=1"]),
                                           ("hybridrl", "hybridrl-master32", 30, final,
                                            ["a=1", "actor.master_weights=float32"])]]
    assert list(results) == [0, 1] and list(results[1]) == ["trl", "hybridrl", "hybridrl-master32"]
    assert "seed 1 hybridrl-master32: up to 30 s of training, stopping at TRL's final accuracy 50.0%" \
        in capsys.readouterr().out


def test_runs_the_budget_cannot_hold_are_cut_with_a_line_and_skipped_below_5_seconds(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(tta, "run_side", fake_worker_results(calls))
    # 100 s for 4 runs wanting 110 + 70 twice: (100 - 5 - 48) / 1.3 = 36.2 s for 360 wanted, each cut to 10%
    args = tta.parse_args(["--seeds", "2", "--budget", "100", "--trl-seconds", "110", "--hybridrl-seconds", "70"])
    tta.run_seeds(args, {"threads": 1}, tmp_path, tta.Run(args, tmp_path), has_trl=True)
    # the fake runs take no time, so the next run shares the same 100 s with the two after it: (100 - 41) / 1.3 for
    # 70 + 110 + 70 wanted
    assert [call[3] for call in calls[:2]] == pytest.approx([110 * (47 / 1.3) / 360, 70 * (59 / 1.3) / 250], rel=1e-3)
    assert "seed 0 trl: up to 11 s of training (cut from 110 s: 100 s left for 4 runs)" in capsys.readouterr().out
    calls.clear()
    # (36 - 29) / 1.3 = 5.4 s for 110 + 70 wanted: TRL's 3.3 s is under 5 s, so it is skipped
    args = tta.parse_args(["--seeds", "1", "--budget", "36", "--trl-seconds", "110", "--hybridrl-seconds", "70"])
    tta.run_seeds(args, {"threads": 1}, tmp_path, tta.Run(args, tmp_path), has_trl=True)
    assert "seed 0 trl: skipped, 36 s left for 2 runs (raise --budget)" in capsys.readouterr().out
    # then hybridrl alone: (36 - 17) / 1.3 = 14.6 s for its 70 wanted, over 5 s: it runs, with no TRL target
    assert [call[2:5] for call in calls] == [("hybridrl", pytest.approx(19 / 1.3, rel=1e-3), None)]


def test_variants_and_seeds_are_checked():
    for argv, message in ((["--hybridrl-variants", "default,fp8"], "fp8"), (["--seeds", "0"], "--seeds"),
                          (["--hybridrl-variants", "default,default"], "named twice")):
        with pytest.raises(SystemExit):
            tta.parse_args(argv)


def run_tiny(tmp_path: Path, *extra: str) -> tuple[str, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(tmp_path / "out"))
    result = subprocess.run([sys.executable, "-m", "benchmarks.time_to_accuracy", "--tiny", "--out-dir",
                             str(tmp_path / "runs"), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, json.loads((tmp_path / "out" / "time_to_accuracy.json").read_text())


def test_tiny_run_without_trl_says_so_and_runs_sft_then_each_seed_and_arm(tmp_path):
    stdout, report = run_tiny(tmp_path, "--trl-python", str(tmp_path / "no-python"), "--seeds", "2",
                              "--hybridrl-variants", "default,master32")
    assert "TRL skipped" in stdout and "no TRL curve" in stdout
    runs = [f"seed{seed}/{arm}" for seed in (0, 1) for arm in ("hybridrl", "hybridrl-master32")]
    assert list(report["phases"]) == ["model", "sft", *runs, "summary"]
    assert [point["step"] for point in report["phases"]["sft"]["curve"]] == [0, 2, 4]
    for run in runs:
        # --tiny evaluates every 1000th step: steps 1-3 are evaluated because the dense schedule names them
        result = report["phases"][run]
        assert set(result["accuracy"]) == {"0", "1", "2", "3"} and len(result["step_seconds"]) == 3
    summary = report["phases"]["summary"]
    for arm in ("hybridrl", "hybridrl-master32"):
        finals = [summary["seeds"][seed]["final"][arm] for seed in ("0", "1")]
        # each seed's final is the mean of its run's last 3 evaluations; over the seeds their median and range
        assert finals == [pytest.approx(sum(report["phases"][f"seed{seed}/{arm}"]["accuracy"][step]
                                            for step in "123") / 3) for seed in (0, 1)]
        assert summary["final"][arm] == pytest.approx({"median": sum(finals) / 2, "min": min(finals),
                                                       "max": max(finals), "n": 2})
    assert "-- seed 1" in stdout and "-- over 2 seeds" in stdout and "hybridrl-master32: 3 steps of 4 samples" in stdout


@pytest.mark.skipif(not TRL_PYTHON.exists(), reason="TRL's venv (/tmp/trl-venv) is not on this machine")
def test_tiny_run_with_trl_gives_both_curves_per_seed_and_their_step_ratios(tmp_path):
    stdout, report = run_tiny(tmp_path, "--trl-python", str(TRL_PYTHON), "--seeds", "2")
    runs = [f"seed{seed}/{side}" for seed in (0, 1) for side in ("trl", "hybridrl")]
    assert list(report["phases"]) == ["model", "sft", *runs, "summary"]
    assert set(report["phases"]["seed1/trl"]["accuracy"]) == {"0", "1", "2", "3"}
    summary = report["phases"]["summary"]
    ratios = []
    for seed in (0, 1):  # each seed's step ratio from its runs' own step times: TRL's median / hybridrl's
        median = {side: statistics.median(report["phases"][f"seed{seed}/{side}"]["step_seconds"][1:])
                  for side in ("trl", "hybridrl")}
        ratios.append(median["trl"] / median["hybridrl"])
        assert summary["seeds"][str(seed)]["step_ratio"]["hybridrl"] == pytest.approx(ratios[-1])
    assert summary["step_ratio"]["hybridrl"] == pytest.approx({"median": sum(ratios) / 2, "min": min(ratios),
                                                              "max": max(ratios), "n": 2})
    assert "trl: 3 steps of 4 samples" in stdout and "median step: TRL / hybridrl = " in stdout


def test_a_worker_cut_by_the_budget_keeps_its_curve_up_to_its_last_evaluation(tmp_path, monkeypatch):
    """run_side passes the worker a partial_path; a worker killed at its timeout leaves the curve it wrote there."""
    def fake_worker(side, spec, out, trl_python):
        partial = {"side": side, "accuracy": {"0": 0.25}, "seconds_at_eval": {"0": 0.0}, "step_seconds": []}
        return [sys.executable, "-c", f"import json, os, time; open({spec['partial_path']!r}, 'w').write(json.dumps("
                                      f"{{**{partial!r}, 'caches': os.environ['TRITON_CACHE_DIR']}})); time.sleep(60)"]

    monkeypatch.setattr(tta, "worker_command", fake_worker)
    stale, built = tmp_path / "trl_caches" / "triton" / "stale", tmp_path / "after_sft" / "triton" / "built"
    stale.mkdir(parents=True)
    built.mkdir(parents=True)
    result = tta.run_side("trl", "trl", {"threads": 1}, tmp_path, "python", timeout=3,
                          start_caches=tmp_path / "after_sft")
    assert result["error"] == "cut after 3 s (the run's --budget)" and result["accuracy"] == {"0": 0.25}
    # each run's own Triton cache: what the SFT built, nothing an earlier run left
    assert result["caches"] == str(tmp_path / "trl_caches" / "triton")
    assert (tmp_path / "trl_caches" / "triton" / "built").is_dir() and not stale.exists()
