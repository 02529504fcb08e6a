"""The built-in tool environment: tool calls parsed from the assistant's text, Python functions from a user
file run in killable worker processes, results returned as `tool` messages.

    toolbox = ToolBox(["tools.py:calc", python], timeout_s=5.0)   # schemas for the template: toolbox.schemas
    env = toolbox(row)                                     # one ToolEnvironment per episode (an environment factory)

Choices:
- The call format is the one chat templates teach (Qwen2.5, Hermes): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`, several per turn allowed; the tags are settable (`ToolCallFormat`) for tiny models.
- A tool's schema comes from its type hints and docstring through `transformers.utils.get_json_schema`, the
  format `apply_chat_template(tools=...)` expects, so the model sees what a Hugging Face pipeline would show it.
- Calls run in worker processes (`tool_worker.py`), a pool of `num_workers`: a call that passes its timeout is
  killed with its process group and the worker restarted. Each worker has a temporary folder of its own (its
  TMPDIR, so also the working directories of sandboxed programs it starts), removed when it stops. A tool file is therefore imported twice (here for the
  schemas, there to call), so keep import-time side effects out of it.
- Nothing the model writes ends an episode with an error: a tool that raises, hangs, is unknown, or a call that
  is not valid JSON becomes an observation that says what went wrong (for a raising tool, also where: file:line of
  the user's tool code), and is counted in the episode's records.
- A turn without a tool call is the final answer: the episode is done.
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.envs.base import EnvironmentSpecError, Message, StepResult
from hybridrl.envs.episode import ToolRecord
from hybridrl.user_code import import_user_file

_WORKER = Path(__file__).with_name("tool_worker.py")


@dataclass(frozen=True)
class ToolCallFormat:
    """The tags around one tool call's JSON in the assistant's text."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class MalformedToolCall:
    text: str
    """The text between the tags (or after an unclosed start tag)."""
    problem: str
    """What is wrong, as a sentence the model will read."""


def parse_tool_calls(text: str, format: ToolCallFormat = ToolCallFormat()) -> list[ToolCall | MalformedToolCall]:
    """Every tool call in `text`, in order; the ones that cannot be used are `MalformedToolCall`s."""
    calls: list[ToolCall | MalformedToolCall] = []
    position = 0
    while (start := text.find(format.start, position)) >= 0:
        begin = start + len(format.start)
        end = text.find(format.end, begin)
        if end < 0:
            calls.append(MalformedToolCall(text[begin:], f"the tool call opened with {format.start} is not closed "
                                                         f"with {format.end}."))
            break
        calls.append(_parse_one(text[begin:end].strip()))
        position = end + len(format.end)
    return calls


def _parse_one(body: str) -> ToolCall | MalformedToolCall:
    expected = 'write {"name": "<tool>", "arguments": {...}}'
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return MalformedToolCall(body, f"the tool call is not valid JSON ({error.msg} at character {error.pos}); "
                                       f"{expected}.")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return MalformedToolCall(body, f"the tool call has no string \"name\"; {expected}.")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some templates and models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return MalformedToolCall(body, f"the tool call's \"arguments\" is {type(arguments).__name__}, not an "
                                       f"object; {expected}.")
    return ToolCall(call["name"], arguments)


# ----------------------------------------------------------------------------------------------
# Loading tools and their schemas


def load_tool(spec: str | Callable) -> tuple[str, Callable, Path]:
    """`path/to/file.py:function`, or a module-level function itself -> (its name, the function, its file)."""
    if callable(spec):
        if getattr(spec, "__qualname__", "") != getattr(spec, "__name__", None) or not inspect.getsourcefile(spec):
            raise EnvironmentSpecError(f"tool {spec!r} is not a module-level function in a .py file; the tool "
                                       "workers import it by file and name, so define it at the top of a file.")
        return spec.__name__, spec, Path(inspect.getsourcefile(spec))
    file, _, name = spec.rpartition(":")
    path = Path(file).expanduser()
    if not file or not name:
        raise EnvironmentSpecError(f"tool {spec!r} is not of the form path/to/file.py:function; name the file and "
                                   "the function.")
    module = import_user_file(file, "tool", EnvironmentSpecError)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__]
        raise EnvironmentSpecError(f"tool file {file!r} has no function {name!r} (functions in it: "
                                   f"{', '.join(found) or 'none'}); define it or fix the name after ':'.")
    return name, fn, path


def tool_schema(fn: Callable, spec: str = "") -> dict[str, Any]:
    """The JSON schema of one tool, as `transformers.utils.get_json_schema` builds it from hints and docstring."""
    try:
        from transformers.utils import get_json_schema
    except ImportError as error:
        raise EnvironmentSpecError("tool schemas need transformers.utils.get_json_schema (transformers 4.42 or "
                                   "newer); upgrade transformers.") from error
    try:
        return get_json_schema(fn)
    except Exception as error:  # DocstringParsingException, TypeHintParsingException
        raise EnvironmentSpecError(f"tool {spec or fn.__name__!r} has no usable schema ({error}); give every "
                                   "argument a type hint and a line under 'Args:' in a Google-style docstring."
                                   ) from error


