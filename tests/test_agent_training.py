"""The trainer on multi-turn episodes (`training/episodes.py`, the `env` config): the trained ids are the sampled ids,
losses and metrics count assistant tokens only, a toy environment trains end to end, and user errors are one
sentence. Tiny seeded CPU models with the character tokenizer and a chat template with a tool role written here."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_actor
from test_envs import qwen_style_tokenizer
from test_multiturn import TOOLS
from transformers import AutoModelForCausalLM

from hybridrl import algorithms
from hybridrl.config.loading import build_config, load_config
from hybridrl.config.schema import ConfigError
from hybridrl.data.datasets import PromptDataset
from hybridrl.envs.base import EnvironmentCodeError, load_environment
from hybridrl.envs.episode import Episode
from hybridrl.envs.rendering import ChatTemplateError, ObservationRenderer
from hybridrl.models.loading import HFModel, tiny_config
from hybridrl.rewards import RewardError
from hybridrl.parallel.process_group import DistributedSetup
from hybridrl.rollout.base import Generation, SamplingParams
from hybridrl.rollout.hf import HFBackend
from hybridrl.rollout.multiturn import EpisodeBudget
from hybridrl.training import episodes as episodes_module
from hybridrl.training.episodes import EpisodeRollout, build_episode_rollout, episodes_to_batch, final_assistant_text
from hybridrl.training.logprobs import response_logprobs
from hybridrl.training.trainer import RLTrainer

TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}{{ '[' + m['content'] + ']\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ 'A:' + m['content'] + '<eos>' }}"
    "{%- else -%}{{ m['role'][0] + ':' + m['content'] + '\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}A:{%- endif -%}")
"""A chat template with a tool role for the character tokenizer: prefix-stable, assistant text verbatim, <eos> the
turn's stop token (which the model samples and the template's closing does not repeat)."""

ENVIRONMENT = '''
import os

from hybridrl.envs.base import StepResult


class TwoTurns:
    """Every episode: the prompt, an assistant turn, a tool observation, a last assistant turn. Reward: a digit in the
    last turn."""

    def __init__(self, row):
        self.row, self.turns = row, 0

    def reset(self):
        return [{"role": "user", "content": self.row["prompt"]}]

    def step(self, text):
        self.turns += 1
        if self.turns >= 2:
            return StepResult(reward=float(any(c.isdigit() for c in text)), done=True)
        return StepResult([{"role": "tool", "name": "echo", "content": "ok " + self.row["answer"]}])


CALLS = {"n": 0}


class FailsOnRankOne(TwoTurns):
    """Raises while being made in the second of two processes (its share: the second row of a step)."""

    def __init__(self, row):
        if os.environ.get("RANK") == "1":
            raise KeyError("no such column")
        super().__init__(row)


class StrangeLater(TwoTurns):
    """The 17th episode made (the third step of a run of 8 episodes per step) answers its first turn with an
    observation that `STRANGE_TEMPLATE` cannot render token-exactly."""

    def __init__(self, row):
        CALLS["n"] += 1
        self.strange = CALLS["n"] == 17
        super().__init__(row)

    def step(self, text):
        if self.strange:
            return StepResult([{"role": "tool", "name": "echo", "content": "strange"}])
        return super().step(text)


class FailsLater(TwoTurns):
    """Raises while being made for the 17th episode: the third step of a run of 8 episodes per step."""

    def __init__(self, row):
        CALLS["n"] += 1
        if CALLS["n"] == 17:
            raise KeyError("no such column")
        super().__init__(row)
'''

FAST = dict(rollout__max_new_tokens=3, rollout__num_samples_per_prompt=4, trainer__prompts_per_step=2,
            actor__micro_batch_size=8, trainer__device="cpu", logging__sinks=["jsonl"], trainer__save_model=False,
            rollout__temperature=1.0, env__max_episode_tokens=64, env__max_observation_tokens=8)


def rows(num: int = 8) -> list[dict]:
    return [{"prompt": f"{i}+{i}", "answer": str(2 * i)} for i in range(num)]


def chat_actor(seed: int = 0):
    actor = tiny_actor(seed=seed)
    actor.tokenizer.chat_template = TEMPLATE
    return actor


def make_trainer(tmp_path: Path, environment: str = "TwoTurns", actor=None, reward_fn=None, source: str = ENVIRONMENT,
                 eval_rows: int = 0, **overrides) -> RLTrainer:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "env.py").write_text(source)
    actor = actor or chat_actor()
    dataset = PromptDataset(rows(), actor.tokenizer, max_length=32)
    eval_dataset = PromptDataset(rows(eval_rows), actor.tokenizer, max_length=32) if eval_rows else None
    settings = {**FAST, "env__environment": f"{tmp_path}/env.py:{environment}", "trainer__output_dir": str(tmp_path),
                **overrides}
    return RLTrainer(actor=actor, reward_fn=reward_fn, dataset=dataset, eval_dataset=eval_dataset, **settings)


def hand_episode(prompt: list[int], turns: list[tuple[list[int], list[float], list[int]]], text: str = "",
                 reward: float | None = None, done_reason: str = "done") -> Episode:
    episode = Episode(messages=[{"role": "user", "content": "q"}], reward=reward, done_reason=done_reason)
    episode.add_prompt(prompt)
    for sampled, logprobs, observation in turns:
        episode.add_sampled(sampled, logprobs)
        episode.messages.append({"role": "assistant", "content": text})
        if observation:
            episode.add_observation(observation)
    episode.check()
    return episode


# ------------------------------------------------------------------------------------------------
# episodes -> batch


def test_episodes_to_batch_keeps_the_ids_masks_and_logprobs_as_sampled():
    first = hand_episode([5, 6, 7], [([10, 11], [-0.5, -0.25], [20, 21, 22]), ([12], [-1.0], [])], reward=1.0)
    second = hand_episode([8], [([13, 14, 15], [-0.125, -0.25, -0.375], [])], done_reason="max_tokens")
    batch = episodes_to_batch([first, second], group_size=1, pad_token_id=0)
    assert batch.response_length == 6 and batch.input_ids.shape == (2, 9)
    assert batch.input_ids.tolist() == [[5, 6, 7, 10, 11, 20, 21, 22, 12], [0, 0, 8, 13, 14, 15, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 9, [0, 0, 1, 1, 1, 1, 0, 0, 0]]
    assert batch.position_ids[0].tolist() == list(range(9)) and batch.position_ids[1, 2:6].tolist() == [0, 1, 2, 3]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.sampler_logp.tolist() == [[-0.5, -0.25, 0, 0, 0, -1.0], [-0.125, -0.25, -0.375, 0, 0, 0]]
    assert batch.truncated.tolist() == [False, True]
    assert batch.prompt_index.tolist() == [0, 1]
    assert batch.columns["env_reward"] == [1.0, None] and batch.columns["messages"][0][-1]["role"] == "assistant"


def test_groups_are_the_episodes_of_one_row_and_the_completion_is_the_last_turn():
    episodes = [hand_episode([1], [([2], [-0.1], [3]), ([4], [-0.2], [])], text=f"turn of {i}") for i in range(6)]
    episodes[5].messages[-1]["content"] = "the answer"
    batch = episodes_to_batch(episodes, group_size=3, pad_token_id=0)
    assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.texts[5] == "the answer" == final_assistant_text(episodes[5])
    with pytest.raises(ValueError, match="groups of 4"):
        episodes_to_batch(episodes, group_size=4, pad_token_id=0)


# ------------------------------------------------------------------------------------------------
# The trainer trains on the sampled ids


class ScriptedBackend:
    """Episodes whose assistant turns are spelled with single characters that the tokenizer would merge if their text
    were re-tokenized (c-a-l-c -> the one id of "calc"), around observations from the real renderer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.episodes: list[Episode] = []

    def generate_episodes(self, sessions, renderer, params, budget):
        spelled = [self.tokenizer.convert_tokens_to_ids(c) for c in "calc"]
        eos = self.tokenizer.eos_token_id
        self.episodes = []
        for session in sessions:
            episode = Episode(messages=[{"role": "user", "content": session.env.row["prompt"]}])
            episode.add_prompt(renderer.prompt_ids(episode.messages))
            for turn in range(2):
                sampled = spelled[:3 + turn] + [eos]
                episode.add_sampled(sampled, [-0.5 - 0.25 * i for i in range(len(sampled))])
                episode.messages.append({"role": "assistant", "content": "calc"[:3 + turn]})
                if turn == 0:
                    observation = [{"role": "tool", "name": "echo", "content": "calc"}]
                    episode.add_observation(renderer.observation_ids(episode.messages, observation, sampled))
                    episode.messages.extend(observation)
            episode.reward = float(session.sample % 2)
            episode.check()
            self.episodes.append(episode)
        return self.episodes

    def release_memory(self):
        pass


