"""Starting and supervising the processes of a multi-GPU run: torchrun on one node, Ray across nodes.

`hybridrl train CONFIG trainer.num_gpus=2` calls `maybe_relaunch`, which re-runs the same command
line as `python -m torch.distributed.run --standalone --nproc_per_node 2 -m hybridrl.cli ...`; each
worker sees `WORLD_SIZE` in its environment, so it trains instead of relaunching. With
`trainer.launcher=ray` the same command asks a Ray cluster (the one `RAY_ADDRESS` names, or a local one)
for one bundle per GPU in a placement group, starts one actor per bundle, gives each the
`MASTER_ADDR`/`MASTER_PORT`/`RANK`/`WORLD_SIZE` that torchrun would, and runs the same entry point.
hybridrl adds no cluster manager: Ray or torchrun own the processes.

A run never hangs silently:
- `process_group.init_from_env` bounds the rendezvous and every collective by a timeout;
- under torchrun, every rank runs a `Watchdog` thread that publishes its `watchdog.heartbeat()`
  count, and whether it is waiting inside a torch.distributed call, to the rendezvous store; when a
  count stops for `hang_timeout_s`, the stalled rank that is *not* waiting for the others is named
  (`find_stalled`) and the run stops; torchrun itself ends the run when a worker process dies, naming
  its rank;
- under Ray, the driver does both: it watches the actors (a dead one ends the run at once) and polls
  their heartbeat counts with the watchdog's rules (the start-up grace ends at any rank's first
  heartbeat; a rank whose probe stops answering is stopped or frozen, and named).

A scheduler's SIGTERM (or Ctrl-C) to the launcher stops the run cleanly: torchrun runs in a session of its
own, so the terminal's signal reaches only the launcher, which passes exactly one SIGTERM/SIGINT to each
rank (a second one would end a rank at once) and waits while every rank finishes its step and saves; it
then exits with 128 + the signal's number (`StoppedBySignal`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from hybridrl.parallel.watchdog import (find_stalled, first_heartbeat_clock, progress, silence_bound_s,
                                        waiting_in_collective)


class LaunchError(RuntimeError):
    """A worker of a multi-process run failed, hung, or could not be started; the message names the rank."""


class StoppedBySignal(Exception):
    """The launcher was asked to stop and every rank stopped cleanly; `exit_code` is 128 + the signal."""

    def __init__(self, signum: int):
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}: every rank finished its step and saved a "
                         "checkpoint; run the same command again to resume (trainer.resume=auto)")


def is_worker() -> bool:
    """True inside a process that torchrun or the Ray launcher started (it must train, not relaunch)."""
    return "WORLD_SIZE" in os.environ or os.environ.get("HYBRIDRL_WORKER") == "1"


def maybe_relaunch(argv: Sequence[str], num_processes: int, launcher: str = "torchrun",
                   hang_timeout_s: float = 900.0, entry: Callable[[list[str]], Any] | None = None) -> int | None:
    """Start `num_processes` workers running `hybridrl <argv>` and return their exit status, or return
    None when this process should train itself (one process, or already a worker). Ray workers call
    `entry(argv)` (the CLI's `main`, passed in by the CLI: this layer does not import the CLI)."""
    if num_processes <= 1 or is_worker():
        return None
    if launcher == "torchrun":
        return run_torchrun(argv, num_processes)
    if launcher == "ray":
        if entry is None:
            raise ValueError("maybe_relaunch(launcher='ray') needs entry=, the function each Ray worker runs.")
        use_gpu = _cuda_requested(argv)
        codes = run_ray(entry, (list(argv),), num_processes, use_gpu=use_gpu, hang_timeout_s=hang_timeout_s)
        return max(int(code or 0) for code in codes)
    raise ValueError(f"trainer.launcher must be torchrun or ray; got {launcher!r}.")


def _cuda_requested(argv: Sequence[str]) -> bool:
    import torch

    return torch.cuda.is_available() and not any(arg.replace(" ", "") == "trainer.device=cpu" for arg in argv)


def torchrun_command(argv: Sequence[str], num_processes: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}",
            "-m", "hybridrl.cli", *argv]


