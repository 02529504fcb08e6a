"""Running untrusted Python (code-execution rewards and tools) in a subprocess with limits.

    result = run_python("print(sum(range(10)))", limits=SandboxLimits(wall_s=5))
    result.stdout, result.ok, result.reason, result.mode

`python` is the same as a ready tool for `ToolBox` (its docstring is the schema the model sees).

Two modes, chosen by `isolation` ("auto" picks the first available):
- "bwrap" (bubblewrap installed and user namespaces allowed): new network, PID, IPC and UTS namespaces (no
  network: only a loopback of its own), all capabilities dropped, a filesystem made only of the system and
  Python directories read-only, a private `/tmp`, and the working directory as the one writable place; the
  whole sandbox dies with its parent.
- "rlimits" (no bubblewrap): the same process limits and working directory, but the program can reach the
  network and read and write anything the user running hybridrl can. The result says so
  (`network_blocked`, `filesystem_isolated` are False).
In both: CPU time, address space (RLIMIT_AS), file size and process count limited by `setrlimit` in the child
before it starts; the program killed if the process that started it dies (Linux: PR_SET_PDEATHSIG); its own fresh temporary working directory (also HOME and TMPDIR), removed afterwards; a
minimal environment; killed with its whole process group at the wall-clock timeout; stdout and stderr each
kept up to `output_bytes`, the rest counted and dropped, with a marker. docs/environments.md says what each
mode guarantees and what it does not.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_READ_ONLY_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache", "/etc/alternatives",
                     "/etc/ssl", "/etc/localtime")
_SIGNALS = {int(s) for s in signal.Signals}


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock timeout; the process group is killed when it passes."""
    cpu_s: int = 10
    """CPU seconds (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL a second later."""
    memory_bytes: int = 1 << 30
    """Address space (RLIMIT_AS); an allocation past it fails (MemoryError in Python)."""
    file_size_bytes: int = 16 << 20
    """Largest file the program may write (RLIMIT_FSIZE)."""
    num_processes: int = 256
    """RLIMIT_NPROC. Linux counts every process of the user, not only the sandbox's, and does not apply it to
    root outside a user namespace; treat it as a fork-bomb brake, not an exact count."""
    output_bytes: int = 64 << 10
    """Bytes of stdout and of stderr kept; beyond it output is dropped and a truncation marker appended."""


@dataclass
class SandboxResult:
    returncode: int | None
    """The exit status; negative for a signal (-9: killed); None if it could not be collected."""
    stdout: str
    stderr: str
    timed_out: bool
    """Killed at the wall-clock timeout."""
    stdout_truncated: bool
    stderr_truncated: bool
    mode: str
    """'bwrap' or 'rlimits'."""
    network_blocked: bool
    filesystem_isolated: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def reason(self) -> str:
        """How it ended, as a phrase for an observation or a log."""
        if self.timed_out:
            return "killed at its wall-clock timeout"
        if self.returncode is not None and self.returncode < 0:
            name = signal.Signals(-self.returncode).name
            hint = {"SIGXCPU": " (CPU-time limit)", "SIGXFSZ": " (file-size limit)", "SIGKILL": " (a limit)"}
            return f"killed by {name}{hint.get(name, '')}"
        return f"exited with status {self.returncode}"


@functools.cache
def bwrap_available() -> bool:
    """bubblewrap is installed and can make namespaces here (containers often forbid them)."""
    if shutil.which("bwrap") is None:
        return False
    probe = subprocess.run(["bwrap", "--unshare-all", "--ro-bind", "/", "/", "true"], check=False, capture_output=True,
                           timeout=10)
    return probe.returncode == 0


def isolation_mode(isolation: str = "auto") -> str:
    """The mode `run_python` will use: 'bwrap' or 'rlimits'; asking for 'bwrap' where it is unusable is refused."""
    if isolation not in ("auto", "bwrap", "rlimits"):
        raise ValueError(f"sandbox isolation must be 'auto', 'bwrap' or 'rlimits'; got {isolation!r}.")
    if isolation == "bwrap" and not bwrap_available():
        raise RuntimeError("sandbox isolation 'bwrap' was asked for but bubblewrap is not installed or cannot make "
                           "namespaces here; install it (apt-get install bubblewrap) or use isolation='auto'.")
    if isolation == "auto":
        return "bwrap" if bwrap_available() else "rlimits"
    return isolation


