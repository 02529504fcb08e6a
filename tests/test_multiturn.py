"""Multi-turn episodes: the built-in engine (KV kept across turns) against the HF reference loop (each turn
regenerated from the whole sequence), on tiny seeded float32 models with a Qwen-style chat template written here."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from hybridrl.envs.base import EnvironmentCodeError, EnvironmentSession, StepResult, load_environment
from hybridrl.envs.rendering import ObservationRenderer
from hybridrl.envs.tools import ToolBox, ToolEnvironment
from hybridrl.models.loading import build_char_tokenizer
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.llama_forward import extend, prefill, rope_table
from hybridrl.rollout.engine.scheduler import Scheduler, prefill_chunks
from hybridrl.rollout.engine.weights import resolve_weights
from hybridrl.rollout.hf import HFBackend
from hybridrl.rollout.multiturn import EpisodeBudget, make_sessions

TEMPLATE = r"""
{%- for message in messages %}
{%- if message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
ROWS = [{"prompt": "1+2"}, {"prompt": "what is 12*3?"}, {"prompt": "hi"}]


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["calc"])  # "calc" spelled c-a-l-c decodes to text that encodes to this one id
    tokenizer.chat_template = TEMPLATE
    return tokenizer


TOKENIZER = make_tokenizer()
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")


def make_model(family: str = "llama", seed: int = 0):
    config = dict(vocab_size=len(TOKENIZER), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=None,
                  eos_token_id=IM_END, pad_token_id=0, initializer_range=0.2)
    torch.manual_seed(seed)
    config = LlamaConfig(**config, tie_word_embeddings=False) if family == "llama" else \
        Qwen2Config(**config, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return model


class Echo:
    """Answers every assistant turn with a fixed tool result and ends after `turns` steps (reward: the step)."""

    def __init__(self, row, turns: int = 3, observation: str = "ok"):
        self.row, self.turns, self.observation, self.steps = row, turns, observation, 0

    def reset(self):
        return [{"role": "user", "content": self.row["prompt"]}]

    def step(self, text):
        self.steps += 1
        if self.steps >= self.turns:
            return StepResult(reward=float(self.steps), done=True)
        return StepResult([{"role": "tool", "name": "echo", "content": f"{self.observation} {self.steps}"}],
                          reward=float(self.steps))


def sessions(factory=Echo, n: int = 2, rows=ROWS):
    return make_sessions(factory, rows, n=n, name="test_multiturn.py:Echo")


BUDGET = EpisodeBudget(max_turns=4, max_episode_tokens=400)


def both(model, factory=Echo, params=None, budget=BUDGET, n=2, rows=ROWS, **engine_options):
    params = params or SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=[IM_END])
    renderer = ObservationRenderer(TOKENIZER)
    engine = BuiltinBackend(model, tokenizer=TOKENIZER, sync_every=4, **engine_options)
    engine_episodes = engine.generate_episodes(sessions(factory, n, rows), renderer, params, budget)
    reference = HFBackend(model, TOKENIZER).generate_episodes(sessions(factory, n, rows), renderer, params, budget)
    return engine, engine_episodes, reference


def assert_same_episodes(engine_episodes, reference, atol=1e-5):
    assert len(engine_episodes) == len(reference)
    for mine, theirs in zip(engine_episodes, reference):
        mine.check()
        assert mine.token_ids == theirs.token_ids
        assert mine.loss_mask == theirs.loss_mask
        assert mine.spans == theirs.spans
        assert mine.done_reason == theirs.done_reason and mine.reward == theirs.reward
        assert mine.messages == theirs.messages
        torch.testing.assert_close(torch.tensor(mine.behaviour_logprobs), torch.tensor(theirs.behaviour_logprobs),
                                   atol=atol, rtol=0)


