"""Stopped rank: how long a 2-process CPU run (gloo) takes to name a rank stopped with SIGSTOP at a given step.

`hybridrl train ... trainer.num_gpus=2 trainer.device=cpu` on the tiny model; once rank 0 has logged step N, rank 1
(found among torchrun's children by its RANK) gets SIGSTOP at whatever moment of its step it is in. The table gives
the seconds from the SIGSTOP to the watchdog's message (which must name rank 1, within `hang_timeout_s` + 10 s) and
to the launcher's exit (torchrun then gives the stopped rank 30 s to take its SIGTERM before killing it).

    python -m benchmarks.stopped_rank --hang-timeout 30 --stop-at 2 25
    python -m benchmarks.stopped_rank --stop-at 2 25              # the default trainer.hang_timeout_s (15+ min each)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridrl.parallel.launch import child_pids

CONFIG = """
model: {path: "tiny:llama"}
data: {train_path: "%(data)s", max_prompt_length: 16}
rollout: {num_samples_per_prompt: 4, max_new_tokens: 4}
reward:
  functions:
    - fn: exact_match
trainer: {total_steps: %(steps)d, prompts_per_step: 4, device: cpu, num_gpus: 2, save_every: 0, save_model: false,
          output_dir: "%(out)s"}
actor: {micro_batch_size: 16}
logging: {sinks: [jsonl]}
"""


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of worker `rank`: a child of torchrun's agent (the launcher's child) with RANK=rank in its
    environment."""
    for agent in child_pids(launcher):
        for pid in child_pids(agent):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return pid
    return None


def logged_step(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip().endswith("}")]
    return max(steps, default=0)


def stop_at(work: Path, step: int, hang_timeout_s: float | None, limit_s: float) -> dict[str, object]:
    """Run, SIGSTOP rank 1 once step `step` is logged, and time the watchdog's message and the launcher's exit."""
    work.mkdir(parents=True, exist_ok=True)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i % 10}+{(i * 7) % 10}=", "answer": str(i % 10 + (i * 7) % 10)})
                            + "\n" for i in range(64)))
    config = work / "run.yaml"
    config.write_text(CONFIG % {"data": data, "steps": step + 1000, "out": work / "run"})
    overrides = [] if hang_timeout_s is None else [f"trainer.hang_timeout_s={hang_timeout_s}"]
    stderr_path = work / "stderr.txt"
    with stderr_path.open("w") as stderr:
        launcher = subprocess.Popen([sys.executable, "-m", "hybridrl.cli", "train", str(config), *overrides],
                                    stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        while logged_step(work / "run" / "metrics.jsonl") < step:
            if launcher.poll() is not None:
                raise RuntimeError(f"the run ended before step {step}: {stderr_path.read_text()[-2000:]}")
            time.sleep(0.01)
        pid = rank_pid(launcher.pid, 1)
        os.kill(pid, signal.SIGSTOP)
        stopped_at, stopped_step = time.monotonic(), logged_step(work / "run" / "metrics.jsonl")
        named_after, message = None, ""
        while launcher.poll() is None and time.monotonic() - stopped_at < limit_s:
            if named_after is None:
                message = next((line for line in stderr_path.read_text().splitlines() if line.startswith("hybridrl: ")
                                and ("made no progress" in line or "every rank" in line)), "")
                if message:
                    named_after = time.monotonic() - stopped_at
            time.sleep(0.05)
        ended_after = time.monotonic() - stopped_at if launcher.poll() is not None else None
    finally:
        agents = child_pids(launcher.pid)
        for pid in [pid for agent in agents for pid in child_pids(agent)] + agents + [launcher.pid]:
            try:  # the ranks (the stopped one included) and torchrun's agent run in sessions of their own
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.wait()
    return {"step": stopped_step, "named_after_s": named_after, "ended_after_s": ended_after, "message": message,
            "names_rank_1": message.startswith("hybridrl: rank 1 made no progress")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stop-at", type=int, nargs="+", default=[2, 25], help="steps after which rank 1 is stopped")
    parser.add_argument("--hang-timeout", type=float, default=None,
                        help="trainer.hang_timeout_s (default: the config's)")
    parser.add_argument("--limit", type=float, default=None, help="give up this long after the SIGSTOP")
    args = parser.parse_args(argv)
    timeout = args.hang_timeout if args.hang_timeout is not None else 900.0
    limit = args.limit or timeout + 120.0
    print(f"trainer.hang_timeout_s={timeout:g}; bound for naming the rank: {timeout + 10:g} s")
    print("| stopped after step | rank 1 named after | run ended after | message |")
    print("| ---: | ---: | ---: | --- |")
    ok = True
    for step in args.stop_at:
        with tempfile.TemporaryDirectory(prefix="stopped_rank_") as work:
            result = stop_at(Path(work), step, args.hang_timeout, limit)
        named, ended = result["named_after_s"], result["ended_after_s"]
        print(f"| {result['step']} | {'-' if named is None else f'{named:.1f} s'} | "
              f"{'-' if ended is None else f'{ended:.1f} s'} | {result['message'].removeprefix('hybridrl: ')} |",
              flush=True)
        ok = ok and result["names_rank_1"] and named is not None and named <= timeout + 10
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
