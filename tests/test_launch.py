"""Launching and supervising workers: torchrun relaunch, hang detection naming the rank, the Ray launcher.

The Ray tests start a local Ray cluster on the CPU (two workers, gloo) and are skipped when Ray is not
installed (`pip install 'hybridrl[ray]'`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from hybridrl.parallel import launch, process_group, watchdog
from hybridrl.parallel.launch import LaunchError, rank_environments
from hybridrl.parallel.watchdog import find_stalled

HANG_SCRIPT = """
import os, sys, time, torch
from hybridrl.parallel import process_group, watchdog
setup = process_group.init_from_env("cpu", timeout_s=60, hang_timeout_s=2.0)
for step in range(200):
    watchdog.heartbeat()
    if setup.rank == 1 and step == 3:
        time.sleep(120)  # a reward function that never returns
    process_group.all_reduce(torch.ones(1), setup)
    time.sleep(0.05)
"""


def test_watchdog_stop_waits_for_the_store_call_in_flight():
    """`stop` returns only once the thread is out of its store call (a daemon thread left inside TCPStore's
    C++ code at interpreter exit can abort the process)."""
    import threading
    import time

    from hybridrl.parallel.watchdog import Watchdog

    class SlowStore:
        def __init__(self):
            self.entered, self.values = threading.Event(), {}

        def set(self, key, value):
            self.entered.set()
            time.sleep(0.3)  # the call in flight when stop() comes
            self.values[key] = value

        def check(self, keys):
            return all(key in self.values for key in keys)

        def get(self, key):
            return self.values[key].encode()

    store = SlowStore()
    watchdog = Watchdog(store, rank=0, world_size=1, timeout_s=60.0, interval_s=0.01, on_stall=lambda message: None)
    watchdog.start()
    assert store.entered.wait(5.0)
    watchdog.stop()
    assert not watchdog.is_alive() and "0" in store.values


def test_find_stalled_blames_the_rank_outside_the_collective():
    counts, changed = {0: 5, 1: 5, 2: 4}, {0: 0.0, 1: 0.0, 2: 0.0}
    assert find_stalled(counts, changed, now=5.0, timeout_s=10.0) is None
    message = find_stalled(counts, changed, now=11.0, timeout_s=10.0, waiting={0: True, 1: True, 2: False})
    assert message.startswith("rank 2 made no progress for 11 s") and "rank 0, 1 wait(s) for it" in message
    everyone = find_stalled(counts, changed, now=11.0, timeout_s=10.0, waiting={0: True, 1: True, 2: True})
    assert everyone.startswith("every rank has waited in a collective")
    assert find_stalled({0: 5, 1: 9}, {0: 0.0, 1: 10.5}, now=11.0, timeout_s=10.0, waiting={0: True}) is None


def test_rank_environments_two_nodes_with_gpus():
    envs = rank_environments([("10.0.0.1", ["3"]), ("10.0.0.1", ["1"]), ("10.0.0.2", ["0"])], master_port=29500)
    assert [env["RANK"] for env in envs] == ["0", "1", "2"]
    assert all(env["MASTER_ADDR"] == "10.0.0.1" and env["WORLD_SIZE"] == "3" for env in envs)
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "3,1" and envs[0]["LOCAL_RANK"] == "0"
    assert envs[1]["LOCAL_RANK"] == "1" and envs[2]["LOCAL_RANK"] == "0" and envs[2]["LOCAL_WORLD_SIZE"] == "1"


def test_relaunch_only_from_the_launching_process(monkeypatch):
    assert launch.maybe_relaunch(["train", "x.yaml"], num_processes=1) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launch.maybe_relaunch(["train", "x.yaml"], num_processes=2) is None  # already a worker
    command = launch.torchrun_command(["train", "x.yaml", "trainer.num_gpus=2"], 2)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert command[-5:] == ["-m", "hybridrl.cli", "train", "x.yaml", "trainer.num_gpus=2"]
    with pytest.raises(ValueError, match="torchrun or ray"):
        monkeypatch.delenv("WORLD_SIZE")
        launch.maybe_relaunch(["train"], num_processes=2, launcher="slurm")


def test_torchrun_hang_ends_the_run_naming_the_rank(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script)], capture_output=True, text=True, timeout=90,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "hybridrl: rank 1 made no progress" in result.stderr, result.stderr[-3000:]
    assert "rank 0 wait(s) for it in a collective" in result.stderr
    assert time.monotonic() - start < 60


def test_root_failure_names_the_rank_that_died_not_its_peers():
    """When rank 1 dies, rank 0's collective fails too and its error may reach the driver first."""

    class Died(Exception):
        pass

    peer_error, death = RuntimeError("Connection closed by peer"), Died("the actor died unexpectedly")
    assert launch.root_failure({0: peer_error, 1: death}, (Died,)) == (1, death)
    assert launch.root_failure({2: peer_error, 1: ValueError("bad reward")}, (Died,))[0] == 1