def forward_logprobs(model, episode, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each token of the episode under one forward pass, 0 where the mask is 0."""
    ids = torch.tensor([episode.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    logp = torch.log_softmax(logits / temperature, -1).gather(1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), logp]) * torch.tensor(episode.loss_mask)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_engine_episodes_equal_the_hf_reference(family):
    model = make_model(family)
    _, engine_episodes, reference = both(model)
    assert_same_episodes(engine_episodes, reference)
    assert {e.done_reason for e in engine_episodes} == {"done"}
    assert all(e.num_turns == 3 for e in engine_episodes)  # Echo ends after 3 steps
    kinds = [s.kind for s in engine_episodes[0].spans]
    assert kinds == ["prompt", "assistant", "observation", "assistant", "observation", "assistant"]
    for episode in engine_episodes:
        torch.testing.assert_close(torch.tensor(episode.behaviour_logprobs), forward_logprobs(model, episode),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_extend_continues_each_slot_like_a_full_forward(family):
    """The resume's fast path against one HF forward over the whole sequence: two slots of different context
    lengths continued in one padded batch (the shorter row's padding lands past its own end)."""
    model = make_model(family)
    w = resolve_weights(model, fuse_qkv=True)
    kv = torch.zeros(len(w.layers), 2, 3, w.num_kv_heads, 64, w.head_dim)
    cos, sin = rope_table(model, 64, "cpu", torch.float32)
    contexts, new = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]], [[20, 21], [22, 23, 24, 25, 26]]
    prefill(w, kv, cos, sin, torch.tensor([contexts[0], contexts[1] + [0] * 4]), torch.tensor([7, 3]),
            torch.tensor([0, 1]), torch.tensor([2, 0]))  # contexts in slots 2 and 0
    logits = extend(w, kv, cos, sin, torch.tensor([new[0] + [0] * 3, new[1]]), torch.tensor([2, 5]),
                    torch.tensor([7, 3]), torch.tensor([2, 0]), kv_end=9)
    for row, (context, ids) in enumerate(zip(contexts, new)):
        reference = model(torch.tensor([context + ids])).logits[0, -1].float()
        torch.testing.assert_close(logits[row], reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_fewer_slots_than_episodes_give_the_same_episodes(max_num_seqs):
    """Episodes wait for a slot, paused ones keep theirs, and compaction moves live ones around them."""
    model = make_model("llama")
    engine, engine_episodes, reference = both(model, max_num_seqs=max_num_seqs)
    assert engine.last_stats["num_slots"] == max_num_seqs
    assert_same_episodes(engine_episodes, reference)


def test_sampled_episodes_carry_their_own_logprobs_and_repeat_under_a_seed():
    """Sampled draws cannot line up with HF's (its sampler consumes torch's global RNG differently), so each backend
    is checked against a forward pass over its own episodes, and the engine against itself under the same seed."""
    model = make_model("llama")
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3, stop_token_ids=[IM_END])
    engine, engine_episodes, reference = both(model, params=params)
    for episode in engine_episodes + reference:
        episode.check()
        torch.testing.assert_close(torch.tensor(episode.behaviour_logprobs),
                                   forward_logprobs(model, episode, temperature=0.8), atol=1e-5, rtol=0)
    again = engine.generate_episodes(sessions(), ObservationRenderer(TOKENIZER), params,
                                     EpisodeBudget(max_turns=4, max_episode_tokens=400))
    assert [e.token_ids for e in again] == [e.token_ids for e in engine_episodes]
    assert len({tuple(e.token_ids) for e in engine_episodes}) > 1  # samples of one prompt differ


def chain_model():
    """A model whose greedy continuation of "\\n" is c, a, l, c, a, l, ...: attention and MLP outputs zeroed, so the
    logits depend on the current token only, and the lm_head maps \\n -> c -> a -> l -> c."""
    model = make_model("llama")
    ids = {char: TOKENIZER.convert_tokens_to_ids(char) for char in "\ncal"}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for axis, (char, following) in enumerate([("\n", "c"), ("c", "a"), ("a", "l"), ("l", "c")]):
            model.model.embed_tokens.weight[ids[char]] = torch.nn.functional.one_hot(torch.tensor(axis), 64).float()
            model.lm_head.weight[ids[following], axis] = 10.0
    return model