def test_the_trained_ids_and_logprobs_are_the_sampled_ones_not_a_retokenization(tmp_path, monkeypatch):
    actor = chat_actor()
    actor.tokenizer.add_tokens(["calc"])
    actor.model.resize_token_embeddings(len(actor.tokenizer))
    trainer = make_trainer(tmp_path, actor=actor, trainer__total_steps=1, rollout__backend="hf")
    scripted = ScriptedBackend(actor.tokenizer)
    trainer.parts.rollout = scripted
    seen = []
    compute_logprobs = trainer.compute_logprobs
    monkeypatch.setattr(trainer, "compute_logprobs", lambda batch: (seen.append(batch), compute_logprobs(batch))[1])
    trainer.train()
    batch, episodes = seen[0], scripted.episodes
    text_ids = actor.tokenizer.encode(actor.tokenizer.decode(episodes[0].token_ids), add_special_tokens=False)
    assert text_ids != episodes[0].token_ids, "the test needs ids that a re-tokenization would change"
    for row, episode in enumerate(episodes):
        real = batch.attention_mask[row].bool()
        assert batch.input_ids[row][real].tolist() == episode.token_ids
        prompt = episode.spans[0].end
        response = batch.response_mask[row][:len(episode.token_ids) - prompt]
        assert response.tolist() == episode.loss_mask[prompt:]
        assert batch.sampler_logp[row][:len(episode.token_ids) - prompt].tolist() == episode.behaviour_logprobs[prompt:]
    assert batch.texts[0] == "calc" and batch.scores.tolist() == [0.0, 1.0] * 4  # env_reward: the last turn's


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "ppo"])
def test_a_toy_environment_trains_and_logs_the_multi_turn_metrics(tmp_path, algorithm):
    trainer = make_trainer(tmp_path, trainer__total_steps=3, actor__lr=1e-2, rollout__backend="builtin",
                           algorithm__name=algorithm, critic__lr=1e-3, eval_rows=3, trainer__eval_every=3)
    before = [p.detach().clone() for p in trainer.parts.actor.parameters()]
    assert "episodes of up to 4 turns with " in trainer.describe()
    assert trainer.parts.rollout.attention == "sdpa"  # auto picks the per-slot KV layout for episodes on any device
    history = trainer.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.parts.actor.parameters()))
    last = history[-1]
    assert last["rollout/turns_per_episode"] == 2.0
    assert 0 < last["rollout/observation_token_share"] < 1
    for key in ("rollout/tool_calls_per_episode", "rollout/tool_errors_per_episode",
                "rollout/tool_timeouts_per_episode",
                "rollout/prefill_tokens", "rollout/observation_prefills", "rollout/engine_idle_s",
                "reward/env_reward", "actor/entropy", "actor/grad_norm"):
        assert key in last and math.isfinite(last[key]), key
    assert last["rollout/observation_prefills"] == 8  # one resume per episode: only observations are prefilled
    assert last["rollout/logprob_diff_max"] < 1e-4  # the trainer scores the very tokens the engine sampled
    assert any(row.get("actor/grad_norm", 0) > 0 for row in history)  # history[0]: the evaluation before step 1
    assert {"eval/reward_mean", "eval/accuracy", "eval/reward/env_reward"} <= set(last)  # greedy held-out episodes
    if algorithm == "ppo":  # the critic regresses on assistant tokens only, like the policy
        assert all(math.isfinite(row["critic/value_loss"]) for row in history[1:])


