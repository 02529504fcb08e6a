"""The tool environment: parsing tool calls, schemas from hints and docstrings, and every kind of bad input
turned into an observation that says what went wrong."""

from __future__ import annotations

import json
import os
import time

import pytest

from hybridrl.envs.base import EnvironmentSession, EnvironmentSpecError, run_sync
from hybridrl.envs.sandbox import python
from hybridrl.envs.tools import (MalformedToolCall, ToolBox, ToolCall, ToolCallFormat, load_tool, parse_tool_calls,
                                 tool_schema)

TOOLS = '''
import sys
import time


def calc(a: int, b: int, op: str = "mul") -> int:
    """Multiply or add two integers.

    Args:
        a: The first number.
        b: The second number.
        op: Which operation: mul or add.
    """
    print("noise on stdout must not break the protocol")
    assert sys.stdin.read() == ""  # a tool reading its input must not eat the worker's requests
    return a * b if op == "mul" else a + b


def fail(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise ValueError(f"cannot handle {x}")


def hang(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


async def lookup(key: str) -> dict:
    """Looks a key up.

    Args:
        key: The key.
    """
    return {"key": key, "value": len(key)}


def crash() -> str:
    """Exits its process."""
    import os
    os._exit(3)


def undocumented(x):
    return x
'''


@pytest.fixture
def tool_file(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(TOOLS)
    return path


@pytest.fixture
def toolbox(tool_file):
    box = ToolBox([f"{tool_file}:{name}" for name in ("calc", "crash", "fail", "hang", "lookup")], timeout_s=1.0,
                  num_workers=1, max_turns=3)
    yield box
    box.close()


def call_text(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_parse_tool_calls_in_the_qwen_format():
    text = f"Let me compute. {call_text('calc', a=3, b=4)} and {call_text('lookup', key='x')} done"
    assert parse_tool_calls(text) == [ToolCall("calc", {"a": 3, "b": 4}), ToolCall("lookup", {"key": "x"})]
    assert parse_tool_calls("no calls here") == []


def test_parse_tool_calls_with_custom_tags_and_string_arguments():
    fmt = ToolCallFormat("[[", "]]")
    assert parse_tool_calls('[[{"name": "calc", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}]]', fmt) == [
        ToolCall("calc", {"a": 1, "b": 2})]


@pytest.mark.parametrize("text, problem", [
    ('<tool_call>{"name": "calc", "arguments": {"a": 1,}}</tool_call>', "not valid JSON (Expecting property name"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no string "name"'),
    ('<tool_call>["calc"]</tool_call>', 'no string "name"'),
    ('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>', '"arguments" is list, not an object'),
    ('<tool_call>{"name": "calc"', "is not closed with </tool_call>"),
])
def test_malformed_calls_say_what_is_wrong(text, problem):
    [call] = parse_tool_calls(text)
    assert isinstance(call, MalformedToolCall) and problem in call.problem


def test_schema_from_type_hints_and_docstring(tool_file):
    name, fn, _ = load_tool(f"{tool_file}:calc")
    assert name == "calc"
    assert tool_schema(fn) == {"type": "function", "function": {
        "name": "calc", "description": "Multiply or add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first number."},
            "b": {"type": "integer", "description": "The second number."},
            "op": {"type": "string", "description": "Which operation: mul or add."}}, "required": ["a", "b"]},
        "return": {"type": "integer"}}}


def test_bad_tool_specs_are_one_sentence(tool_file):
    with pytest.raises(EnvironmentSpecError, match=r"has no function 'nope' \(functions in it: calc, fail, hang"):
        ToolBox([f"{tool_file}:nope"])
    with pytest.raises(EnvironmentSpecError, match="does not exist"):
        ToolBox(["missing.py:calc"])
    with pytest.raises(EnvironmentSpecError,
                       match="undocumented' has no usable schema .*; give every argument a type hint"):
        ToolBox([f"{tool_file}:undocumented"])


