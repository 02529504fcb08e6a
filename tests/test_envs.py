"""The environment interface and its adapter, the episode record, and token-exact observation rendering with a
Qwen2.5-style chat template written here (no model hub)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import time

import pytest

from hybridrl.envs.base import (EAGER_TASKS, EnvironmentCodeError, EnvironmentSession, EnvironmentSpecError,
                                StepResult, load_environment, run_sync, start_task)
from hybridrl.envs.episode import Episode, ToolRecord, TurnSpan, episode_metrics
from hybridrl.envs.rendering import ChatTemplateError, ObservationRenderer
from hybridrl.models.loading import build_char_tokenizer
from hybridrl.rollout.base import Generation, SamplingParams
from hybridrl.rollout.multiturn import (EpisodeBudget, PromptOverBudgetError, generate_episodes_reference,
                                        make_sessions)

ENVIRONMENTS = '''
from hybridrl.envs.base import StepResult


class Guess:
    """Sync: the answer is in the row; two tries."""

    def __init__(self, row):
        self.answer = row["answer"]
        self.tries = 0

    def reset(self):
        return [{"role": "user", "content": "Guess my number."}]

    def step(self, text):
        self.tries += 1
        if text.strip() == str(self.answer):
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "No."}], reward=0.0, done=self.tries >= 2)


class SlowGuess(Guess):
    def step(self, text):
        import time
        time.sleep(0.5)
        return super().step(text)


class AsyncGuess(Guess):
    async def reset(self):
        return super().reset()

    async def step(self, text):
        return super().step(text)


class Broken(Guess):
    def step(self, text):
        return self.helper(text)

    def helper(self, text):
        raise KeyError(text)


class WrongReturn(Guess):
    def step(self, text):
        return [], 1.0, True


class BadReward(Guess):
    def step(self, text):
        return StepResult(reward=float("nan"))


class BadMessages(Guess):
    def reset(self):
        return [{"role": "user"}]


def make_guess(row):
    return Guess(row)
'''


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVIRONMENTS)
    return path


def session(env_file, name: str, row=None, sample: int = 0) -> EnvironmentSession:
    spec = f"{env_file}:{name}"
    return EnvironmentSession(load_environment(spec), row or {"answer": 7}, name=spec, sample=sample)


@pytest.mark.parametrize("name", ["Guess", "AsyncGuess", "make_guess"])
def test_sync_async_and_function_environments_behave_alike(env_file, name):
    env = session(env_file, name)
    assert run_sync(env.reset()) == [{"role": "user", "content": "Guess my number."}]
    first = run_sync(env.step("3"))
    assert first.observation == [{"role": "user", "content": "No."}] and first.reward == 0.0 and not first.done
    second = run_sync(env.step(" 7 "))
    assert second.done and second.reward == 1.0 and second.observation == []


def test_slow_sync_steps_do_not_block_the_event_loop(env_file):
    sessions = [session(env_file, "SlowGuess", sample=i) for i in range(4)]

    async def all_steps():
        return await asyncio.gather(*(s.step("7") for s in sessions))

    started = time.perf_counter()
    results = asyncio.run(all_steps())
    assert all(r.done for r in results)
    assert time.perf_counter() - started < 1.5, "four 0.5 s steps must overlap (each runs in a thread)"


def test_environment_code_that_raises_names_environment_sample_and_line(env_file):
    env = session(env_file, "Broken", sample=5)
    with pytest.raises(EnvironmentCodeError) as caught:
        run_sync(env.step("x"))
    message = str(caught.value)
    line = ENVIRONMENTS.splitlines().index("        raise KeyError(text)") + 1
    assert message.startswith(f"environment '{env_file}:Broken' raised KeyError: 'x' (at {env_file}:{line} in "
                              f"helper <- {env_file}:{line - 3} in step) in step 1 for sample 5;")


def test_a_failing_constructor_is_one_sentence(env_file):
    with pytest.raises(EnvironmentCodeError, match=r"raised KeyError: 'answer' .* in making it from the data row for "
                                                   r"sample 0; fix the environment or that sample's data\."):
        session(env_file, "Guess", row={"question": "q"})


@pytest.mark.parametrize("name, problem", [
    ("WrongReturn", "returned tuple; step() must return hybridrl.envs.StepResult"),
    ("BadReward", "returned reward nan; a reward must be a finite number or None"),
])
def test_unusable_step_results_are_refused(env_file, name, problem):
    with pytest.raises(EnvironmentCodeError, match=problem.replace("(", r"\(").replace(")", r"\)")) as error:
        run_sync(session(env_file, name).step("x"))
    line = next(i for i, text in enumerate(env_file.read_text().splitlines(), 1) if f"class {name}(" in text) + 1
    assert f"envs.py:{line} in step) in step 1 for sample 0" in str(error.value)  # the user's step, by file:line


def test_rewards_must_be_finite_numbers_other_than_bools_from_sync_and_async_steps():
    """The async path (no worker thread, the engine's common case) checks what the sync one does, and says the same."""
    import numpy

    def environment(reward, is_async):
        async def async_step(text):
            return StepResult(reward=reward)
        return type("Env", (), dict(reset=lambda self: [], step=(lambda self, text: async_step(text)) if is_async
                                    else (lambda self, text: StepResult(reward=reward))))

    for reward, usable in ((1.0, True), (2, True), (numpy.float32(0.5), True), (None, True), (float("inf"), False),
                           (numpy.float32("nan"), False), (True, False), ("1", False)):
        for is_async in (False, True):
            env = EnvironmentSession(lambda row: environment(reward, is_async)(), {}, name="env.py:Env", sample=3)
            env._async_step = is_async  # a lambda returning a coroutine reads as sync: say which path to take
            if usable:
                assert run_sync(env.step("x")).reward == reward
            else:
                with pytest.raises(EnvironmentCodeError, match=re.escape(f"returned reward {reward!r}; a reward "
                                                                         "must be a finite number or None")
                                   + ".* in step 1 for sample 3"):
                    run_sync(env.step("x"))


def test_run_sync_hands_the_result_over_without_writing_it_out():
    """`asyncio.run`, putting back the SIGINT handler on the main thread, formats the task it ran (with its result)
    into a message it drops: a multi-turn call's result is hundreds of episodes, so `run_sync` keeps it out of that
    task."""
    written = []

    class Result:
        def __repr__(self):
            written.append(self)
            return "Result()"

    async def make():
        return Result()

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a plain `python` process
    try:
        assert isinstance(run_sync(make()), Result)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not written


def test_an_async_step_that_raises_is_one_sentence():
    class Raising:
        def __init__(self, row):
            pass

        async def reset(self):
            return []

        async def step(self, text):
            raise KeyError(text)

    env = EnvironmentSession(Raising, {}, name="env.py:Raising", sample=2)
    with pytest.raises(EnvironmentCodeError, match=r"environment 'env.py:Raising' raised KeyError: 'x' .*in step 1 "
                                                   r"for sample 2; fix the environment"):
        run_sync(env.step("x"))


def test_unusable_messages_are_refused(env_file):
    with pytest.raises(EnvironmentCodeError, match=r"returned message 0 as \{'role': 'user'\}; each message must be "
                                                   r"a dict with string 'role' and 'content' \(at .*envs\.py:\d+ in "
                                                   r"reset\) in reset\(\)"):
        run_sync(session(env_file, "BadMessages").reset())


def test_environment_specs_that_do_not_resolve(env_file, tmp_path):
    with pytest.raises(EnvironmentSpecError, match="not of the form path/to/file.py:Name"):
        load_environment("envs.py")
    with pytest.raises(EnvironmentSpecError, match="does not exist"):
        load_environment("nowhere.py:Guess")
    with pytest.raises(EnvironmentSpecError, match=r"no class or function 'Gues' \(defined in it: Guess, SlowGuess, AsyncGuess"):
        load_environment(f"{env_file}:Gues")
    broken = tmp_path / "broken_env.py"
    broken.write_text("x = 1\nraise RuntimeError('boom')\n")
    with pytest.raises(EnvironmentSpecError, match=rf"raised RuntimeError: boom \(at {broken}:2 in <module>\)"):
        load_environment(f"{broken}:X")


# ----------------------------------------------------------------------------------------------
# Episode


def test_episode_builds_a_holed_mask_and_checks_its_invariants():
    episode = Episode()
    episode.add_prompt([5, 6, 7])
    episode.add_sampled([8, 9], [-0.1, -2.0])
    episode.add_observation([10, 11, 12])
    episode.add_sampled([13], [-0.3])
    episode.check()
    assert episode.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert episode.behaviour_logprobs == [0.0, 0.0, 0.0, -0.1, -2.0, 0.0, 0.0, 0.0, -0.3]
    assert [(s.kind, s.start, s.end) for s in episode.spans] == [
        ("prompt", 0, 3), ("assistant", 3, 5), ("observation", 5, 8), ("assistant", 8, 9)]
    assert episode.num_turns == 2 and episode.num_sampled_tokens == 3
    assert math.isclose(episode.observation_share, 3 / 6)


@pytest.mark.parametrize("breakage, problem", [
    (lambda e: e.loss_mask.append(0), "lengths differ"),
    (lambda e: e.behaviour_logprobs.__setitem__(0, -1.0), "token 0 is not sampled (mask 0) but has log-prob -1.0"),
    (lambda e: e.behaviour_logprobs.__setitem__(2, float("nan")), "sampled token 2 has log-prob nan"),
    (lambda e: e.behaviour_logprobs.__setitem__(2, 0.5), "sampled token 2 has log-prob 0.5"),
    (lambda e: e.loss_mask.__setitem__(2, 2), "loss_mask[2] is 2"),
    (lambda e: e.spans.__setitem__(1, TurnSpan("assistant", 1, 4)), "spans do not tile"),
    (lambda e: e.spans.__setitem__(0, TurnSpan("assistant", 0, 2)), "mask values other than 1"),
])
def test_episode_check_names_the_broken_invariant(breakage, problem):
    episode = Episode()
    episode.add_prompt([1, 2])
    episode.add_sampled([3, 4], [-1.0, -1.0])
    breakage(episode)
    with pytest.raises(AssertionError, match=problem.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        episode.check()


# ----------------------------------------------------------------------------------------------
# Token-exact rendering

# The tool parts of Qwen2.5-Instruct's template: tools in the system block, consecutive tool results grouped in
# one user turn as <tool_response> blocks (so only a whole observation is prefix-stable, not each message).
QWEN_STYLE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\n\n# Tools\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or message.role == 'assistant' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

NO_TOOL_ROLE = r"""
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant'] %}
{{ raise_exception('Unknown role: ' + message.role) }}{%- endif %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

CALC_SCHEMA = {"type": "function", "function": {"name": "calc", "description": "Multiply.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def qwen_style_tokenizer(template: str = QWEN_STYLE):
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["calc"])  # a multi-character token, so "calc" has a second (non-canonical) spelling
    tokenizer.chat_template = template
    return tokenizer


def spelled_out(tokenizer, text: str) -> list[int]:
    """Ids of `text` one character each: a valid sequence the tokenizer itself would never produce for "calc"."""
    return [tokenizer.convert_tokens_to_ids(char) for char in text]


def test_observation_ids_continue_the_sampled_ids_token_exactly():
    tokenizer = qwen_style_tokenizer()
    renderer = ObservationRenderer(tokenizer, tools=[CALC_SCHEMA])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "3*4?"}]
    episode = Episode()
    episode.add_prompt(renderer.prompt_ids(messages))

    call = '<tool_call>\n{"name": "calc", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    sampled = spelled_out(tokenizer, call) + [im_end]  # as an engine samples them: text, then the stop token
    episode.add_sampled(sampled, [-0.5] * len(sampled))
    messages.append({"role": "assistant", "content": call})
    observation = [{"role": "tool", "name": "calc", "content": "12"}, {"role": "tool", "name": "calc", "content": "ok"}]
    episode.add_observation(renderer.observation_ids(messages, observation, sampled))
    messages += observation

    answer = spelled_out(tokenizer, "It is 12.") + [im_end]
    episode.add_sampled(answer, [-0.25] * len(answer))
    episode.check()

    expected = renderer.render(messages, add_generation_prompt=True)
    turn_one = episode.spans[2].end
    assert tokenizer.decode(episode.token_ids[:turn_one], skip_special_tokens=False) == expected
    assert tokenizer.decode(episode.span_ids(episode.spans[2]), skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\nok\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    # The trained ids are the sampled ids, not a re-tokenization of the same text (which spells "calc" as one id).
    assert episode.span_ids(episode.spans[1]) == sampled
    assert tokenizer.encode(expected, add_special_tokens=False) != episode.token_ids[:turn_one]
    assert [episode.token_ids[s.start:s.end] for s in episode.spans if s.kind == "assistant"] == [sampled, answer]


def test_a_turn_cut_before_its_stop_token_gets_the_templates_closing():
    tokenizer = qwen_style_tokenizer()
    renderer = ObservationRenderer(tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "partial"}]
    ids = renderer.observation_ids(messages, [{"role": "user", "content": "go on"}], spelled_out(tokenizer, "partial"))
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_without_a_tool_role_is_refused_at_start():
    with pytest.raises(ChatTemplateError, match=r"cannot render a 'tool' message \(Unknown role: tool\); use the "
                                                r"model's tool-calling chat template"):
        ObservationRenderer(qwen_style_tokenizer(NO_TOOL_ROLE))
    dropping = NO_TOOL_ROLE.replace("{{ raise_exception('Unknown role: ' + message.role) }}", "")
    dropping = dropping.replace("{{- '<|im_start|>' +", "{%- if message.role != 'tool' %}{{- '<|im_start|>' +")
    dropping = dropping.replace("'<|im_end|>\\n' }}", "'<|im_end|>\\n' }}{%- endif %}")
    with pytest.raises(ChatTemplateError, match="drops 'tool' messages"):
        ObservationRenderer(qwen_style_tokenizer(dropping))
    no_template = build_char_tokenizer()
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ObservationRenderer(no_template)


def test_templates_that_rewrite_earlier_turns_are_refused():
    counting = QWEN_STYLE.replace("'You are a helpful assistant.'", "'Turns: ' + messages | length | string")
    renderer = ObservationRenderer(qwen_style_tokenizer(counting), tools=[CALC_SCHEMA])
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        renderer.observation_ids(messages, [{"role": "tool", "content": "1"}])
    trimming = QWEN_STYLE.replace("message.content + '<|im_end|>\\n' }}", "message.content | trim + '<|im_end|>\\n' }}")
    renderer = ObservationRenderer(qwen_style_tokenizer(trimming))
    messages[-1] = {"role": "assistant", "content": "x  "}
    with pytest.raises(ChatTemplateError, match="does not write the assistant's text verbatim"):
        renderer.observation_ids(messages, [{"role": "tool", "content": "1"}])


def test_tools_appear_in_the_rendered_system_block():
    renderer = ObservationRenderer(qwen_style_tokenizer(), tools=[CALC_SCHEMA])
    text = renderer.render([{"role": "user", "content": "q"}], add_generation_prompt=True)
    assert json.dumps(CALC_SCHEMA) in text
    assert text.endswith("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")


def test_episode_metrics():
    first, second = Episode(), Episode()
    for episode in (first, second):
        episode.add_prompt([1, 2, 3])
        episode.add_sampled([4, 5], [-1.0, -1.0])
    first.add_observation([6, 7])
    first.add_sampled([8, 9], [-1.0, -1.0])
    first.tool_calls = [ToolRecord("calc", {}, "12", latency_s=0.1),
                        ToolRecord("calc", {}, "error: timeout", error=True, timed_out=True, latency_s=1.0),
                        ToolRecord("", {}, "error: not JSON", error=True, malformed=True)]
    metrics = episode_metrics([first, second])
    assert metrics == pytest.approx({
        "rollout/turns_per_episode": 1.5, "rollout/tool_calls_per_episode": 1.5,
        "rollout/tool_errors_per_episode": 1.0, "rollout/tool_timeouts_per_episode": 0.5,
        "rollout/tool_malformed_per_episode": 0.5, "rollout/observation_token_share": 2 / 8,
        "rollout/tool_latency_p50_s": 0.55, "rollout/tool_latency_p95_s": 0.955})
    assert episode_metrics([]) == {}


# ------------------------------------------------------------------------------------------------
# The reference episode loop (`rollout/multiturn.py`): budgets at start, closing, a caller's running event loop


class Closing:
    """Two turns; records its close()."""

    def __init__(self, row, closed):
        self.row, self.closed = row, closed

    def reset(self):
        return [{"role": "user", "content": self.row["prompt"]}]

    def step(self, text):
        return StepResult(reward=1.0, done=True)

    def close(self):
        self.closed.append(self.row["prompt"])


class FixedTurns:
    """A backend whose every turn is the same three sampled ids, ending at the stop token (cut at the turn's limit)."""

    def __init__(self, tokenizer):
        self.ids = [*tokenizer.encode("ok", add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def generate(self, prompts, params):
        ids = self.ids[:params.max_new_tokens]
        reason = "stop" if len(ids) == len(self.ids) else "length"
        return [Generation(i, list(ids), [-0.5] * len(ids), reason) for i in range(len(prompts))]


def reference_run(rows, closed, max_episode_tokens=400):
    tokenizer = qwen_style_tokenizer()
    sessions = make_sessions(lambda row: Closing(row, closed), rows, n=2, name="closing.py:Closing")
    return generate_episodes_reference(FixedTurns(tokenizer), sessions, ObservationRenderer(tokenizer),
                                       SamplingParams(max_new_tokens=8), EpisodeBudget(max_episode_tokens=
                                                                                       max_episode_tokens),
                                       {tokenizer.convert_tokens_to_ids("<|im_end|>")})


def test_a_prompt_over_the_episode_budget_is_one_sentence_and_every_session_is_closed():
    closed = []
    with pytest.raises(EnvironmentCodeError) as error:  # the trainer saves finished steps and tells every rank
        reference_run([{"prompt": "hi"}, {"prompt": "a long question " * 10}], closed, max_episode_tokens=40)
    message = str(error.value)
    assert isinstance(error.value, PromptOverBudgetError) and "closing.py:Closing" in message
    assert "sample 2 ('a long question a long question" in message and "raise env.max_episode_tokens above" in message
    assert message.count("; ") == 1 and message.endswith("prompt.") and ". " not in message
    assert len(closed) == 4  # no session outlives the failed call


def test_the_reference_loop_runs_inside_a_running_event_loop():
    """A Jupyter cell runs its code inside an event loop, where `asyncio.run` refuses to start another."""
    closed = []

    async def notebook_cell():
        return reference_run([{"prompt": "hi"}], closed)

    episodes = asyncio.run(notebook_cell())
    assert [episode.done_reason for episode in episodes] == ["done", "done"] and len(closed) == 2


class LongObservations(Closing):
    def step(self, text):
        return StepResult([{"role": "tool", "name": "echo", "content": "y" * 200}])


@pytest.mark.parametrize("room, reason, turns", [(0, "max_tokens", 1), (1, "max_tokens", 2), (10**3, "max_turns", 4)])
def test_episode_budgets_at_their_edges_and_the_messages_are_what_the_model_saw(room, reason, turns):
    """A turn of 3 ids and observations cut to 5 ids and the template's next-turn opening: an observation that would
    leave `room` = 0 tokens ends the episode unshown; room for 1 shows it and samples one more token; the messages
    hold exactly what was shown."""
    tokenizer = qwen_style_tokenizer()
    renderer = ObservationRenderer(tokenizer)
    prompt = len(renderer.prompt_ids([{"role": "user", "content": "hi"}]))
    opening = renderer.encode("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    cut = 5 + len(opening)
    sessions = make_sessions(lambda row: LongObservations(row, []), [{"prompt": "hi"}], n=1, name="long")
    episode, = generate_episodes_reference(FixedTurns(tokenizer), sessions, renderer, SamplingParams(max_new_tokens=8),
                                           EpisodeBudget(max_turns=4, max_episode_tokens=prompt + 3 + cut + room,
                                                         max_observation_tokens=cut),
                                           {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    episode.check()
    assert episode.done_reason == reason and episode.num_turns == turns
    assert len(episode.token_ids) == {0: prompt + 3, 1: prompt + 3 + cut + 1, 10**3: prompt + 4 * 3 + 3 * cut}[room]
    kinds = [span.kind for span in episode.spans[1:]]
    assert [m["role"] for m in episode.messages] == ["user"] + [{"assistant": "assistant", "observation": "tool"}[k]
                                                                for k in kinds]
    marker = renderer.encode(EpisodeBudget().truncation_marker)[:5]  # longer than the cut: the marker's first ids
    assert all(episode.span_ids(span) == marker + opening for span in episode.spans if span.kind == "observation")


class SlowAsyncClose(Closing):
    """Sample 0's close() raises; the others close asynchronously, after a moment."""

    async def close(self):
        if self.row["prompt"] == "bad":
            raise OSError("disk gone")
        await asyncio.sleep(0.05)
        self.closed.append(self.row["prompt"])


def test_every_environment_is_closed_when_one_close_raises():
    closed = []
    tokenizer = qwen_style_tokenizer()
    rows = [{"prompt": "bad"}, {"prompt": "a"}, {"prompt": "b"}]
    sessions = make_sessions(lambda row: SlowAsyncClose(row, closed), rows, n=1, name="close.py:SlowAsyncClose")
    with pytest.raises(EnvironmentCodeError, match=r"raised OSError: disk gone .*in close\(\) for sample 0"):
        generate_episodes_reference(FixedTurns(tokenizer), sessions, ObservationRenderer(tokenizer),
                                    SamplingParams(max_new_tokens=8), EpisodeBudget(),
                                    {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert sorted(closed) == ["a", "b"]


class Silent(Closing):
    def step(self, text):
        return StepResult()


def test_a_step_with_neither_observation_nor_done_names_the_users_step(tmp_path):
    closed = []
    tokenizer = qwen_style_tokenizer()
    sessions = make_sessions(lambda row: Silent(row, closed), [{"prompt": "hi"}], n=1, name="silent.py:Silent")
    with pytest.raises(EnvironmentCodeError, match=r"returned no observation with done=False \(at .*test_envs\.py:\d+ "
                                                   r"in step\) in step 1 for sample 0; return the messages"):
        generate_episodes_reference(FixedTurns(tokenizer), sessions, ObservationRenderer(tokenizer),
                                    SamplingParams(max_new_tokens=8), EpisodeBudget(),
                                    {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert closed == ["hi"]


def test_the_next_turn_opening_is_what_the_template_writes_after_the_last_content():
    renderer = ObservationRenderer(qwen_style_tokenizer(), tools=[CALC_SCHEMA])
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                    {"role": "tool", "name": "calc", "content": "36"}, {"role": "tool", "name": "calc", "content": "7"}]
    assert renderer.tokenizer.decode(renderer.next_turn_opening(conversation)) == \
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    conversation[-1]["content"] = ""  # nothing to find: the generation prompt alone
    assert renderer.tokenizer.decode(renderer.next_turn_opening(conversation)) == "<|im_start|>assistant\n"


def test_start_task_runs_an_environment_call_up_to_its_first_wait_where_python_can():
    """Python 3.12+: a call that needs no waiting is done when `start_task` returns, one that waits has started, and
    an error raised at once stays in its task (raised where it is awaited, as before). Older Pythons: only scheduled.
    Either way the results awaited are the same."""
    async def main():
        events = []

        async def quick():
            events.append("quick")
            return 1

        async def slow():
            events.append("slow started")
            await asyncio.sleep(0.01)
            return 2

        async def failing():
            raise ValueError("at once")

        tasks = [start_task(call()) for call in (quick, slow, failing)]
        if EAGER_TASKS:
            assert events == ["quick", "slow started"]
            assert [task.done() for task in tasks] == [True, False, True]
        else:
            assert events == [] and not any(task.done() for task in tasks)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert results[:2] == [1, 2] and isinstance(results[2], ValueError)

    asyncio.run(main())
