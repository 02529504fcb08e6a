"""The sandbox: limits stop what they must, in both modes; isolation holds where bubblewrap is usable."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from hybridrl.envs.sandbox import SandboxLimits, bwrap_available, isolation_mode, run_python

MODES = ["rlimits", pytest.param("bwrap", marks=pytest.mark.skipif(
    not bwrap_available(), reason="bubblewrap is not installed or cannot make namespaces on this machine"))]
needs_bwrap = pytest.mark.skipif(not bwrap_available(),
                                 reason="bubblewrap is not installed or cannot make namespaces on this machine")


@pytest.mark.parametrize("mode", MODES)
def test_runs_code_and_reports_its_mode(mode):
    result = run_python("import sys; print(sum(range(10))); print('err', file=sys.stderr)", isolation=mode)
    assert result.ok and result.stdout == "45\n" and result.stderr == "err\n"
    assert result.mode == mode
    assert result.network_blocked == result.filesystem_isolated == (mode == "bwrap")


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_is_killed_at_its_wall_clock_timeout(mode):
    started = time.perf_counter()
    result = run_python("while True:\n    pass\n", limits=SandboxLimits(wall_s=1.0, cpu_s=30), isolation=mode)
    assert time.perf_counter() - started < 4.0
    assert result.timed_out and not result.ok and result.returncode == -9
    assert result.reason == "killed at its wall-clock timeout"


@pytest.mark.parametrize("mode", MODES)
def test_a_program_that_does_not_read_a_large_stdin_is_still_killed_at_its_timeout(mode):
    """More input than a pipe holds, to a program that never reads it: feeding it must not block past the timeout."""
    started = time.perf_counter()
    result = run_python("import time\ntime.sleep(30)\n", stdin="x" * (1 << 20),
                        limits=SandboxLimits(wall_s=1.0, cpu_s=30), isolation=mode)
    assert time.perf_counter() - started < 6.0 and result.timed_out and result.returncode == -9


@pytest.mark.parametrize("mode", MODES)
def test_cpu_time_limit_kills_a_busy_loop(mode):
    result = run_python("while True:\n    pass\n", limits=SandboxLimits(wall_s=20, cpu_s=1), isolation=mode)
    assert not result.timed_out and result.duration_s < 5.0
    assert result.reason == "killed by SIGXCPU (CPU-time limit)"


@pytest.mark.parametrize("mode", MODES)
def test_memory_bomb_is_stopped(mode):
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n"
    result = run_python(bomb, limits=SandboxLimits(memory_bytes=256 << 20, wall_s=20), isolation=mode)
    assert not result.ok and not result.timed_out
    assert "MemoryError" in result.stderr


@pytest.mark.parametrize("mode", MODES)
def test_file_size_limit(mode):
    code = "open('big', 'wb').write(b'x' * 2_000_000)\n"
    result = run_python(code, limits=SandboxLimits(file_size_bytes=1_000_000), isolation=mode)
    assert not result.ok and ("File too large" in result.stderr or result.reason.startswith("killed by SIGXFSZ"))


@pytest.mark.parametrize("mode", MODES)
def test_output_over_the_limit_is_truncated_with_a_marker(mode):
    result = run_python("print('x' * 100_000)", limits=SandboxLimits(output_bytes=1000), isolation=mode)
    assert result.ok and result.stdout_truncated and not result.stderr_truncated
    assert result.stdout.startswith("x" * 1000)
    assert result.stdout.endswith("\n... [output truncated: 99001 more bytes]")


@pytest.mark.parametrize("mode", MODES)
def test_working_directory_is_fresh_holds_the_files_and_is_removed_after(mode):
    code = ("import os, sys\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nprint(open('data/in.txt').read())\n"
            "print(os.environ['HOME'] == os.getcwd())\nopen('out.txt', 'w').write('ok')\n")
    result = run_python(code, files={"data/in.txt": "hello"}, isolation=mode)
    assert result.ok, result.stderr
    workdir, listing, content, home = result.stdout.splitlines()
    assert os.path.basename(workdir).startswith("hybridrl-sandbox-")
    assert listing == "['data', 'main.py']" and content == "hello" and home == "True"
    assert not os.path.exists(workdir), "the sandbox's working directory must be removed afterwards"
    again = run_python("import os; print(os.getcwd())", isolation=mode)
    assert again.stdout.strip() != workdir


def test_files_outside_the_working_directory_are_refused():
    with pytest.raises(ValueError, match="outside the working directory"):
        run_python("pass", files={"../escape.txt": "x"})


@needs_bwrap
def test_writing_outside_its_directory_fails_under_bwrap(tmp_path):
    target = tmp_path / "escaped.txt"
    code = f"open({str(target)!r}, 'w').write('escaped')\n"
    result = run_python(code, isolation="bwrap")
    assert not result.ok and ("FileNotFoundError" in result.stderr or "PermissionError" in result.stderr
                              or "Read-only file system" in result.stderr)
    assert not target.exists()
    here = os.path.dirname(os.path.abspath(__file__))  # project files are not mounted (only Python's own dirs)
    seen = run_python(f"import os; print(os.path.exists({here!r}))", isolation="bwrap")
    assert seen.stdout.strip() == "False", "files outside the system and Python directories must not be visible"


def test_without_bwrap_the_filesystem_is_not_isolated(tmp_path):
    # Documents the rlimits mode honestly: it limits resources but does not confine writes.
    target = tmp_path / "written.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", isolation="rlimits")
    assert result.ok and target.exists() and not result.filesystem_isolated


@pytest.fixture
def local_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    yield server.getsockname()[1]
    server.close()


@needs_bwrap
def test_network_access_fails_under_bwrap(local_server):
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {local_server}), timeout=2)\n"
            "    print('connected')\nexcept OSError as error:\n    print('refused', error)\n"
            "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    print('connected')\n"
            "except OSError as error:\n    print('refused', error)\n"
            "print(sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]))\n")
    result = run_python(code, isolation="bwrap")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("refused") and lines[1].startswith("refused"), result.stdout
    assert lines[2] == "['lo']", "only the sandbox's own loopback may exist"


def test_without_bwrap_the_network_is_not_blocked(local_server):
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {local_server}), timeout=2)\nprint('connected')\n"
    result = run_python(code, isolation="rlimits")
    assert result.stdout.strip() == "connected" and not result.network_blocked


@pytest.mark.skipif(os.geteuid() == 0, reason="Linux does not apply RLIMIT_NPROC to root")
def test_process_limit_stops_a_fork_loop():
    code = ("import os, time\ncount = 0\ntry:\n    for _ in range(10_000):\n        if os.fork() == 0:\n"
            "            time.sleep(3)\n            os._exit(0)\n        count += 1\nexcept OSError:\n    pass\n"
            "print(count)\n")
    result = run_python(code, limits=SandboxLimits(num_processes=len(os.listdir("/proc")) + 64, wall_s=10),
                        isolation="rlimits")
    assert int(result.stdout) < 10_000


def test_isolation_choices():
    assert isolation_mode("rlimits") == "rlimits"
    assert isolation_mode("auto") == ("bwrap" if bwrap_available() else "rlimits")
    with pytest.raises(ValueError, match="'auto', 'bwrap' or 'rlimits'"):
        isolation_mode("docker")