def test_an_episode_calls_tools_and_ends_on_an_answer(toolbox):
    env = toolbox({"prompt": "What is 3*4?"})
    assert env.reset() == [{"role": "user", "content": "What is 3*4?"}]
    result = env.step(call_text("calc", a=3, b=4) + call_text("lookup", key="abc"))
    assert not result.done and result.reward is None
    assert result.observation == [{"role": "tool", "name": "calc", "content": "12"},
                                  {"role": "tool", "name": "lookup", "content": '{"key": "abc", "value": 3}'}]
    final = env.step("The answer is 12.")
    assert final.done and final.observation == []
    assert [r.name for r in env.records] == ["calc", "lookup"] and not any(r.error for r in env.records)


def test_a_raising_tool_becomes_a_counted_observation(toolbox, tool_file):
    env = toolbox({"prompt": "p"})
    result = env.step(call_text("fail", x=7))
    [message] = result.observation
    line = TOOLS.splitlines().index('    raise ValueError(f"cannot handle {x}")') + 1
    # The user's tool code by file:line: short in what the model sees, the full path in the record.
    assert message["content"] == f"error: ValueError: cannot handle 7 (at tools.py:{line} in fail)"
    [record] = result.info["tool_calls"]
    assert record.error and not record.timed_out and record.where == f"{tool_file}:{line} in fail"


def test_a_hanging_tool_is_killed_at_its_timeout_and_the_next_call_works(toolbox):
    env = toolbox({"prompt": "p"})
    started = time.perf_counter()
    result = env.step(call_text("hang", seconds=60))
    assert time.perf_counter() - started < 5.0
    assert result.observation[0]["content"] == ("error: the tool 'hang' did not finish within its timeout of 1 s "
                                                "and was stopped.")
    assert env.records[0].timed_out and env.records[0].error
    assert env.step(call_text("calc", a=2, b=5, op="add")).observation[0]["content"] == "7"


def test_a_tool_that_kills_its_process_is_an_error_and_the_worker_restarts(toolbox):
    env = toolbox({"prompt": "p"})
    content = env.step(call_text("crash")).observation[0]["content"]
    assert content == "error: the tool 'crash' crashed (its process exited)."
    assert env.records[0].error
    assert env.step(call_text("calc", a=2, b=3)).observation[0]["content"] == "6"


def test_unknown_tool_and_malformed_json_are_observations(toolbox):
    env = toolbox({"prompt": "p"})
    unknown = env.step(call_text("search", q="x")).observation[0]["content"]
    assert unknown == "error: there is no tool 'search'; the tools are calc, crash, fail, hang, lookup."
    broken = env.step('<tool_call>{"name": "calc", "arguments": {a: 1}}</tool_call>').observation[0]["content"]
    assert broken.startswith("error: the tool call is not valid JSON (Expecting property name enclosed in double "
                             "quotes at character")
    assert [r.malformed for r in env.records] == [False, True] and all(r.error for r in env.records)


def test_wrong_arguments_are_an_error_observation(toolbox):
    env = toolbox({"prompt": "p"})
    content = env.step(call_text("calc", a=1)).observation[0]["content"]
    assert content.startswith("error: TypeError: calc() missing 1 required positional argument: 'b'")


