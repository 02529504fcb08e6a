"""One run per output directory: a second run is refused with the first one's pid; a dead run's lock is not."""

import os
import subprocess
import sys
import textwrap

import pytest

from hybridrl.checkpoint.run_lock import RunLockError, lock_owner, output_dir_lock

HOLD = textwrap.dedent("""
    import sys, time
    from hybridrl.checkpoint.run_lock import output_dir_lock
    with output_dir_lock(sys.argv[1]):
        print("locked", flush=True)
        time.sleep(60)
""")


def test_a_second_run_into_a_locked_directory_is_refused_naming_the_first(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockError, match=f"in use by another hybridrl run \\(pid {holder.pid} on"):
            with output_dir_lock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with output_dir_lock(tmp_path):  # the kernel released the killed process's lock: the file alone does not block
        assert f"pid {os.getpid()}" in (tmp_path / ".hybridrl.lock").read_text()
    with output_dir_lock(tmp_path):  # released at the end of the block
        pass


def test_the_launcher_holds_the_lock_for_its_workers(monkeypatch):
    monkeypatch.delenv("HYBRIDRL_WORKER", raising=False)
    assert lock_owner(0) and not lock_owner(1)
    monkeypatch.setenv("HYBRIDRL_WORKER", "1")
    assert not lock_owner(0)


def test_sft_into_a_directory_in_use_is_refused_before_loading_anything(tmp_path):
    from hybridrl.config import load_config
    from hybridrl.training.sft import run_sft

    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        config = load_config(overrides=["data.train_path=missing.jsonl", f"trainer.output_dir={tmp_path / 'out'}"])
        with pytest.raises(RunLockError, match=f"pid {holder.pid}"):
            run_sft(config)  # the missing data file is not reached: the lock is taken first
    finally:
        holder.kill()
        holder.wait()
