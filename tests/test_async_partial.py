"""Partial rollouts (`trainer.partial_rollout`): the thread worker takes newer weights over between segments of a
batch. By hand on a scripted backend: `continue` records each token's version as the push lands, `requeue` cuts the
sequences in flight and makes them again from their prompts, finished ones keep their version. In a run, with the
push forced to land after the first segment of the batch of step 2: the per-token staleness is exactly what that
gives; with max_staleness=0 the pipeline is still the synchronous loop bitwise."""

import pytest
import torch
from test_async_pipeline import learning_metrics, make_trainer

from hybridrl.config.schema import ConfigError
from hybridrl.rollout.base import Generation, SamplingParams
from hybridrl.training.async_pipeline import AsyncPipeline, RolloutWorker
from hybridrl.training.partial_rollout import generate_in_segments, token_versions_tensor
from hybridrl.training.trajectories import Trajectories


class ScriptedBackend:
    """Samples token 100 * version + 10 * segment + row; the sequence of prompt 0's first sample stops at once."""

    def __init__(self):
        self.version, self.calls = 0, []

    def generate(self, prompts, params):
        self.calls.append((list(map(list, prompts)), params))
        segment = len(self.calls) - 1
        outputs = []
        for index, prompt in enumerate(prompts):
            for sample in range(params.n):
                row = index * params.n + sample
                stop = segment == 0 and row == 0
                tokens = [100 * self.version + 10 * segment + row] * (1 if stop else params.max_new_tokens)
                outputs.append(Generation(index, tokens, [-0.5] * len(tokens), "stop" if stop else "length"))
        return outputs


def run_scripted(mode):
    backend = ScriptedBackend()
    taken = []

    def take_newer():  # version 1 lands before the second segment, nothing after
        taken.append(1)
        if len(taken) == 1:
            backend.version = 1
            return 1
        return None

    params = SamplingParams(max_new_tokens=4, n=2, seed=0)
    generations, versions, counts = generate_in_segments(backend, [[7], [8, 9]], params, 0, take_newer, mode)
    return backend, generations, versions, counts


def test_continue_records_each_tokens_version_as_the_push_lands():
    backend, generations, versions, counts = run_scripted("continue")
    assert [g.prompt_index for g in generations] == [0, 0, 1, 1]
    assert versions == [[0], [0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]]
    assert generations[0].finish_reason == "stop" and all(g.finish_reason == "length" for g in generations[1:])
    # Segment 1 continues rows 1-3 from their prompts plus their first token, one sample each, under version 1.
    prompts, params = backend.calls[1]
    assert prompts == [[7, 1], [8, 9, 2], [8, 9, 3]] and params.n == 1 and params.max_new_tokens == 1
    assert generations[1].token_ids == [1, 110, 120, 130]
    assert (counts.takeovers, counts.requeued) == (1, 0)
    assert params.seed != backend.calls[0][1].seed  # each segment its own seed


def test_requeue_cuts_the_sequences_in_flight_and_makes_them_again_from_their_prompts():
    backend, generations, versions, counts = run_scripted("requeue")
    assert versions == [[0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]  # the finished one keeps its version
    prompts, _ = backend.calls[1]
    assert prompts == [[7], [8, 9], [8, 9]]  # from the prompts again
    assert generations[1].token_ids == [110, 120, 130, 140] and generations[3].token_ids == [112, 122, 132, 142]
    assert (counts.takeovers, counts.requeued) == (1, 3)


def test_token_versions_pad_with_the_last_version_and_round_trip_through_json():
    tensor = token_versions_tensor([[0], [0, 1, 1]], 3)
    assert tensor.tolist() == [[0, 0, 0], [0, 1, 1]]
    item = Trajectories.from_json({
        "step": 2, "versions": [0, 0], "indices": [1], "reward_metrics": {}, "sampler_state": {"epoch": 0},
        "token_versions": tensor.tolist(),
        "batch": {name: {"dtype": dtype, "shape": [2, 1] if name != "truncated" and name != "prompt_index" else [2],
                         "values": [1, 1]}
                  for name, dtype in (("input_ids", "int64"), ("attention_mask", "int64"), ("position_ids", "int64"),
                                      ("response_mask", "float32"), ("sampler_logp", "float32"), ("truncated", "bool"),
                                      ("prompt_index", "int64"))}})
    assert torch.equal(item.token_versions, tensor)
    assert Trajectories.from_json(item.to_json()).to_json() == item.to_json()


PARTIAL = dict(trainer__total_steps=3, trainer__max_staleness=1, rollout__ignore_eos=True,
               algorithm__rollout_correction_cap=2.0)


def forced_takeover(monkeypatch):
    """The worker's first look for newer weights in the batch of step 2 (its 4th: 3 per batch of 4 one-token
    segments) waits until the trainer has published version 1; every other look finds nothing."""
    take_newer, looks = RolloutWorker.take_newer, []

    def look(self):
        looks.append(1)
        if len(looks) != 4:
            return None
        with self.mailbox.condition:
            assert self.mailbox.condition.wait_for(lambda: 1 in self.mailbox.published, timeout=60)
        return take_newer(self)

    monkeypatch.setattr(RolloutWorker, "take_newer", look)


@pytest.mark.parametrize("mode, token_lag, requeued", [("continue", 0.25, 0.0), ("requeue", 0.0, 32.0)])
def test_a_push_landing_mid_batch_is_taken_over(tmp_path, monkeypatch, mode, token_lag, requeued):
    forced_takeover(monkeypatch)
    history = make_trainer(tmp_path, trainer__partial_rollout=mode, **PARTIAL).train()
    step2 = history[1]
    assert step2["rollout/partial_takeovers"] == 1.0 and step2["rollout/partial_requeued"] == requeued
    # continue: every sequence's first token is version 0, its other 3 version 1, trained by version 1
    assert step2["rollout/staleness_token_mean"] == token_lag
    assert step2["rollout/staleness_max"] == (1.0 if mode == "continue" else 0.0)
    assert [row["rollout/partial_takeovers"] for row in history] == [0.0, 1.0, 0.0]
    assert history[0]["rollout/staleness_token_mean"] == 0.0


def test_staleness_zero_with_partial_rollouts_is_still_the_synchronous_loop_bitwise(tmp_path):
    synchronous = make_trainer(tmp_path / "sync", trainer__total_steps=3).train()
    trainer = make_trainer(tmp_path / "async", trainer__total_steps=3, trainer__max_staleness=1,
                           trainer__partial_rollout="continue")
    trainer.pipeline = AsyncPipeline(trainer, max_staleness=0)
    assert learning_metrics(trainer.train()) == [{**row, "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
                                                 for row in learning_metrics(synchronous)]


@pytest.mark.parametrize("overrides, words", [
    (dict(trainer__max_staleness=0), "trainer.max_staleness > 0"),
    (dict(trainer__max_staleness=1, trainer__rollout_worker="process"), "trainer.rollout_worker=process"),
    (dict(trainer__max_staleness=1, algorithm__dynamic_sampling=True), "algorithm.dynamic_sampling"),
    (dict(trainer__max_staleness=1, rollout__stop_strings=["\n"]), "rollout.stop_strings"),
])
def test_partial_rollouts_where_they_are_not_built_are_refused_in_one_sentence(tmp_path, overrides, words):
    with pytest.raises(ConfigError, match="trainer.partial_rollout=continue") as error:
        make_trainer(tmp_path, trainer__partial_rollout="continue", **overrides)
    assert words in str(error.value)