def test_the_episode_keeps_the_sampled_ids_not_a_retokenization():
    model = chain_model()
    params = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[IM_END])
    _, engine_episodes, reference = both(model, params=params, n=1)
    assert_same_episodes(engine_episodes, reference)
    spelled = [TOKENIZER.convert_tokens_to_ids(c) for c in "calcalca"]
    for episode in engine_episodes:
        turns = [episode.span_ids(s) for s in episode.spans if s.kind == "assistant"]
        assert turns == [spelled] * 3
        assert episode.messages[1] == {"role": "assistant", "content": "calcalca"}
        # The text would encode to other ids ("calc" is one token): a re-tokenizing rollout would fail above.
        assert TOKENIZER.encode("calcalca", add_special_tokens=False) != spelled


def test_a_stop_string_ends_the_turn_on_both_backends():
    model = chain_model()
    params = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[IM_END], stop_strings=["lc"])
    _, engine_episodes, reference = both(model, params=params, n=1)
    assert_same_episodes(engine_episodes, reference)
    turns = [engine_episodes[0].span_ids(s) for s in engine_episodes[0].spans if s.kind == "assistant"]
    assert turns == [[TOKENIZER.convert_tokens_to_ids(c) for c in "calc"]] * 3


def test_the_kv_cache_is_reused_across_turns():
    model = make_model("llama")
    engine, engine_episodes, reference = both(model)
    assert_same_episodes(engine_episodes, reference)
    stats = engine.last_stats
    distinct_prompts = {tuple(e.span_ids(e.spans[0])) for e in engine_episodes}
    observations = [s for e in engine_episodes for s in e.spans if s.kind == "observation"]
    # Each resume feeds the observation and the turn's last sampled token (no decode step wrote its KV); nothing
    # of the context before it is computed again.
    assert stats["prefill_tokens"] == sum(map(len, distinct_prompts)) + sum(s.end - s.start + 1 for s in observations)
    assert stats["observation_prefills"] == len(observations) == 2 * len(engine_episodes)
    recomputed = sum(map(len, distinct_prompts)) + sum(s.end for s in observations)  # the whole context each turn
    assert stats["prefill_tokens"] < recomputed


class Endless(Echo):
    def __init__(self, row):
        super().__init__(row, turns=10**6, observation="x" * 60)


