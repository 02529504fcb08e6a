"""benchmarks/learning_vs_trl.py without TRL: its arguments, its plan (interleaved seeds, the worker commands) and a
tiny end-to-end run of hybridrl's side."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import learning_vs_trl

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_match_the_demo_and_tiny_shrinks_everything():
    args = learning_vs_trl.parse_args([])
    assert (args.task, args.seeds, args.steps, args.prompts_per_step, args.group_size, args.lr, args.sides) == \
        ("demo", [0, 1, 2], 60, 32, 8, 3e-5, ["hybridrl", "trl"])
    tiny = learning_vs_trl.parse_args(["--tiny", "--sides", "hybridrl"])
    assert (tiny.steps, tiny.prompts_per_step, tiny.group_size, tiny.sides) == (2, 2, 2, ["hybridrl"])


@pytest.mark.parametrize("argv, message", [
    (["--sides", "hybridrl,verl"], "choose from hybridrl, trl"),
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--steps", "0"], "--steps must be at least 1"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        learning_vs_trl.parse_args(argv)
    assert message in capsys.readouterr().err


def test_dry_run_prints_interleaved_worker_commands_with_the_same_settings(capsys, tmp_path):
    learning_vs_trl.main(["--dry-run", "--seeds", "0", "1", "--out-dir", str(tmp_path), "--trl-python", "/x/python"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [("trl_learning_worker" in line, "seed\": 0" in line) for line in lines] == \
        [(False, True), (True, True), (True, False), (False, False)]  # seed 0: hybridrl first; seed 1: TRL first
    assert lines[1].startswith("/x/python -m benchmarks.trl_learning_worker")
    specs = [json.loads(line.split("--spec ")[1].split(" --out")[0].strip("'")) for line in lines]
    shared = [{k: v for k, v in spec.items() if k != "out_dir"} for spec in specs]
    assert shared[0] == shared[1] and shared[2] == shared[3]  # both sides get the same settings for a seed


def test_tiny_run_of_hybridrls_side_prints_its_table(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "benchmarks.learning_vs_trl", "--tiny", "--sides", "hybridrl",
                             "--seeds", "0", "--out-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| hybridrl | 0 |" in result.stdout and "| **hybridrl mean** |" in result.stdout
    saved = json.loads((tmp_path / "demo-tiny" / "results.json").read_text())["results"]
    assert [r["side"] for r in saved] == ["hybridrl"] and set(saved[0]["accuracy"]) == {"0", "1", "2"}
    assert len(saved[0]["reward_per_step"]) == 2


def test_hybridrl_overrides_reach_the_hybridrl_workers_spec(capsys, tmp_path):
    learning_vs_trl.main(["--dry-run", "--seeds", "0", "--sides", "hybridrl", "--out-dir", str(tmp_path),
                          "--hybridrl-overrides", "algorithm.dynamic_sampling=true"])
    line = capsys.readouterr().out.strip()
    spec = json.loads(line.split("--spec ")[1].split(" --out")[0].strip("'"))
    assert spec["hybridrl_overrides"] == ["algorithm.dynamic_sampling=true"]


def test_step_check_reports_advantage_loss_and_gradient_differences():
    import torch

    from benchmarks.learning_step_check import compare

    ours = {"scores": torch.tensor([1.0, 0.0]), "completion_mask": torch.ones(2, 3), "advantages": torch.tensor([0.5, -0.5]),
            "loss": 1.0, "gradients": {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0, 2.0])}}
    theirs = {"advantages": torch.tensor([0.5, -0.25]), "loss": 1.5,
              "gradients": {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0, 1.0])}}
    lines = compare(ours, theirs)
    assert "2 gradient tensors compared" in lines[0]
    assert "2.500e-01" in lines[1] and "hybridrl 1.000000e+00, TRL 1.500000e+00" in lines[2]
    # |(0, 1)| / |(1, 0, 0, 1)| overall; tensor b is off by 100% of its norm
    assert f"{1 / 2 ** 0.5:.3e} overall, 1.000e+00 at worst (b)" in lines[3]
