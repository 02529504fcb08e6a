"""The generative judge reward: each parse mode on hand-made texts and log-probs, a tiny judge whose answers are
known (it copies the last character of its prompt) through the real generation paths, the configured score on
unparseable output, template mistakes, and a short training run with the judge as the reward."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import tiny_actor, toy_prompts

from hybridrl.config.checks import judge_template_problem
from hybridrl.config.loading import build_config
from hybridrl.config.schema import ConfigError, RewardConfig
from hybridrl.data.datasets import PromptDataset
from hybridrl.judge import JudgeReward, parse_number, parse_scale, yes_no_score
from hybridrl.models.loading import build_tiny_model
from hybridrl.rewards import RewardComposer, RewardSpecError, WeightedReward
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.hf import HFBackend
from hybridrl.training.trainer import RLTrainer


@pytest.mark.parametrize("text, expected", [
    ("The score is 7.", 7.0), ("3 errors, so #### 42", 42.0), ("\\boxed{-1.5} then 9", -1.5),
    ("final: 1,234", 1234.0), ("no digits here", None)])
def test_number_mode_reads_the_final_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("7", 6 / 9), ("Score: 7/10", 6 / 9), ("8 out of 10", 7 / 9), ("I give it 1", 0.0), ("10", 1.0),
    ("between 2 and 9", 8 / 9), ("11", None), ("0", None), ("3.5", None), ("great", None)])
def test_scale_mode_reads_the_last_integer_from_1_to_10(text, expected):
    result = parse_scale(text)
    assert result == (None if expected is None else pytest.approx(expected))


def test_yes_no_mode_is_the_yes_share_of_the_two_answer_probabilities():
    assert yes_no_score(math.log(0.3), math.log(0.1)) == pytest.approx(0.75)
    assert yes_no_score(math.log(0.2), math.log(0.2)) == pytest.approx(0.5)
    assert yes_no_score(-1000.0, 0.0) == pytest.approx(0.0) and yes_no_score(0.0, -1000.0) == pytest.approx(1.0)


@pytest.mark.parametrize("template, sentence", [
    ("Is {prompt} right? Answer:", "no {response} placeholder"),
    ("{response} vs {answer}", "unknown placeholder(s) {answer}"),
    ("{response} {", "unbalanced braces")])
def test_bad_templates_get_one_sentence(template, sentence):
    assert sentence in judge_template_problem(template)
    with pytest.raises(ValueError, match="judge template"):
        JudgeReward(*copier_judge(), template)
    with pytest.raises(ConfigError, match=r"^reward\.judge_template: the judge template"):
        build_config({"reward": {"judge_model": "tiny:llama", "judge_template": template}})


def test_a_literal_brace_and_every_placeholder_are_accepted():
    assert judge_template_problem("{{json}} {prompt} {reference} {response}") is None


def copier_judge():
    """A tiny Llama that writes, again and again, the last token of its prompt: its layers add nothing (zero output
    projections), the embedding is one-hot per token and the head reads it back, so every next token is a copy."""
    model, tokenizer = build_tiny_model("llama", seed=0, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)
    one_hot = torch.eye(len(tokenizer), 128)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(one_hot)
        model.lm_head.weight.copy_(one_hot)
    return model, tokenizer


@pytest.mark.parametrize("backend, backend_class", [("auto", BuiltinBackend), ("hf", HFBackend)])
def test_scale_judge_scores_what_it_wrote_and_counts_what_it_could_not_read(backend, backend_class):
    judge = JudgeReward(*copier_judge(), "Rate this: {response}", parse="scale", failure_score=-1.0,
                        max_new_tokens=1, backend=backend)
    assert isinstance(judge.backend, backend_class)
    scores = judge(["q"] * 4, ["it is 7", "it is 1", "it is x", "it is 9"])
    assert scores == pytest.approx([6 / 9, 0.0, -1.0, 8 / 9])
    assert judge.last_metrics["reward/judge_parse_failures"] == 1
    assert judge.last_metrics["timing/judge_s"] > 0


def test_number_judge_reads_its_greedy_text():
    judge = JudgeReward(*copier_judge(), "{prompt} -> {response}", parse="number", max_new_tokens=3,
                        failure_score=0.5)
    assert judge(["a", "b"], ["5", "?"]) == [555.0, 0.5]  # it writes "555" and "???"
    assert judge.last_metrics["reward/judge_parse_failures"] == 1


def test_yes_no_judge_reads_the_answer_tokens_log_probs():
    judge = JudgeReward(*copier_judge(), "Verdict on {response}", parse="yes_no", answer_words=("y", "n"))
    assert judge.backend is None  # one forward pass, no generation
    yes, no = judge(["q", "q"], ["so y", "so n"])
    assert yes > 0.999 and no < 0.001
    assert judge.last_metrics["reward/judge_parse_failures"] == 0


def test_yes_no_scores_of_a_padded_batch_equal_each_sample_alone():
    model, tokenizer = build_tiny_model("llama", seed=3)
    judge = JudgeReward(model, tokenizer, parse="yes_no", batch_size=3)
    prompts, completions = ["1+1=", "12+30=", "7+0="] * 2, ["2", "42 it is", "7."] * 2
    answers = ["2", "42", "7"] * 2
    batched = judge(prompts, completions, answer=answers)
    alone = [judge([p], [c], answer=[a])[0] for p, c, a in zip(prompts, completions, answers)]
    assert batched == pytest.approx(alone, abs=1e-5)
    assert len(set(round(s, 6) for s in batched[:3])) == 3  # a random judge: distinct scores, not a constant
    ids = torch.tensor([tokenizer(judge.render(prompts[1], completions[1], answers[1]))["input_ids"]])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0, -1], dim=-1)  # the whole model, as transformers runs it
    # " Yes" and " No" begin with the same space token of this character vocabulary: only "Y" and "N" count
    yes, no = (logprobs[tokenizer.encode(word, add_special_tokens=False)[0]].item() for word in ("Yes", "No"))
    assert batched[1] == pytest.approx(yes_no_score(yes, no), abs=1e-5)


class WordTokenizer:
    """A vocabulary where "Yes" and " Yes" are distinct tokens, as in BPE ones."""

    vocabulary = {"Yes": 0, " Yes": 1, "No": 2, " No": 3, "Maybe": 4, " Maybe": 4}

    def encode(self, text, add_special_tokens=False):
        return [self.vocabulary[text]]


def test_yes_no_answer_mass_counts_the_word_with_and_without_a_leading_space():
    judge = JudgeReward.__new__(JudgeReward)
    judge.tokenizer = WordTokenizer()
    assert judge._answer_tokens(("Yes", "No")) == ([0, 1], [2, 3])
    with pytest.raises(ValueError, match="begin with the same tokens"):
        judge._answer_tokens(("Maybe", " Maybe"))


def test_the_reference_column_is_checked_before_scoring():
    composer = RewardComposer([WeightedReward("judge", JudgeReward(*copier_judge(), parse="yes_no"))])
    with pytest.raises(RewardSpecError, match="'judge' reads column 'answer'"):
        composer.check_columns(["prompt"], "the training data")
    composer.check_columns(["prompt", "answer"], "the training data")


@pytest.mark.parametrize("parse", ["yes_no", "scale"])
def test_two_steps_with_the_judge_as_the_reward(tmp_path, parse):
    actor = tiny_actor()
    dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
    trainer = RLTrainer(actor=actor, dataset=dataset, reward__judge_model="tiny:llama", reward__judge_parse=parse,
                        reward__judge_max_new_tokens=4, reward__judge_parse_failure_score=0.25, trainer__total_steps=2,
                        actor__lr=1e-3, rollout__max_new_tokens=4, rollout__num_samples_per_prompt=4,
                        trainer__prompts_per_step=4, actor__micro_batch_size=16, trainer__device="cpu",
                        logging__sinks=["jsonl"], trainer__save_model=False, trainer__output_dir=str(tmp_path))
    before = [p.detach().clone() for p in trainer.parts.actor.parameters()]
    history = trainer.train()
    changed = all(not torch.equal(b, p) for b, p in zip(before, trainer.parts.actor.parameters()))
    # A random scale judge mostly writes no 1..10, so all samples may score the failure score: nothing to learn.
    assert changed or parse == "scale"
    for key in ("reward/judge", "reward/judge_parse_failures", "timing/judge_s"):
        assert key in history[-1] and math.isfinite(history[-1][key]), key
    assert '"reward/judge_parse_failures"' in (tmp_path / "metrics.jsonl").read_text()
    assert 0 <= history[-1]["reward/judge_parse_failures"] <= 16  # 4 prompts x 4 samples
    if history[-1]["reward/judge_parse_failures"] == 16:  # every text unreadable: every score the configured one
        assert history[-1]["reward/judge"] == pytest.approx(0.25)
    assert 0 < history[-1]["reward/judge"] < 1 if parse == "yes_no" else 0 <= history[-1]["reward/judge"] <= 1
    assert isinstance(trainer.parts.rewards.rewards[0].fn.backend, BuiltinBackend if parse == "scale" else type(None))


@pytest.mark.slow
def test_the_judge_benchmark_runs_every_mode_on_tiny_shapes(tmp_path, monkeypatch, capsys):
    from benchmarks import judge_step

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["judge_step", "--tiny"])
    judge_step.main()
    table = capsys.readouterr().out.split("peak GiB")[1]
    assert all(mode in table for mode in judge_step.MODES)
    modes = {m["mode"]: m for m in json.loads((tmp_path / "judge_step.json").read_text())["modes"]}
    assert modes["judge-yes_no"]["judge_s"] > 0 and modes["no-judge"]["judge_s"] == 0
    assert modes["judge-number"]["parse_failures"] == 4  # a random judge writes no number: 2 prompts x 2 samples


@pytest.mark.parametrize("parse, backend", [("number", "auto"), ("number", "hf"), ("yes_no", "auto")])
def test_an_offloaded_judge_scores_as_a_resident_one_and_waits_in_host_memory_between_calls(parse, backend):
    """`reward.judge_offload`: between calls every parameter (the tied head included) is its host copy; scores over
    two calls equal a judge that never left the device (each call copies the weights in anew)."""
    resident = JudgeReward(*copier_judge(), "{prompt} -> {response}", parse=parse, max_new_tokens=3,
                           answer_words=("5", "7"), backend=backend)
    model, tokenizer = copier_judge()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as many judges are
    offloaded = JudgeReward(model, tokenizer, "{prompt} -> {response}", parse=parse, max_new_tokens=3,
                            answer_words=("5", "7"), backend=backend, offload=True)

    def on_host() -> bool:
        return all(p.data_ptr() == offloaded.offload.host[p].data_ptr() for p in model.parameters())

    assert on_host()
    for completions in (["5", "?", "7"], ["75", "5", "x"]):
        assert offloaded(["a", "b", "c"], completions) == resident(["a", "b", "c"], completions)
        assert on_host()


def test_judge_offload_is_a_config_key_that_reaches_the_judge():
    config = RewardConfig(judge_model="tiny:llama", judge_offload=True)
    judge = JudgeReward.from_config(config)
    assert judge.offload is not None
    assert len(judge(["1+1="], ["2"], answer=["2"])) == 1