def test_budgets_end_episodes():
    model = make_model("llama")
    _, engine_episodes, reference = both(model, factory=Endless, budget=EpisodeBudget(
        max_turns=3, max_episode_tokens=10**4, max_observation_tokens=40))
    assert_same_episodes(engine_episodes, reference)
    opening = TOKENIZER.encode("\n</tool_response><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    marker = TOKENIZER.encode(EpisodeBudget().truncation_marker, add_special_tokens=False)[:40 - len(opening)]
    for episode in engine_episodes:
        assert episode.done_reason == "max_turns" and episode.num_turns == 3
        for span in episode.spans:
            if span.kind == "observation":  # the marker's first ids and the template's next-turn opening
                assert episode.span_ids(span) == marker + opening
    _, engine_episodes, reference = both(model, factory=Endless, budget=EpisodeBudget(
        max_turns=50, max_episode_tokens=120, max_observation_tokens=20))
    assert_same_episodes(engine_episodes, reference)
    for episode in engine_episodes:
        assert episode.done_reason == "max_tokens" and len(episode.token_ids) <= 120
        assert episode.num_turns > 1


RAISING = '''
from hybridrl.envs.base import StepResult


class Flaky:
    def __init__(self, row):
        self.steps = 0

    def reset(self):
        return [{"role": "user", "content": "go"}]

    def step(self, text):
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("lost the connection")
        return StepResult([{"role": "user", "content": "again"}])
'''


@pytest.mark.parametrize("backend", ["builtin", "hf"])
def test_an_environment_that_raises_is_one_sentence(tmp_path, backend):
    (tmp_path / "flaky.py").write_text(RAISING)
    factory = load_environment(f"{tmp_path}/flaky.py:Flaky")
    model = make_model("llama")
    engine = BuiltinBackend(model, tokenizer=TOKENIZER) if backend == "builtin" else HFBackend(model, TOKENIZER)
    with pytest.raises(EnvironmentCodeError, match=r"environment 'flaky.py:Flaky' raised RuntimeError: lost the "
                       r"connection \(at .*flaky.py:15 in step\) in step 2 for sample (0|1)"):
        engine.generate_episodes(make_sessions(factory, [{}], n=2, name="flaky.py:Flaky"),
                                 ObservationRenderer(TOKENIZER), SamplingParams(max_new_tokens=4, temperature=0),
                                 EpisodeBudget())


TOOLS = '''
import time


def calc(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


def hang(seconds: int) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke up"
'''


class Scripted(ToolEnvironment):
    """Tiny models write no tool calls: this one replaces the first two turns' text by calls (a hang, then calc)."""

    def step(self, text):
        calls = ['<tool_call>{"name": "hang", "arguments": {"seconds": 60}}</tool_call>',
                 '<tool_call>{"name": "calc", "arguments": {"a": 12, "b": 3}}</tool_call>']
        return super().step(calls[self.num_turns] if self.num_turns < len(calls) else text)


def test_a_hanging_tool_is_an_observation_and_the_episode_goes_on(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS)
    with ToolBox([f"{tmp_path}/tools.py:calc", f"{tmp_path}/tools.py:hang"], timeout_s=1.0, num_workers=2,
                 max_turns=4) as toolbox:
        model = make_model("llama")
        renderer = ObservationRenderer(TOKENIZER, tools=toolbox.schemas)
        params = SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids=[IM_END],
                                stop_strings=["</tool_call>"])
        engine = BuiltinBackend(model, tokenizer=TOKENIZER)
        episodes = engine.generate_episodes(
            [EnvironmentSession(lambda row: Scripted(row, toolbox), ROWS[0], name="Scripted", sample=i)
             for i in range(2)], renderer, params, EpisodeBudget(max_turns=4))
    for episode in episodes:
        episode.check()
        assert episode.num_turns >= 3
        hung, calc = episode.tool_calls[:2]
        assert hung.timed_out and "did not finish within its timeout" in hung.result
        assert calc.result == "36" and not calc.error
        assert "did not finish within its timeout" in TOKENIZER.decode(episode.span_ids(episode.spans[2]))
    assert engine.last_stats["idle_s"] > 0.5  # both sequences waited on their tools with nothing to decode


class Closing(Echo):
    closed = 0

    def close(self):
        Closing.closed += 1


def test_the_prefix_shared_layout_refuses_multi_turn_and_closes_the_environments():
    engine = BuiltinBackend(make_model("llama"), tokenizer=TOKENIZER, attention="triton")
    Closing.closed = 0
    with pytest.raises(ValueError, match="per-slot KV layout.*attention=sdpa"):
        engine.generate_episodes(sessions(Closing), ObservationRenderer(TOKENIZER),
                                 SamplingParams(max_new_tokens=4, temperature=0), EpisodeBudget())
    assert Closing.closed == len(ROWS) * 2  # every environment made before the refusal


def test_episodes_can_be_generated_from_inside_a_running_event_loop():
    """A notebook cell runs inside an event loop, where `asyncio.run` refuses to start another."""
    model = make_model("llama")
    params = SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids=[IM_END])
    engine = BuiltinBackend(model, tokenizer=TOKENIZER)

    async def inside_a_loop():
        return engine.generate_episodes(sessions(), ObservationRenderer(TOKENIZER), params, BUDGET)

    episodes = asyncio.run(inside_a_loop())
    assert len(episodes) == len(ROWS) * 2 and all(episode.num_turns >= 1 for episode in episodes)


def test_n_must_be_one_session_per_episode():
    with pytest.raises(ValueError, match="SamplingParams.n must be 1"):
        BuiltinBackend(make_model("llama")).generate_episodes(
            sessions(), ObservationRenderer(TOKENIZER), SamplingParams(n=2), EpisodeBudget())


