"""The environment interface: as small as the reward interface, and the one adapter callers use.

An environment is user code named `path/to/file.py:Name`, where `Name` is anything callable with one data row
(a class, or a function returning an object). It is made once per episode and has two methods:

    reset() -> list[message]                    the first messages (system, user, ...)
    step(assistant_text) -> StepResult          observation messages, an optional reward, done

Messages are chat-template dicts (`{"role": "tool", "content": "..."}`). The methods may be plain functions or
coroutines (`async def`); `EnvironmentSession` runs either kind behind one async API, so the engine treats all
environments alike and never blocks its event loop on a slow synchronous `step` (that runs in a thread).

Choices:
- The file is imported with the reward loader (`hybridrl.rewards`), so a user file behaves the same whether it
  holds rewards, tools or environments.
- Everything user code returns is checked here; anything wrong, raised or returned, becomes one
  `EnvironmentCodeError` sentence naming the environment, the sample, the call and the user's file:line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridrl.user_code import import_user_file, where

Message = dict[str, Any]
"""One chat message: at least `role` and `content` (a string), as `tokenizer.apply_chat_template` takes them."""

EnvironmentFactory = Callable[[dict[str, Any]], Any]
"""Makes one environment from one data row (its columns as a dict)."""


class EnvironmentCodeError(RuntimeError):
    """Environment code raised or returned something unusable; the message names the environment and sample."""


class EnvironmentSpecError(ValueError):
    """An environment spec (`file.py:Name`) cannot be resolved; the message says how to fix it."""


@dataclass
class StepResult:
    """What one `step` returns."""

    observation: list[Message] = field(default_factory=list)
    """Messages appended after the assistant turn (tool results, a user reply); empty when `done`."""
    reward: float | None = None
    """A reward for the episode so far, or None; the last non-None reward of an episode is its reward."""
    done: bool = False
    """True ends the episode after this step (its observation, if any, is then not shown to the model)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to log or pass to reward functions (e.g. tool calls and their results)."""


def load_environment(spec: str) -> EnvironmentFactory:
    """`path/to/file.py:Name` -> the callable that makes one environment per data row."""
    if ":" not in spec:
        raise EnvironmentSpecError(f"environment {spec!r} is not of the form path/to/file.py:Name; "
                                   "name the file and the class (or function) that makes one environment.")
    file, name = spec.rsplit(":", 1)
    module = import_user_file(file, "environment", EnvironmentSpecError)
    factory = getattr(module, name, None)
    if not callable(factory):
        found = [n for n, v in vars(module).items()
                 if (inspect.isclass(v) or inspect.isfunction(v)) and not n.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__]
        raise EnvironmentSpecError(f"environment file {file!r} has no class or function {name!r} (defined in it: "
                                   f"{', '.join(found) or 'none'}); define it or fix the name after ':'.")
    return factory


class EnvironmentSession:
    """One episode's environment behind one async API, whatever kind the user wrote.

    `await session.reset()` and `await session.step(text)` call the user's methods (awaiting coroutines, running
    plain functions in a worker thread), check what they return, and turn any failure into one
    `EnvironmentCodeError` sentence. `name` is the spec (for messages), `sample` the episode's index in its batch.
    """

    def __init__(self, factory: EnvironmentFactory, row: Mapping[str, Any], *, name: str, sample: int):
        self.name = name
        self.sample = sample
        self.num_steps = 0
        self.env = self._guarded("making it from the data row", lambda: factory(dict(row)))
        for method in ("reset", "step"):
            if not callable(getattr(self.env, method, None)):
                raise EnvironmentCodeError(f"environment {name!r} made {type(self.env).__name__} for sample {sample}, "
                                       f"which has no {method}() method; give it reset() and step(assistant_text).")
        # Asked once, not at every call: an engine starts hundreds of resets and steps at once.
        self._async_step = _is_coroutine_function(self.env.step)
        self._async_reset = _is_coroutine_function(self.env.reset)

    async def reset(self) -> list[Message]:
        if self._async_reset:  # awaited here, not through `_call`: hundreds start at once, the GPU waiting for them
            try:
                messages = await self.env.reset()
            except Exception as error:
                raise self._error("reset()", f"raised {type(error).__name__}: {error}{where(error)}") from error
        else:
            messages = await self._call("reset()", self.env.reset, is_async=False)
        return self._checked_messages(messages, "reset()", self.env.reset)

    async def step(self, assistant_text: str) -> StepResult:
        """The user's step, checked. Its common path (an `async def step` returning a float or no reward) costs a few
        microseconds less than the general one: an engine runs hundreds at each turn boundary, the GPU waiting."""
        self.num_steps += 1
        if self._async_step:
            try:
                result = await self.env.step(assistant_text)
            except Exception as error:
                raise self._error(f"step {self.num_steps}", f"raised {type(error).__name__}: {error}{where(error)}") \
                    from error
        else:
            result = await self._call(f"step {self.num_steps}", self.env.step, assistant_text, is_async=False)
        if not isinstance(result, StepResult):
            raise self._error(f"step {self.num_steps}", f"returned {type(result).__name__}; step() must return "
                              f"hybridrl.envs.StepResult(observation, reward, done){defined_at(self.env.step)}")
        if result.observation or not isinstance(result.observation, list):  # (an empty list needs no check)
            result.observation = self._checked_messages(result.observation, f"step {self.num_steps}", self.env.step)
        if result.reward is not None and not _finite_number(result.reward):
            raise self._error(f"step {self.num_steps}", f"returned reward {result.reward!r}; a reward must be a finite "
                              f"number or None{defined_at(self.env.step)}")
        return result

    @property
    def closes(self) -> bool:
        """Whether the environment has a `close()` to call (most have none: then no task needs starting for it)."""
        return callable(getattr(self.env, "close", None))

    async def close(self) -> None:
        """Calls the environment's optional `close()` (sync or async)."""
        if self.closes:
            await self._call("close()", self.env.close)

    async def _call(self, call: str, method: Callable, *args: Any, is_async: bool | None = None) -> Any:
        try:
            if inspect.iscoroutinefunction(method) if is_async is None else is_async:
                return await method(*args)
            value = await _in_thread(method, *args)
            return await value if inspect.isawaitable(value) else value
        except Exception as error:
            raise self._error(call, f"raised {type(error).__name__}: {error}{where(error)}") from error

    def _guarded(self, call: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as error:
            raise self._error(call, f"raised {type(error).__name__}: {error}{where(error)}") from error

    def _error(self, call: str, what: str) -> EnvironmentCodeError:
        return EnvironmentCodeError(f"environment {self.name!r} {what} in {call} for sample {self.sample}; "
                                "fix the environment or that sample's data.")

    def _checked_messages(self, messages: Any, call: str, method: Callable) -> list[Message]:
        if not isinstance(messages, list):
            raise self._error(call, f"returned {type(messages).__name__} as messages; return a list of "
                                    f"{{'role': ..., 'content': ...}} dicts{defined_at(method)}")
        for i, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise self._error(call, f"returned message {i} as {message!r}; each message must be a dict with "
                                        f"string 'role' and 'content'{defined_at(method)}")
        return messages


def _is_coroutine_function(method: Callable) -> bool:
    """`inspect.iscoroutinefunction`, asked once per function: a method's answer is its function's, and sessions
    are made by the hundred from one environment class (a microsecond each, at a rollout's start)."""
    function = getattr(method, "__func__", method)
    try:
        return _coroutine_function(function)
    except TypeError:  # unhashable
        return inspect.iscoroutinefunction(method)


@functools.lru_cache(maxsize=256)
def _coroutine_function(function: Callable) -> bool:
    return inspect.iscoroutinefunction(function)


def _finite_number(value: Any) -> bool:
    """A finite real number other than a bool (a float, the common case, asked first)."""
    if type(value) is float:
        return math.isfinite(value)
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


async def _in_thread(method: Callable, *args: Any) -> Any:
    """`method(*args)` in a worker thread. Cancelled, it still returns only once the thread has: a thread cannot be
    stopped, and whoever cancelled it (an episode loop that ends at another episode's error) goes on to close the
    environment, which must not run beside the user's step."""
    running = asyncio.ensure_future(asyncio.to_thread(method, *args))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        running.exception()  # retrieved, so that a failure nobody waits for any more is not logged as lost
        raise


def defined_at(method: Callable) -> str:
    """" (at file:line in name)" of the user's method, for a value it returned (nothing raised, so no traceback
    names the user's code); empty when the source cannot be found."""
    try:
        function = inspect.unwrap(getattr(method, "__func__", method))
        return f" (at {inspect.getsourcefile(function)}:{function.__code__.co_firstlineno} in {function.__name__})"
    except (TypeError, AttributeError):
        return ""


EAGER_TASKS = sys.version_info >= (3, 12)
"""Whether `start_task` starts tasks eagerly (`asyncio.Task(..., eager_start=True)` exists from Python 3.12)."""


def start_task(coroutine: Any) -> asyncio.Task:
    """A task running `coroutine` on the running loop, started eagerly where Python can (3.12+: it runs up to its first
    real wait inside this call). An engine starts hundreds of environment calls at a turn boundary: eagerly, one that
    needs no waiting (a final answer's step, a `reset` returning messages) is done at once and one that waits has its
    timer or I/O running when this returns, with no trip through the event loop's queue for either."""
    if EAGER_TASKS:
        return asyncio.Task(coroutine, loop=asyncio.get_running_loop(), eager_start=True)
    return asyncio.ensure_future(coroutine)


def run_sync(coroutine: Any) -> Any:
    """Runs a coroutine to its end from synchronous code (tests, the reference backend), also where this thread
    already runs an event loop (a Jupyter cell), where `asyncio.run` refuses: it then runs on a loop of its own in
    a helper thread while the caller waits (a synchronous caller blocks its loop either way).

    The result is handed over outside the task `asyncio.run` runs: on the main thread, as it puts back the SIGINT
    handler, `signal.signal` formats the old handler (which holds that task) into an error message it then drops, and
    the task's text includes its result's (a multi-turn call's: the first episodes with every id and log-prob written
    out, milliseconds at the end of every call)."""
    result = []

    async def main() -> None:
        result.append(await coroutine)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(main())
        return result[0]
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybridrl-run-sync") as pool:
        pool.submit(asyncio.run, main()).result()
    return result[0]