def run_python(code: str, *, limits: SandboxLimits = SandboxLimits(), stdin: str = "",
               files: dict[str, str | bytes] | None = None, isolation: str = "auto") -> SandboxResult:
    """Runs `code` as `main.py` in a fresh temporary directory (with `files` written beside it) under `limits`."""
    mode = isolation_mode(isolation)
    workdir = Path(tempfile.mkdtemp(prefix="hybridrl-sandbox-")).resolve()
    try:
        (workdir / "main.py").write_text(code)
        for name, content in (files or {}).items():
            target = (workdir / name).resolve()
            if not target.is_relative_to(workdir):
                raise ValueError(f"sandbox file {name!r} lies outside the working directory; use a relative path.")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content.encode() if isinstance(content, str) else content)
        command = [sys.executable, "-E", "-s", "-B", "main.py"]
        if mode == "bwrap":
            command = _bwrap_prefix(workdir) + command
        return _run(command, workdir, stdin, limits, mode)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def python(code: str) -> str:
    """Runs a Python program in a sandbox (no network, a private working directory, limited CPU time and memory)
    and returns what it printed.

    Args:
        code: The complete program; print the values you want to see.
    """
    result = run_python(code, limits=SandboxLimits(wall_s=5.0, cpu_s=5))
    text = result.stdout + (("\n" if result.stdout else "") + result.stderr if result.stderr else "")
    return text if result.ok else f"{text}\n[{result.reason}]".lstrip("\n")


def _bwrap_prefix(workdir: Path) -> list[str]:
    args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for path in _READ_ONLY_SYSTEM:
        args += ["--ro-bind-try", path, path]
    # Later mounts cover earlier ones: the private /tmp first, then the interpreter (a venv may live under /tmp),
    # then the working directory (made under /tmp too).
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    python_dirs = {sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent.parent)}
    for path in sorted(python_dirs):
        args += ["--ro-bind", path, path]
    args += ["--bind", str(workdir), str(workdir), "--chdir", str(workdir)]
    return args + ["--"]


def _libc_prctl():
    """libc's prctl, looked up here (not in the forked child); None off Linux or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
_PR_SET_PDEATHSIG = 1


def _limit_child(limits: SandboxLimits, parent: int) -> None:
    # Runs in the child between fork and exec: only setrlimit and prctl calls, no locks taken.
    # Killed when the process that started it dies (e.g. a tool worker killed at its timeout, which can no longer
    # enforce wall_s): else a sleeping program would outlive everything. The getppid check closes the race of a
    # parent that died before the prctl.
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.num_processes, limits.num_processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run(command: list[str], workdir: Path, stdin: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    environment = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir),
                   "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=workdir, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True,
                               preexec_fn=functools.partial(_limit_child, limits, os.getpid()))
    outputs = [_Drain(process.stdout, limits.output_bytes), _Drain(process.stderr, limits.output_bytes)]
    # In a thread: a program that does not read a large stdin would block this write past the wall-clock timeout.
    feeder = threading.Thread(target=_feed, args=(process, stdin), daemon=True)
    feeder.start()
    timed_out = False
    try:
        process.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill_group(process)
    feeder.join(timeout=2.0)  # the kill closed the pipe's reader, so the write ends with BrokenPipeError
    for output in outputs:
        output.join()
    stdout, stderr = outputs
    returncode = process.returncode
    if mode == "bwrap" and returncode is not None and returncode > 128 and returncode - 128 in _SIGNALS:
        returncode = -(returncode - 128)  # bwrap reports its child's death by signal N as exit status 128 + N
    return SandboxResult(returncode=returncode, stdout=stdout.text(), stderr=stderr.text(),
                         timed_out=timed_out, stdout_truncated=stdout.dropped > 0,
                         stderr_truncated=stderr.dropped > 0, mode=mode, network_blocked=mode == "bwrap",
                         filesystem_isolated=mode == "bwrap", duration_s=time.perf_counter() - started)


def _feed(process: subprocess.Popen, stdin: str) -> None:
    try:
        if stdin:
            process.stdin.write(stdin.encode())
        process.stdin.close()
    except (BrokenPipeError, ValueError, OSError):  # the program exited (or was killed) without reading its input
        pass


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the whole session (the program and anything it started that stayed in it), then reap."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


class _Drain:
    """Reads a pipe to its end in a thread, keeping the first `limit` bytes and counting the rest."""

    def __init__(self, pipe, limit: int):
        self.pipe, self.limit = pipe, limit
        self.kept = bytearray()
        self.dropped = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while chunk := self.pipe.read1(65536):
            room = self.limit - len(self.kept)
            self.kept += chunk[:max(room, 0)]
            self.dropped += max(len(chunk) - max(room, 0), 0)

    def join(self) -> None:
        # A process that left the group may still hold the pipe; do not wait on it forever.
        self.thread.join(timeout=2.0)
        self.pipe.close()

    def text(self) -> str:
        text = self.kept.decode("utf-8", errors="replace")
        return text + f"\n... [output truncated: {self.dropped} more bytes]" if self.dropped else text