# ----------------------------------------------------------------------------------------------
# Running calls in killable worker processes


@dataclass
class ToolOutcome:
    text: str
    """The observation text: the tool's result, or what went wrong."""
    error: bool = False
    timed_out: bool = False
    latency_s: float = 0.0
    where: str = ""
    """For a tool that raised: file:line in function of the user's tool code, innermost first."""


def _raised(answer: dict, latency_s: float) -> ToolOutcome:
    """A tool's exception as an outcome: the model sees the error and the innermost line of the tool file by its name
    (short, and the same on every machine); the record keeps the full paths."""
    frames = answer.get("where") or []
    text = f"error: {answer['error']}"
    if frames:
        file, line, function = frames[0]
        text += f" (at {os.path.basename(file)}:{line} in {function})"
    where = " <- ".join(f"{file}:{line} in {function}" for file, line, function in frames)
    return ToolOutcome(text, error=True, latency_s=latency_s, where=where)


class ToolWorker:
    """One worker process that has imported the tools; restarted after it is killed at a timeout."""

    def __init__(self, specs: list[tuple[str, str]], start_timeout_s: float = 60.0):
        self.specs = [[str(file), name] for file, name in specs]
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None
        self.temp_dir = ""
        self.answers: queue.Queue = queue.Queue()

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> ToolOutcome:
        if self.process is None or self.process.poll() is not None:
            self.stop()  # one that exited between calls: reap it, close its pipes, remove its folder
            self._start()
        started = time.perf_counter()
        try:
            self.process.stdin.write(json.dumps({"name": name, "arguments": arguments}) + "\n")
            self.process.stdin.flush()
            answer = self.answers.get(timeout=timeout_s)
        except queue.Empty:
            self.stop()
            return ToolOutcome(f"error: the tool {name!r} did not finish within its timeout of {timeout_s:g} s and "
                               "was stopped.", error=True, timed_out=True, latency_s=time.perf_counter() - started)
        except (BrokenPipeError, TypeError) as error:  # TypeError: arguments that are not JSON
            self.stop()
            return ToolOutcome(f"error: calling {name!r} failed ({type(error).__name__}: {error}).", error=True,
                               latency_s=time.perf_counter() - started)
        latency = time.perf_counter() - started
        if answer is None:  # the process died mid-call (a crash, or a limit inside the tool)
            self.stop()
            return ToolOutcome(f"error: the tool {name!r} crashed (its process exited).", error=True, latency_s=latency)
        if "error" in answer:
            return _raised(answer, latency)
        return ToolOutcome(answer["ok"], latency_s=latency)

    def _start(self) -> None:
        self.answers = queue.Queue()
        # The worker's temporary files (a sandboxed program's working directory among them) go in a folder of its
        # own, removed when it stops: a worker killed at a timeout cannot remove what it made itself.
        self.temp_dir = tempfile.mkdtemp(prefix="hybridrl-tool-worker-")
        self.process = subprocess.Popen([sys.executable, str(_WORKER), json.dumps(self.specs)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, start_new_session=True,
                                        env={**os.environ, "TMPDIR": self.temp_dir})
        threading.Thread(target=_read_answers, args=(self.process.stdout, self.answers), daemon=True).start()
        try:
            ready = self.answers.get(timeout=self.start_timeout_s)
        except queue.Empty:
            ready = {"load_error": f"it did not start within {self.start_timeout_s:g} s"}
        if not ready or "load_error" in ready:
            self.stop()
            reason = (ready or {}).get("load_error", "the process exited")
            raise RuntimeError(f"the tool worker could not load {self.specs} ({reason}); fix the tool file.")

    def stop(self) -> None:
        """Kills the worker and everything it started (its process group)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.process = None


def _read_answers(stream: Any, answers: queue.Queue) -> None:
    for line in stream:
        answers.put(json.loads(line))
    answers.put(None)  # end of stream: the worker is gone


class ToolBox:
    """The tools of a run: their functions, schemas and worker pool; calling it with a row makes an episode's
    `ToolEnvironment`. Thread-safe: concurrent episodes share `num_workers` workers."""

    def __init__(self, specs: Sequence[str | Callable], *, timeout_s: float = 10.0, num_workers: int = 2,
                 format: ToolCallFormat = ToolCallFormat(), max_turns: int = 8, max_result_chars: int = 4000,
                 system_prompt: str | None = None, prompt_key: str = "prompt"):
        if not specs:
            raise EnvironmentSpecError("no tools were given; list at least one as path/to/file.py:function.")
        if timeout_s <= 0 or num_workers < 1 or max_turns < 1:
            raise ValueError(f"ToolBox needs timeout_s > 0, num_workers >= 1 and max_turns >= 1; got {timeout_s}, "
                             f"{num_workers} and {max_turns}.")
        loaded = [load_tool(spec) for spec in specs]
        self.functions = {name: fn for name, fn, _ in loaded}
        if len(self.functions) < len(loaded):
            raise EnvironmentSpecError(f"two tools share a name among {[name for name, _, _ in loaded]}; the model "
                                       "calls tools by name, so rename one.")
        self.schemas = [tool_schema(fn, str(spec)) for (_, fn, _), spec in zip(loaded, specs)]
        self.timeout_s = timeout_s
        self.format = format
        self.max_turns = max_turns
        self.max_result_chars = max_result_chars
        self.system_prompt = system_prompt
        self.prompt_key = prompt_key
        self._workers = [ToolWorker([(path.resolve(), name) for name, _, path in loaded]) for _ in range(num_workers)]
        self._idle: queue.Queue[ToolWorker] = queue.Queue()
        for worker in self._workers:
            self._idle.put(worker)
        self._finalizer = weakref.finalize(self, _stop_all, list(self._workers))

    def __call__(self, row: dict[str, Any]) -> ToolEnvironment:
        return ToolEnvironment(row, self)

    def call(self, call: ToolCall) -> ToolOutcome:
        """Runs one parsed call on an idle worker; an unknown name is answered without running anything."""
        if call.name not in self.functions:
            return ToolOutcome(f"error: there is no tool {call.name!r}; the tools are "
                               f"{', '.join(sorted(self.functions))}.", error=True)
        worker = self._idle.get()
        try:
            outcome = worker.call(call.name, call.arguments, self.timeout_s)
        finally:
            self._idle.put(worker)
        if len(outcome.text) > self.max_result_chars:
            cut = len(outcome.text) - self.max_result_chars
            outcome.text = outcome.text[:self.max_result_chars] + f"\n... [truncated {cut} characters]"
        return outcome

    def close(self) -> None:
        """Stops the worker processes; a later call starts fresh ones (a trainer may `train()` again), and those
        are stopped by the next `close()` or when the `ToolBox` is collected."""
        _stop_all(self._workers)

    def __enter__(self) -> ToolBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop_all(workers: list[ToolWorker]) -> None:
    for worker in workers:
        worker.stop()


class ToolEnvironment:
    """One episode with tools: the prompt as the first messages, then each turn's tool calls answered as `tool`
    messages until a turn has no tool call (the answer) or `max_turns` turns have been taken.

    The first messages are the row's `messages` column if it has one, else the optional system prompt and the
    `prompt_key` column as a user message. The environment gives no reward: reward functions score the episode
    (its records are in each `StepResult.info["tool_calls"]`)."""

    def __init__(self, row: dict[str, Any], toolbox: ToolBox):
        self.row = row
        self.toolbox = toolbox
        self.num_turns = 0
        self.records: list[ToolRecord] = []

    def reset(self) -> list[Message]:
        if isinstance(self.row.get("messages"), list):
            return [dict(m) for m in self.row["messages"]]
        if self.toolbox.prompt_key not in self.row:
            raise ValueError(f"the data row has neither a 'messages' column nor {self.toolbox.prompt_key!r} "
                             f"(its columns: {sorted(self.row)}); add one or set prompt_key.")
        system = [{"role": "system", "content": self.toolbox.system_prompt}] if self.toolbox.system_prompt else []
        return system + [{"role": "user", "content": str(self.row[self.toolbox.prompt_key])}]

    def step(self, assistant_text: str) -> StepResult:
        self.num_turns += 1
        calls = parse_tool_calls(assistant_text, self.toolbox.format)
        if not calls:
            return StepResult(done=True, info={"tool_calls": []})
        observation, records = [], []
        for call in calls:
            record = self._run(call)
            records.append(record)
            observation.append({"role": "tool", "name": record.name, "content": record.result})
        self.records.extend(records)
        done = self.num_turns >= self.toolbox.max_turns
        return StepResult(observation=[] if done else observation, done=done, info={"tool_calls": records})

    def _run(self, call: ToolCall | MalformedToolCall) -> ToolRecord:
        if isinstance(call, MalformedToolCall):
            return ToolRecord(name="", arguments={}, result=f"error: {call.problem}", error=True, malformed=True)
        outcome = self.toolbox.call(call)
        return ToolRecord(name=call.name, arguments=call.arguments, result=outcome.text, error=outcome.error,
                          timed_out=outcome.timed_out, latency_s=outcome.latency_s, where=outcome.where)
