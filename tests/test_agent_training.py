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

from hybridrl import algorithms
from hybridrl.config.loading import build_config, load_config
from hybridrl.config.schema import ConfigError
from hybridrl.data.datasets import PromptDataset
from hybridrl.envs.base import EnvironmentCodeError
from hybridrl.envs.episode import Episode
from hybridrl.envs.rendering import ChatTemplateError, ObservationRenderer
from hybridrl.envs.tools import ToolBox
from hybridrl.rollout.base import SamplingParams
from hybridrl.training import episodes as episodes_module
from hybridrl.training.episodes import build_episode_rollout, episodes_to_batch, final_assistant_text
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


def make_trainer(tmp_path: Path, environment: str = "TwoTurns", actor=None, reward_fn=None, **overrides) -> RLTrainer:
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    actor = actor or chat_actor()
    dataset = PromptDataset(rows(), actor.tokenizer, max_length=32)
    settings = {**FAST, "env__environment": f"{tmp_path}/env.py:{environment}", "trainer__output_dir": str(tmp_path),
                **overrides}
    return RLTrainer(actor=actor, reward_fn=reward_fn, dataset=dataset, **settings)


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


def test_a_toy_environment_trains_and_logs_the_multi_turn_metrics(tmp_path):
    trainer = make_trainer(tmp_path, trainer__total_steps=3, actor__lr=1e-2, rollout__backend="builtin")
    before = [p.detach().clone() for p in trainer.parts.actor.parameters()]
    history = trainer.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.parts.actor.parameters()))
    last = history[-1]
    assert last["rollout/turns_per_episode"] == 2.0
    assert 0 < last["rollout/observation_token_share"] < 1
    for key in ("rollout/tool_calls_per_episode", "rollout/tool_errors_per_episode", "rollout/tool_timeouts_per_episode",
                "rollout/prefill_tokens", "rollout/observation_prefills", "rollout/engine_idle_s",
                "reward/env_reward", "actor/entropy", "actor/grad_norm"):
        assert key in last and math.isfinite(last[key]), key
    assert last["rollout/observation_prefills"] == 8  # one resume per episode: only observations are prefilled
    assert last["rollout/logprob_diff_max"] < 1e-4  # the trainer scores the very tokens the engine sampled
    assert any(row["actor/grad_norm"] > 0 for row in history)
