"""benchmarks/master_weights.py runs on CPU in its tiny form: SFT once, both settings from that checkpoint through
the CLI, and a table with each setting's accuracy before and after RL (the GPU run gives the figures)."""

from __future__ import annotations

import json
from pathlib import Path

from test_benchmark_scripts import run_script


def test_master_weights_tiny_runs_both_settings_from_one_sft_checkpoint(tmp_path: Path):
    out = run_script(["-m", "benchmarks.master_weights", "--tiny", "--seeds", "1", "--out", str(tmp_path)], tmp_path,
                     timeout=600)
    seed_line = next(line for line in out.splitlines() if line.startswith("seed 1: "))
    results = json.loads(seed_line.removeprefix("seed 1: "))
    assert set(results) == {"default", "float32 master"}
    for result in results.values():
        assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0 and result["wall_s"] > 0
    assert results["default"]["before"] == results["float32 master"]["before"]  # one SFT start, one compute dtype
    assert (tmp_path / "seed1" / "sft" / "model").is_dir()
    for name in ("default", "float32_master"):
        assert (tmp_path / "seed1" / name / "metrics.jsonl").exists()
    assert "mean final held-out accuracy" in out and "default - float32 master" in out