# ------------------------------------------------------------------------------------------------
# Losses and metrics over holed masks


def random_episodes(vocab: int, seed: int = 0) -> list[Episode]:
    """Episodes of uneven lengths with several holes, random ids and behaviour log-probs."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    def logps(n):
        return (-torch.rand(n, generator=generator) * 3).tolist()

    shapes = [(4, [(3, 5), (2, 0)]), (6, [(1, 2), (4, 3), (2, 0)]), (4, [(5, 0)]), (3, [(2, 6), (1, 1), (3, 0)])]
    return [hand_episode(ids(prompt), [(ids(n), logps(n), ids(o)) for n, o in turns]) for prompt, turns in shapes]


def slow_loss(model, episodes, advantages, temperature, clip, entropy_coef):
    """The clipped surrogate minus the entropy bonus, summed over sampled (mask 1) tokens only and divided by their
    count: each episode through the model alone, unpadded; a sampled token at t is predicted at t - 1."""
    total, entropy_sum, count = 0.0, 0.0, 0
    for episode, advantage in zip(episodes, advantages):
        logits = model(torch.tensor([episode.token_ids])).logits[0].float() / temperature
        log_probs = torch.log_softmax(logits, dim=-1)
        for t, (token, mask, old) in enumerate(zip(episode.token_ids, episode.loss_mask, episode.behaviour_logprobs)):
            if not mask:
                continue
            logp = log_probs[t - 1, token]
            ratio = torch.exp(logp - old)
            total = total - torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
            entropy = -(log_probs[t - 1].exp() * log_probs[t - 1]).sum()
            entropy_sum, count = entropy_sum + entropy, count + 1
    return (total - entropy_coef * entropy_sum) / count, entropy_sum.detach() / count


@pytest.mark.parametrize("pack", [False, True])
def test_the_loss_and_gradient_of_a_holed_batch_sum_only_the_sampled_tokens(pack):
    model = tiny_actor(seed=3).model.float()
    episodes = random_episodes(model.config.vocab_size)
    advantages = [1.0, -0.5, 2.0, -1.5]
    batch = episodes_to_batch(episodes, group_size=1, pad_token_id=0)
    temperature, clip, entropy_coef = 0.7, 0.2, 0.01
    logp, entropy = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                      batch.response_length, temperature, with_entropy=True, pack=pack)
    mask = batch.response_mask
    loss, stats = algorithms.policy_loss(logp, batch.sampler_logp, torch.tensor(advantages)[:, None] * mask, mask,
                                         clip_low=clip, clip_high=clip, aggregation="token-mean")
    loss = loss - entropy_coef * algorithms.aggregate_loss(entropy, mask, "token-mean")
    fast = torch.autograd.grad(loss, list(model.parameters()))
    reference, reference_entropy = slow_loss(model, episodes, advantages, temperature, clip, entropy_coef)
    slow = torch.autograd.grad(reference, list(model.parameters()))
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(algorithms.masked_mean(entropy.detach(), mask), reference_entropy, rtol=1e-5, atol=1e-6)
    assert stats["clipfrac"] > 0, "the test should exercise the clipped branch too"


def params_after(tmp_path: Path, **overrides) -> list[torch.Tensor]:
    trainer = make_trainer(tmp_path, trainer__total_steps=2, actor__lr=1e-2, rollout__backend="hf",
                           algorithm__kl_coef=0.05, algorithm__entropy_coef=0.01, **overrides)
    history = trainer.train()
    assert "actor/kl" in history[-1] and history[-1]["actor/grad_norm"] > 0
    return [p.detach().clone() for p in trainer.parts.actor.parameters()]


@pytest.fixture(scope="module")
def plain_params(tmp_path_factory):
    return params_after(tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("layout", [dict(actor__micro_batch_size=2), dict(actor__max_tokens_per_micro_batch=40),
                                    dict(actor__share_prompt_tokens=True), dict(actor__reuse_logprobs_on_policy=False)])
def test_micro_batches_packing_and_shared_prompts_train_episodes_alike(tmp_path, plain_params, layout):
    """With KL to a reference and an entropy bonus, so the old, reference and new log-prob passes all see holes.
    (Shared prompts sum in another order: AdamW turns that rounding into differences of a few 1e-6.)"""
    plain = plain_params
    other = params_after(tmp_path / "other", **layout)
    for a, b in zip(plain, other):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


# ------------------------------------------------------------------------------------------------
# User errors


def test_an_environment_that_raises_mid_run_saves_the_finished_steps_and_names_its_code(tmp_path):
    with pytest.raises(EnvironmentCodeError) as caught:
        make_trainer(tmp_path, environment="FailsLater", trainer__total_steps=4).train()
    message = str(caught.value)
    assert re.search(r"environment '.*env\.py:FailsLater' raised KeyError: 'no such column' \(at .*env\.py:\d+ in "
                     r"__init__\) in making it from the data row for sample 0", message), message
    assert re.search(r"The 2 finished step\(s\) are saved in .*step_0*2", message), message
    resumed = make_trainer(tmp_path, environment="TwoTurns", trainer__total_steps=4).train()
    clean = make_trainer(tmp_path / "clean", environment="TwoTurns", trainer__total_steps=4).train()
    keys = ("reward/mean", "actor/policy_loss", "actor/grad_norm", "actor/entropy", "rollout/observation_token_share")
    assert [[row.get(k) for k in keys] for row in resumed] == [[row.get(k) for k in keys] for row in clean]
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]


STRANGE_TEMPLATE = "{%- if messages | selectattr('content', 'equalto', 'strange') | list -%}!{%- endif -%}" + TEMPLATE
"""`TEMPLATE`, except that a 'strange' message anywhere changes how the conversation begins: not prefix-stable
for that one observation, which passes the check at start and fails mid-run."""


def test_a_chat_template_failure_mid_run_saves_the_finished_steps_and_names_the_sample(tmp_path):
    actor = chat_actor()
    actor.tokenizer.chat_template = STRANGE_TEMPLATE
    with pytest.raises(EnvironmentCodeError) as caught:
        make_trainer(tmp_path, environment="StrangeLater", actor=actor, trainer__total_steps=4).train()
    message = str(caught.value)
    assert re.search(r"the chat template cannot render the observation environment '.*env\.py:StrangeLater' gave in "
                     r"step 1 for sample 0 \('strange'\): the chat template renders earlier turns differently", message)
    assert re.search(r"The 2 finished step\(s\) are saved in .*step_0*2", message), message


def test_a_chat_template_failure_on_one_rank_reaches_every_rank(tmp_path, monkeypatch):
    """Rank 0 of two (the gather faked): the template's error goes into the ranks' gather, as an environment error
    does, instead of leaving this rank before it while the other rank waits there."""
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    actor = chat_actor()
    rollout = EpisodeRollout(load_environment(f"{tmp_path}/env.py:TwoTurns"), "env.py:TwoTurns",
                             ObservationRenderer(actor.tokenizer), EpisodeBudget(max_episode_tokens=64), pad_token_id=0,
                             setup=DistributedSetup(rank=0, world_size=2))
    sent = []

    def all_gather_object(gathered, mine):
        sent.append(mine)
        gathered[:] = [mine, ([], None)]

    def not_prefix_stable(*args, **kwargs):
        raise ChatTemplateError("the chat template renders earlier turns differently once a message is added")

    monkeypatch.setattr(episodes_module.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(ObservationRenderer, "observation_ids", not_prefix_stable)
    with pytest.raises(EnvironmentCodeError, match="cannot render the observation .* for sample 0"):
        rollout.generate_sharded(HFBackend(actor.model, actor.tokenizer), rows(2),
                                 SamplingParams(max_new_tokens=2), n=1)
    assert len(sent) == 1 and "renders earlier turns differently" in sent[0][1]


def test_without_a_reward_function_the_environment_reward_is_the_reward_and_must_be_given(tmp_path):
    history = make_trainer(tmp_path / "given", trainer__total_steps=1).train()
    assert "reward/env_reward" in history[-1]
    silent = ENVIRONMENT.replace("StepResult(reward=float(any(c.isdigit() for c in text)), done=True)",
                                 "StepResult(done=True)")
    assert silent != ENVIRONMENT
    with pytest.raises(RewardError, match="the environment gave no reward for sample 0"):
        make_trainer(tmp_path / "silent", source=silent, trainer__total_steps=1).train()


def test_multi_turn_config_mistakes_are_one_sentence_naming_the_key(tmp_path):
    def error(**overrides) -> str:
        with pytest.raises(ConfigError) as caught:
            load_config(None, **overrides)
        return str(caught.value)

    assert "both set" in error(env__environment="env.py:Guess", env__tools=["python"])
    assert "rollout.backend=vllm cannot" in error(env__tools=["python"], rollout__backend="vllm")
    assert "env.tools[1]='calc'" in error(env__tools=["python", "calc"])
    assert "env.max_turns" in error(env__environment="env.py:Guess", env__max_turns=0)
    assert "several training processes" in error(env__tools=["python"], trainer__max_staleness=1, trainer__num_gpus=2,
                                                 trainer__rollout_worker="process")
    assert "rollout.engine.attention=triton" in error(env__tools=["python"], rollout__engine__attention="triton")
    paged = load_config(None, env__tools=["python"], rollout__engine__kv_cache="paged", rollout__engine__attention="auto")
    assert paged.rollout.engine.kv_cache == "paged"  # episodes run on the paged layout (tests/test_paged_multiturn.py)
    assert not load_config(None).env.enabled and load_config(None, env__tools=["python"]).env.enabled


def test_multi_turn_refusals_at_start(tmp_path):
    no_tool_role = chat_actor()
    no_tool_role.tokenizer.chat_template = TEMPLATE.replace("{{ '[' + m['content'] + ']\\n' }}", "")  # drops them
    assert no_tool_role.tokenizer.chat_template != TEMPLATE
    with pytest.raises(ChatTemplateError, match="drops 'tool' messages.*set tokenizer.chat_template"):
        make_trainer(tmp_path / "template", actor=no_tool_role)
    config = build_config({"env": {"environment": "env.py:Guess"}})
    with pytest.raises(ConfigError, match="the object rollout backend cannot generate multi-turn episodes"):
        build_episode_rollout(config, (lambda row: None, "env.py:Guess"), chat_actor().tokenizer, object(), 0)
    with pytest.raises(Exception, match="has no class or function 'Missing'"):
        make_trainer(tmp_path / "spec", environment="Missing")
    with pytest.raises(ConfigError, match="env.tools runs the built-in tool environment, which gives no reward"):
        make_trainer(tmp_path / "tools", env__environment="", env__tools=["python"])
    unequal = [hand_episode([1, 2], [([3], [-0.5], [])]), hand_episode([1, 4], [([3], [-0.5], [])])]
    with pytest.raises(ConfigError, match="set actor.share_prompt_tokens=false"):
        episodes_module.check_shared_prompts(unequal, group_size=2)


# ------------------------------------------------------------------------------------------------
# The built-in tool environment (env.tools), with the calc tool of test_multiturn.py


class CallsCalcFirst(HFBackend):
    """The hf backend, except that every episode's first turn is a call of calc (a tiny random model writes none);
    the trainer still trains on these ids as given."""

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.stop_strings, self.turn = [], 0

    def generate(self, prompts, params):
        self.stop_strings.append(list(params.stop_strings))
        self.turn += 1
        if self.turn > 1:
            return super().generate(prompts, params)
        call = self.tokenizer.encode('<tool_call>{"name": "calc", "arguments": {"a": 12, "b": 3}}</tool_call>',
                                     add_special_tokens=False)
        return [Generation(i, list(call), [-1.0] * len(call), "stop") for i in range(len(prompts))]


def test_tools_are_called_answered_and_seen_by_the_reward(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS)
    seen = []

    def tool_results(prompts, completions, tool_calls, messages, **columns):
        seen.append((tool_calls, messages))
        return [float(len(calls)) for calls in tool_calls]

    actor = chat_actor()
    trainer = make_trainer(tmp_path, actor=actor, reward_fn=tool_results, env__environment="",
                           env__tools=[f"{tmp_path}/tools.py:calc"], trainer__total_steps=1, rollout__backend="hf",
                           env__max_observation_tokens=32, env__max_episode_tokens=256, env__system_prompt="Use calc.")
    backend = CallsCalcFirst(trainer.parts.actor, actor.tokenizer)
    trainer.parts.rollout = backend
    history = trainer.train()
    assert backend.stop_strings[0] == ["</tool_call>"]  # a turn ends at the closing tag
    assert history[-1]["rollout/tool_calls_per_episode"] == 1.0 and history[-1]["rollout/tool_errors_per_episode"] == 0
    assert history[-1]["rollout/turns_per_episode"] == 2.0 and "rollout/tool_latency_p95_s" in history[-1]
    tool_calls, messages = seen[0]
    assert tool_calls[0] == [{"name": "calc", "arguments": {"a": 12, "b": 3}, "result": "36", "error": False,
                              "timed_out": False, "malformed": False, "latency_s": tool_calls[0][0]["latency_s"],
                              "where": ""}]
    assert [m["role"] for m in messages[0]] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[0][0]["content"] == "Use calc." and messages[0][3]["content"] == "36"
    workers = trainer.parts.episodes.factory._workers  # train() stopped them: no tool process outlives the run
    assert workers and all(worker.process is None for worker in workers)


def test_tool_episodes_cut_at_max_turns_count_as_truncated(tmp_path):
    """env.max_turns=1 and a first turn that calls calc: the budget cut the episode (docs: rollout/truncation_rate
    counts `max_turns`), not an answer."""
    (tmp_path / "tools.py").write_text(TOOLS)
    actor = chat_actor()
    trainer = make_trainer(tmp_path, actor=actor, reward_fn=lambda prompts, completions, **columns: [0.0] * len(completions),
                           env__environment="", env__tools=[f"{tmp_path}/tools.py:calc"], trainer__total_steps=1,
                           rollout__backend="hf", env__max_turns=1, env__max_observation_tokens=32,
                           env__max_episode_tokens=256)
    trainer.parts.rollout = CallsCalcFirst(trainer.parts.actor, actor.tokenizer)
    history = trainer.train()
    assert history[-1]["rollout/turns_per_episode"] == 1.0 and history[-1]["rollout/tool_calls_per_episode"] == 1.0
    assert history[-1]["rollout/truncation_rate"] == 1.0


def docs_config() -> dict:
    """The Qwen2.5 starting config of docs/environments.md, as written there."""
    text = (Path(__file__).parents[1] / "docs" / "environments.md").read_text()
    section = text[text.index("## A starting config for a Qwen2.5 model"):]
    return yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])


def test_the_docs_qwen_config_trains_with_a_qwen_style_template(tmp_path):
    raw = docs_config()
    assert raw["env"]["tools"] == ["tools.py:calc", "python"] and build_config(raw).env.enabled
    (tmp_path / "tools.py").write_text(TOOLS)
    tokenizer = qwen_style_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = tiny_config("qwen2", len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=im_end)
    torch.manual_seed(0)
    actor = HFModel(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), tokenizer)
    raw["env"]["tools"] = [f"{tmp_path}/tools.py:calc", "python"]
    raw["trainer"].update(total_steps=1, prompts_per_step=2, device="cpu", output_dir=str(tmp_path), save_model=False)
    raw["rollout"].update(num_samples_per_prompt=2, max_new_tokens=4)
    raw["model"]["dtype"] = "float32"
    raw["logging"] = {"sinks": ["jsonl"]}
    trainer = RLTrainer(build_config(raw), actor=actor, dataset=PromptDataset(rows(), tokenizer, max_length=64))
    backend = CallsCalcFirst(trainer.parts.actor, tokenizer)
    episodes = []
    backend.generate_episodes = lambda *args: episodes.extend(HFBackend.generate_episodes(backend, *args)) or episodes
    trainer.parts.rollout = backend
    history = trainer.train()
    assert history[-1]["rollout/tool_calls_per_episode"] == 1.0 and "reward/numeric_match" in history[-1]
    system = tokenizer.decode(episodes[0].span_ids(episodes[0].spans[0]), skip_special_tokens=False)
    assert "# Tools" in system and '"name": "calc"' in system and '"name": "python"' in system
    observation = tokenizer.decode(episodes[0].span_ids(episodes[0].spans[2]), skip_special_tokens=False)
    assert observation == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n36\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n")  # the turn stopped at </tool_call>: the closing is added whole
    trainer.parts.episodes.factory.close()


def test_dynamic_sampling_refills_with_episodes_and_keeps_their_metrics(tmp_path):
    history = make_trainer(tmp_path, trainer__total_steps=2, rollout__backend="hf",
                           algorithm__dynamic_sampling=True).train()
    assert all(row["rollout/turns_per_episode"] == 2.0 for row in history)
    assert sum(row["rollout/dynamic_sampling_rounds"] for row in history) > 2, "the test needs a refill"


def test_two_processes_train_on_episodes_and_an_environment_error_stops_both(tmp_path):
    """Each rank generates its share of the rows' episodes and every rank trains on all of them (`hybridrl train`
    with two gloo processes); an environment that raises on one rank's share stops both with its sentence."""
    import json
    import subprocess
    import sys

    (tmp_path / "env.py").write_text(ENVIRONMENT)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows()))
    (tmp_path / "config.yaml").write_text("{}\n")

    def train(environment: str, out: Path) -> subprocess.CompletedProcess:
        overrides = [f"data.train_path={tmp_path / 'rows.jsonl'}", "model.path=tiny:llama+chat",
                     f"env.environment={tmp_path / 'env.py'}:{environment}", "env.max_episode_tokens=64",
                     "rollout.max_new_tokens=3", "rollout.num_samples_per_prompt=4", "trainer.prompts_per_step=2",
                     "actor.micro_batch_size=4", "actor.lr=1e-2", "trainer.total_steps=2", "trainer.device=cpu",
                     "trainer.num_gpus=2", f"trainer.output_dir={out}", "logging.sinks=[jsonl]",
                     "trainer.save_model=false"]
        return subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(tmp_path / "config.yaml"),
                               *overrides], capture_output=True, text=True, timeout=300)

    result = train("TwoTurns", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == [1, 2]
    assert all(row["rollout/turns_per_episode"] == 2.0 and row["actor/grad_norm"] > 0 for row in history)
    failed = train("FailsOnRankOne", tmp_path / "failed")
    assert failed.returncode != 0
    assert "raised KeyError: 'no such column'" in failed.stderr, failed.stderr[-3000:]
    assert "for sample 4" in failed.stderr  # its place in the whole batch: rank 1's first episode