def run_torchrun(argv: Sequence[str], num_processes: int) -> int:
    """Run `hybridrl <argv>` in `num_processes` local workers; torchrun stops them all when one fails
    and prints which rank failed first. SIGTERM/SIGINT here is passed on to the ranks (module docstring);
    raises `StoppedBySignal` when they then all stop cleanly."""
    command = torchrun_command(argv, num_processes)
    print("hybridrl: starting", num_processes, "processes:", " ".join(command), file=sys.stderr, flush=True)
    agent = subprocess.Popen(command, env={**os.environ, "HYBRIDRL_WORKER": "1"}, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        ranks = child_pids(agent.pid)
        for pid in ranks or [agent.pid]:  # no /proc (not Linux): torchrun passes SIGTERM on itself
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if len(received) == 1:
            print(f"hybridrl: {signal.Signals(signum).name} passed to {len(ranks)} rank(s); waiting while they "
                  "finish the step and save (send it again to stop them at once)", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = agent.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if received and code == 0:
        raise StoppedBySignal(received[0])
    return code


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid` (torchrun's ranks), read from /proc; [] where there is none."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return sorted(children)


class _RayWorker:
    """One rank. Concurrency 2: `progress` answers while `run` trains."""

    def node(self) -> tuple[str, list[str]]:
        import ray

        return ray.util.get_node_ip_address(), [str(gpu) for gpu in ray.get_gpu_ids()]

    def free_port(self) -> int:
        with socket.socket() as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    def run(self, env: dict[str, str], fn: Callable[..., Any], args: tuple) -> Any:
        os.environ.update(env)
        return fn(*args)

    def progress(self) -> tuple[int, bool]:
        return progress(), waiting_in_collective()


def rank_environments(nodes: list[tuple[str, list[str]]], master_port: int) -> list[dict[str, str]]:
    """torchrun's variables for each worker, from (node address, assigned GPU ids) in rank order. Workers
    of one node see all of that node's GPUs (so NCCL can use peer access) and pick theirs by LOCAL_RANK."""
    world_size = len(nodes)
    per_node: dict[str, list[int]] = {}
    for rank, (address, _) in enumerate(nodes):
        per_node.setdefault(address, []).append(rank)
    envs = []
    for rank, (address, gpus) in enumerate(nodes):
        peers = per_node[address]
        env = {"MASTER_ADDR": nodes[0][0], "MASTER_PORT": str(master_port), "RANK": str(rank),
               "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(peers.index(rank)),
               "LOCAL_WORLD_SIZE": str(len(peers)), "HYBRIDRL_WORKER": "1", "HYBRIDRL_WATCHDOG": "0"}
        if gpus:
            node_gpus = [gpu for peer in peers for gpu in nodes[peer][1]]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            env["LOCAL_RANK"] = str(node_gpus.index(gpus[0]))
        envs.append(env)
    return envs


def run_ray(fn: Callable[..., Any], args: tuple, num_workers: int, use_gpu: bool = True,
            hang_timeout_s: float = 900.0, start_timeout_s: float = 300.0, startup_grace_s: float = 600.0,
            poll_s: float | None = None) -> list[Any]:
    """Run `fn(*args)` in `num_workers` Ray actors that form one torch.distributed job; returns each
    rank's result. A worker that raises, dies, or stops calling `watchdog.heartbeat()` for
    `hang_timeout_s` ends the run with a `LaunchError` naming its rank. `start_timeout_s` bounds getting
    the workers placed; a rank has `startup_grace_s` more before its first heartbeat (model loading)."""
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise LaunchError("trainer.launcher=ray needs Ray; install it with pip install 'hybridrl[ray]'.") from None
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
    group = placement_group([bundle] * num_workers, strategy="PACK")
    workers: list[Any] = []
    try:
        try:
            ray.get(group.ready(), timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"the Ray cluster could not place {num_workers} workers of {bundle} within "
                              f"{start_timeout_s:.0f} s; it has {ray.available_resources()}.") from None
        actor = ray.remote(num_cpus=1, num_gpus=1 if use_gpu else 0, max_concurrency=2)(_RayWorker)
        workers = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index)).remote() for index in range(num_workers)]
        nodes = ray.get([worker.node.remote() for worker in workers], timeout=start_timeout_s)
        port = ray.get(workers[0].free_port.remote(), timeout=start_timeout_s)
        envs = rank_environments(nodes, port)
        runs = [worker.run.remote(env, fn, args) for worker, env in zip(workers, envs)]
        return _supervise(ray, workers, runs, hang_timeout_s, startup_grace_s,
                          poll_s or min(5.0, max(0.2, hang_timeout_s / 10)))
    finally:
        for worker in workers:
            ray.kill(worker)
        remove_placement_group(group)
        if started_ray:
            ray.shutdown()


def _supervise(ray: Any, workers: list[Any], runs: list[Any], hang_timeout_s: float, startup_grace_s: float,
               poll_s: float) -> list[Any]:
    """Wait for the ranks' results while applying the torchrun watchdog's rules from the driver: a rank's stall
    clock starts at its last new heartbeat count, before the first one at `first_heartbeat_clock` (the start-up
    grace ends once any rank trains), and a rank whose progress probe has not answered for `silence_bound_s`
    is stopped or frozen, so it is named even if its last answer said it waited in a collective."""
    rank_of = {run: rank for rank, run in enumerate(runs)}
    results: dict[int, Any] = {}
    counts: dict[int, int] = {}
    waiting: dict[int, bool] = {}
    started = time.monotonic()
    changed_at: dict[int, float] = {}
    answered_at: dict[int, float] = {}
    first_progress_at: float | None = None
    pending = list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=poll_s)
        failures: dict[int, Exception] = {}
        for run in done:
            try:
                results[rank_of[run]] = ray.get(run)
            except Exception as error:
                failures[rank_of[run]] = error
        if failures:
            # A rank that dies takes its peers' collectives down with it, and their errors may arrive first:
            # give the others a moment, then name the one that died before the ones that lost it.
            settled, _ = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_SETTLE_S)
            for run in settled:
                try:
                    ray.get(run)
                except Exception as error:
                    failures[rank_of[run]] = error
            rank, error = root_failure(failures, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError))
            raise LaunchError(f"rank {rank} of {len(runs)} failed: {_first_line(error)}") from None
        running = [rank_of[run] for run in pending]
        probes = {worker.progress.remote(): rank for rank, worker in enumerate(workers) if rank in running}
        answered, _ = ray.wait(list(probes), num_returns=len(probes), timeout=poll_s)
        now = time.monotonic()
        for probe in answered:
            rank = probes[probe]
            try:
                count, waiting[rank] = ray.get(probe)
            except Exception:
                continue  # the rank is dying; its run ref reports why on the next pass
            answered_at[rank] = now
            if counts.get(rank) != count:
                counts[rank], changed_at[rank] = count, now
        if first_progress_at is None and any(counts.values()):
            first_progress_at = now
        for rank in running:
            if not counts.get(rank):
                changed_at[rank] = first_heartbeat_clock(started, startup_grace_s, first_progress_at)
        silent = {rank for rank in running if now - answered_at.get(rank, now) > silence_bound_s(poll_s)}
        live = {rank: counts.get(rank, 0) for rank in running}
        message = find_stalled(live, changed_at, now, hang_timeout_s, waiting, silent, silence_bound_s(poll_s))
        if message:
            raise LaunchError(message + "; the run was stopped (trainer.hang_timeout_s).")
    return [results[rank] for rank in range(len(runs))]


FAILURE_SETTLE_S = 3.0
"""After a first failure, how long the other ranks' results are awaited to find the rank that failed first."""


def root_failure(failures: dict[int, Exception], death_types: tuple[type, ...]) -> tuple[int, Exception]:
    """The failure to report: a rank whose worker died (`death_types`) before ranks whose collectives broke
    because of it; otherwise the lowest rank that failed."""
    died = [rank for rank in sorted(failures) if isinstance(failures[rank], death_types)]
    rank = died[0] if died else min(failures)
    return rank, failures[rank]


def _first_line(error: BaseException) -> str:
    """Ray wraps the worker's exception; keep the part that says what happened."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    text = str(error).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else type(error).__name__
    return line if len(line) <= 300 else line[:300] + " ... (the worker's log above has the rest)"