# ----------------------------------------------------------------------------------------------
# Ray (local cluster on the CPU)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'hybridrl[ray]')")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def ray_job(mode: str) -> tuple[int, int, float]:
    setup = process_group.init_from_env("cpu", timeout_s=60)
    total = torch.zeros(1)
    for _ in range(5):
        watchdog.heartbeat()
        if setup.rank == 1 and mode == "die":
            os._exit(3)
        if setup.rank == 1 and mode == "hang":
            time.sleep(120)
        total = process_group.all_reduce(torch.tensor([setup.rank + 1.0]), setup)
    process_group.shutdown(setup)
    return setup.rank, setup.world_size, total.item()


def test_ray_two_workers_form_one_job(ray_cluster):
    results = launch.run_ray(ray_job, ("ok",), 2, use_gpu=False, hang_timeout_s=20, startup_grace_s=180)
    assert results == [(0, 2, 3.0), (1, 2, 3.0)]


def test_ray_dead_worker_is_named(ray_cluster):
    with pytest.raises(LaunchError, match=r"rank 1 of 2 failed: .*died"):
        launch.run_ray(ray_job, ("die",), 2, use_gpu=False, hang_timeout_s=20, startup_grace_s=180)


def test_ray_hung_worker_is_named_within_the_timeout(ray_cluster):
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 made no progress for [0-9]+ s .*rank 0 wait\(s\) for it"):
        launch.run_ray(ray_job, ("hang",), 2, use_gpu=False, hang_timeout_s=3, startup_grace_s=30)
    assert time.monotonic() - start < 25


# ----------------------------------------------------------------------------------------------
# Bounds: the watchdog fires before any collective times out, and before the start-up grace ends


def test_the_collective_timeout_stays_above_the_watchdogs_bounds(monkeypatch):
    assert watchdog.collective_timeout_s(900.0) == 900.0 + watchdog.COLLECTIVE_MARGIN_S  # gloo's 600 s was below
    assert watchdog.collective_timeout_s(30.0) == watchdog.STARTUP_GRACE_S + watchdog.COLLECTIVE_MARGIN_S
    assert watchdog.collective_timeout_s(30.0, at_least=5000.0) == 5000.0
    seen = {}

    class Idle:
        def start(self):
            pass

        def stop(self):
            pass

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(process_group.dist, "init_process_group", lambda backend, timeout, **kw: seen.update(t=timeout))
    monkeypatch.setattr("torch.distributed.device_mesh.init_device_mesh", lambda *args, **kwargs: None)
    monkeypatch.setattr(process_group.Watchdog, "from_env", classmethod(lambda cls, *args, **kwargs: Idle()))
    process_group.init_from_env("cpu", hang_timeout_s=900.0)
    assert seen["t"].total_seconds() == 960.0
    monkeypatch.setenv("HYBRIDRL_WATCHDOG", "0")  # a Ray worker: the driver's watchdog has the same bounds
    process_group.init_from_env("cpu", timeout_s=600.0, hang_timeout_s=900.0)
    assert seen["t"].total_seconds() == 960.0
    process_group.init_from_env("cpu", timeout_s=600.0, hang_timeout_s=None)  # no hang detection: as asked
    assert seen["t"].total_seconds() == 600.0


def test_the_first_heartbeat_clock_starts_when_another_rank_starts_training():
    assert watchdog.first_heartbeat_clock(100.0, 600.0, None) == 700.0  # nobody trains yet: model loading
    assert watchdog.first_heartbeat_clock(100.0, 600.0, 130.0) == 130.0
    assert watchdog.first_heartbeat_clock(100.0, 600.0, 900.0) == 700.0
    message = find_stalled({0: 12, 1: 0}, {0: 140.0, 1: 130.0}, now=140.0, timeout_s=5.0, waiting={0: True})
    assert message.startswith("rank 1 made no progress for 10 s (before its first heartbeat")


STOPPED_BEFORE_FIRST_HEARTBEAT = """
import time, torch
from hybridrl.parallel import process_group, watchdog
setup = process_group.init_from_env("cpu", timeout_s=60, hang_timeout_s=3.0)
if setup.rank == 1:
    time.sleep(120)  # stopped before it trains at all (SIGSTOP, a reward server that never answers)
for step in range(200):
    watchdog.heartbeat()
    process_group.all_reduce(torch.ones(1), setup)
    time.sleep(0.05)
"""


def test_a_rank_stopped_before_its_first_heartbeat_is_named_within_the_hang_timeout(tmp_path):
    script = tmp_path / "first.py"
    script.write_text(STOPPED_BEFORE_FIRST_HEARTBEAT)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script)], capture_output=True, text=True, timeout=90,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "hybridrl: rank 1 made no progress" in result.stderr and "before its first heartbeat" in result.stderr, \
        result.stderr[-3000:]
    assert time.monotonic() - start < 45  # the start-up grace (600 s) no longer applies once rank 0 trains
