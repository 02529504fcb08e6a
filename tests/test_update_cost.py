"""benchmarks/profiling/update_cost.py runs on CPU (`--tiny`) and prints what the GPU run is read for."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_run_prints_steps_first_update_and_steady_updates(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.profiling.update_cost", "--tiny", "--out-dir",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "first update, cumulative seconds per function" in out and "update_actor" in out
    assert "step 1: rollout" in out and "step 2: rollout" in out
    assert "steady update, cache kept: median" in out and "steady update, cache emptied first: median" in out
    assert "Self CPU time total" in out