def test_scheduler_pauses_resumes_and_ends_turns_at_their_limit():
    scheduler = Scheduler([0, 0, 1], [4, 4, 2], num_slots=2)
    first, second = scheduler.admit()
    first.limit = 3
    assert scheduler.steps_until_sync(16, max_new_tokens=8) == 2  # the first turn's limit is 1 + 2 steps away
    scheduler.record_progress([3, 3])
    tokens = torch.zeros(2, 8, dtype=torch.long)
    ended = scheduler.harvest([0, 0], tokens, stop_ids={99}, cut_at_stop_string=None, pause=True)
    assert [(item.slot, item.length, item.reason) for item in ended] == [(0, 3, "length")]
    assert scheduler.paused == {0: first} and not scheduler.admit()  # a paused sequence keeps its slot
    assert scheduler.furthest_position() == 4 + 3
    scheduler.resume(0, context_len=12, limit=5)
    assert (first.prompt_len, first.generated, first.limit) == (12, 1, 5) and scheduler.live[0] is first
    scheduler.pause(0)
    scheduler.finish(0)  # the episode ended while paused: its slot goes to the waiting sequence
    assert [sequence.index for sequence in scheduler.admit()] == [2]


class Staggered:
    """A remote tool: answers each turn after the row's own delay, so turns that end together are answered a
    fraction of a millisecond apart, as a batch of tool calls started one after another is."""

    def __init__(self, row):
        self.row, self.steps = row, 0

    async def reset(self):
        return [{"role": "user", "content": self.row["prompt"]}]

    async def step(self, text):
        self.steps += 1
        await asyncio.sleep(self.row["delay"])
        return StepResult([{"role": "tool", "name": "t", "content": "ok"}], done=self.steps >= 3)


def test_turns_that_end_together_resume_together():
    """Without gathering the answers that come in over a few milliseconds, the first one resumes alone, the others
    wait a whole decode block, and every later turn ends in waves: more resume waves and more decode steps."""
    rows = [{"prompt": "hi", "delay": 0.03 + 0.0005 * i} for i in range(8)]
    engine = BuiltinBackend(make_model("llama"), tokenizer=TOKENIZER, sync_every=16)
    params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    episodes = engine.generate_episodes(make_sessions(Staggered, rows, n=1, name="test_multiturn.py:Staggered"),
                                        ObservationRenderer(TOKENIZER), params, BUDGET)
    assert [episode.num_turns for episode in episodes] == [3] * len(rows)
    stats = engine.last_stats
    assert stats["resume_waves"] == 2  # one per turn boundary
    assert stats["decode_steps"] == 3 * (5 - 1) and stats["decode_blocks"] == 3  # a turn's first token is drawn
    assert stats["observation_prefills"] == 2 * len(rows)


def test_prefill_chunks_are_greedy_within_the_padded_token_budget():
    """A wave of resumes is chunked like prompts: every index once, each chunk's padded size within the budget (or a
    single row), and each chunk closed only because the next row would not have fit."""
    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(1, 400)
        chunks = prefill_chunks(lengths, list(range(len(lengths))), budget)
        assert sorted(i for chunk in chunks for i in chunk) == list(range(len(lengths)))
        assert all(len(chunk) == 1 or max(lengths[i] for i in chunk) * len(chunk) <= budget for chunk in chunks)
        for chunk, following in zip(chunks, chunks[1:]):
            assert max(lengths[i] for i in chunk + following[:1]) * (len(chunk) + 1) > budget


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_and_compiled_decode_continue_episodes_like_the_reference():
    """Unrun where this was written (no GPU): resumes write state that captured decode graphs then read in place."""
    model = make_model("qwen2").cuda()
    params = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=[IM_END])
    budget = EpisodeBudget(max_turns=4, max_episode_tokens=400)
    renderer = ObservationRenderer(TOKENIZER)
    engine = BuiltinBackend(model, tokenizer=TOKENIZER, attention="sdpa", sync_every=4)
    episodes = engine.generate_episodes(sessions(), renderer, params, budget)
    reference = HFBackend(model, TOKENIZER).generate_episodes(sessions(), renderer, params, budget)
    assert engine.last_stats["compiled"] and engine.last_stats["graphs_captured"] >= 1
    assert engine.last_stats["observation_prefills"] > 0  # the compiled `extend` ran
    assert_same_episodes(episodes, reference, atol=1e-4)
