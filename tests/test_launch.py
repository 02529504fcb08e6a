"""Launching and supervising workers: torchrun relaunch, hang detection naming the rank, the Ray launcher.

The Ray tests start a local Ray cluster on the CPU (two workers, gloo) and are skipped when Ray is not
installed (`pip install 'hybridrl[ray]'`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

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


def test_a_silent_rank_is_named_even_when_its_last_report_said_it_waited():
    """SIGSTOP inside a collective: the stopped rank's last report says "waiting", like its peers'; its silence
    (no new publication) names it instead of "every rank has waited"."""
    counts, changed = {0: 5, 1: 5}, {0: 0.0, 1: 0.0}
    everyone_waits = {0: True, 1: True}
    assert find_stalled(counts, changed, 11.0, 10.0, everyone_waits).startswith("every rank has waited")
    message = find_stalled(counts, changed, 11.0, 10.0, everyone_waits, silent={1})
    assert message.startswith("rank 1 made no progress for 11 s (stuck after heartbeat 5, its process stopped "
                              "answering") and "rank 0 wait(s) for it" in message
    assert find_stalled(counts, changed, 5.0, 10.0, everyone_waits, silent={1}) is None  # silent, not yet stalled
    # the deadlock verdict waits the time a stopped rank takes to fall silent
    assert find_stalled(counts, changed, 11.0, 10.0, everyone_waits, silent_after_s=5.0) is None
    assert find_stalled(counts, changed, 16.0, 10.0, everyone_waits, silent_after_s=5.0).startswith("every rank")


def test_the_watchdog_names_a_rank_whose_publications_stopped(monkeypatch):
    """The watchdog thread against a store where rank 1's report is frozen at "waiting" (its process stopped)."""
    import threading

    from hybridrl.parallel.watchdog import Watchdog

    monkeypatch.setattr(watchdog, "SILENT_AFTER_AT_LEAST_S", 0.0)

    class Store(dict):
        def set(self, key, value):
            self[key] = value

        def check(self, keys):
            return all(key in self for key in keys)

        def get(self, key):
            return dict.get(self, key).encode()

    store = Store({"1": "4 1 9"})  # rank 1 last said: heartbeat 4, waiting in a collective, publication 9
    monkeypatch.setattr(watchdog, "waiting_in_collective", lambda: True)  # rank 0 waits for it
    messages, fired = [], threading.Event()
    dog = Watchdog(store, rank=0, world_size=2, timeout_s=0.3, interval_s=0.02, startup_grace_s=0.0,
                   on_stall=lambda message: (messages.append(message), fired.set()))
    dog.start()
    assert fired.wait(10.0)
    dog.stop()
    assert messages[0].startswith("rank 1 made no progress") and "stopped answering" in messages[0], messages


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
    if setup.rank == 1 and mode == "late":
        time.sleep(120)  # stopped before its first heartbeat
    for step in range(5):
        watchdog.heartbeat()
        if mode.startswith("stop:") and step == 2:  # rank 1 stopped whole while it waits in the all-reduce
            if setup.rank == 0:
                time.sleep(2.0)  # computing, under the hang timeout
            else:
                Path(mode[5:]).write_text(str(os.getpid()))
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGSTOP)).start()
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


def test_ray_rank_without_a_heartbeat_is_named_once_another_rank_trains(ray_cluster):
    """The driver applies the watchdog's start-up rule: the grace (180 s here) ends at the first heartbeat of any
    rank, so a rank stopped before its first one is named within the hang timeout, as under torchrun."""
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 made no progress for [0-9]+ s \(before its first heartbeat"):
        launch.run_ray(ray_job, ("late",), 2, use_gpu=False, hang_timeout_s=3, startup_grace_s=180)
    assert time.monotonic() - start < 60


def test_ray_rank_stopped_inside_a_collective_is_named(ray_cluster, tmp_path):
    """The driver's probes of a SIGSTOPped actor go unanswered: it is named although its last answer said "waiting"."""
    pid_file = tmp_path / "rank1.pid"
    start = time.monotonic()
    try:
        with pytest.raises(LaunchError, match=r"rank 1 made no progress .*stopped answering.*rank 0 wait\(s\) for it"):
            launch.run_ray(ray_job, (f"stop:{pid_file}",), 2, use_gpu=False, hang_timeout_s=3, startup_grace_s=180)
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert time.monotonic() - start < 60


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


STOPPED_INSIDE_A_COLLECTIVE = """
import os, signal, threading, time, torch
from hybridrl.parallel import process_group, watchdog
setup = process_group.init_from_env("cpu", timeout_s=60, hang_timeout_s=5.0)
for step in range(200):
    watchdog.heartbeat()
    if step == 3 and setup.rank == 0:
        time.sleep(3.0)  # computing (under the hang timeout) while rank 1 already waits in the all-reduce
    if step == 3 and setup.rank == 1:  # stop this whole process 2.5 s into its wait, as `kill -STOP` would
        threading.Timer(2.5, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    process_group.all_reduce(torch.ones(1), setup)
    time.sleep(0.05)
"""


def test_a_rank_stopped_inside_a_collective_is_named(tmp_path):
    """Its last report said "waiting", as rank 0's does: the silence of its watchdog names it (before, the run
    was reported as "every rank has waited in a collective")."""
    script = tmp_path / "stop.py"
    script.write_text(STOPPED_INSIDE_A_COLLECTIVE)
    start = time.monotonic()
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              str(script)], stderr=subprocess.PIPE, text=True, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    try:
        for line in agent.stderr:  # torchrun would wait 30 s for the stopped rank to take its SIGTERM
            lines.append(line)
            if "hybridrl:" in line or time.monotonic() - start > 80:
                break
    finally:
        for pid in [*launch.child_pids(agent.pid), agent.pid]:  # the ranks run in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        agent.wait()
    stderr = "".join(lines)
    assert "hybridrl: rank 1 made no progress" in stderr and "stopped answering" in stderr, stderr[-3000:]
    assert "rank 0 wait(s) for it in a collective" in stderr
    assert time.monotonic() - start < 60


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