def test_max_turns_ends_the_episode(toolbox):
    env = toolbox({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    assert [m["role"] for m in env.reset()] == ["system", "user"]
    results = [env.step(call_text("calc", a=1, b=1)) for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]


def test_long_results_are_truncated_with_a_marker(tool_file):
    with ToolBox([f"{tool_file}:calc"], max_result_chars=3, num_workers=1) as box:
        content = box({"prompt": "p"}).step(call_text("calc", a=123456, b=1)).observation[0]["content"]
    assert content == "123\n... [truncated 3 characters]"


def test_the_tool_environment_runs_behind_the_session_adapter(toolbox):
    session = EnvironmentSession(toolbox, {"prompt": "q"}, name="tools", sample=0)
    assert run_sync(session.reset()) == [{"role": "user", "content": "q"}]
    assert run_sync(session.step(call_text("calc", a=6, b=7))).observation[0]["content"] == "42"


def test_a_missing_prompt_column_names_the_columns(toolbox):
    session = EnvironmentSession(toolbox, {"question": "q"}, name="tools", sample=4)
    with pytest.raises(Exception, match=r"neither a 'messages' column nor 'prompt' \(its columns: \['question'\]\)"
                                        r".* in reset\(\) for sample 4"):
        run_sync(session.reset())


def test_the_workers_folder_does_not_shadow_user_imports(tmp_path):
    # The worker runs as a script from hybridrl/envs/; its siblings (tools.py, base.py) must not be importable.
    (tmp_path / "probe_tools.py").write_text(
        'import importlib.util\n\n\ndef probe() -> str:\n    """Probe."""\n'
        '    return str([importlib.util.find_spec(n) is None for n in ("tool_worker", "base")])\n')
    with ToolBox([f"{tmp_path / 'probe_tools.py'}:probe"], num_workers=1) as box:
        assert box({"prompt": "p"}).step(call_text("probe")).observation[0]["content"] == "[True, True]"


def test_the_sandboxed_python_tool():
    with ToolBox([python], timeout_s=20.0, num_workers=1) as box:
        assert box.schemas[0]["function"]["name"] == "python"
        assert box.schemas[0]["function"]["parameters"]["required"] == ["code"]
        env = box({"prompt": "p"})
        assert env.step(call_text("python", code="print(6 * 7)")).observation[0]["content"] == "42\n"
        failed = env.step(call_text("python", code="1 / 0")).observation[0]["content"]
        assert "ZeroDivisionError: division by zero" in failed and failed.endswith("[exited with status 1]")


def test_tools_given_as_functions_must_be_module_level():
    def local(x: int) -> int:
        """Local.

        Args:
            x: A number.
        """
        return x

    with pytest.raises(EnvironmentSpecError, match="not a module-level function"):
        ToolBox([local])
    with pytest.raises(EnvironmentSpecError, match="two tools share a name"):
        ToolBox([python, python])


def test_a_tool_file_can_offer_the_sandboxed_python_tool_by_import(tmp_path):
    (tmp_path / "my_tools.py").write_text("from hybridrl.envs.sandbox import python  # noqa: F401\n")
    with ToolBox([f"{tmp_path / 'my_tools.py'}:python"], timeout_s=20.0, num_workers=1) as box:
        content = box({"prompt": "p"}).step(call_text("python", code="print(2 ** 10)")).observation[0]["content"]
    assert content == "1024\n"


SANDBOX_TOOL = '''
from hybridrl.envs.sandbox import SandboxLimits, run_python


def sandboxed(code: str) -> str:
    """Run a program in the rlimits sandbox with a long wall-clock limit.

    Args:
        code: The program.
    """
    return run_python(code, limits=SandboxLimits(wall_s=120, cpu_s=120), isolation="rlimits").stdout
'''


def test_a_sandboxed_program_dies_with_the_tool_worker_killed_at_its_timeout(tmp_path):
    """The worker that would enforce the sandbox's wall_s is killed first (tool timeout 1 s): the sleeping program
    must not outlive it (it is in a session of its own, so the worker's process-group kill misses it), nor its
    temporary working directory."""
    (tmp_path / "sandbox_tools.py").write_text(SANDBOX_TOOL)
    pid_file = tmp_path / "pid"
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{os.getcwd()}}')\ntime.sleep(600)\n"
    with ToolBox([f"{tmp_path / 'sandbox_tools.py'}:sandboxed"], timeout_s=1.0, num_workers=1) as box:
        outcome = box.call(ToolCall("sandboxed", {"code": code}))
    assert outcome.timed_out and pid_file.exists()
    pid, workdir = pid_file.read_text().split(" ", 1)
    deadline = time.monotonic() + 5.0
    while _running(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(int(pid))
    assert not os.path.exists(workdir)  # its working directory too, which the killed worker could not remove


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow, or absent in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_that_died_between_calls_is_replaced_and_its_folder_removed(toolbox):
    assert toolbox.call(ToolCall("calc", {"a": 2, "b": 3})).text == "6"
    [worker] = toolbox._workers
    dead, folder = worker.process, worker.temp_dir
    os.kill(dead.pid, 9)
    dead.wait()
    assert toolbox.call(ToolCall("calc", {"a": 2, "b": 4})).text == "8"
    assert worker.process is not dead and not os.path.exists(folder) and os.path.isdir(worker.temp_dir)
