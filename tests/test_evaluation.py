"""Held-out evaluation with several samples per prompt: pass@k beside exact-match accuracy, named the same way in
the config, the console line, the summary and the plot."""

from __future__ import annotations

import pytest

from hybridrl import PromptDataset, RLTrainer
from hybridrl.config.loading import load_config
from hybridrl.config.schema import ConfigError
from hybridrl.metrics.plot import panels_of
from hybridrl.metrics.sinks import ConsoleSink
from hybridrl.metrics.summary import run_summary
from hybridrl.training.evaluation import pass_at_k
from tests.conftest import tiny_actor, toy_prompts

FAST = dict(rollout__max_new_tokens=4, rollout__num_samples_per_prompt=4, trainer__prompts_per_step=8,
            actor__micro_batch_size=16, trainer__device="cpu", logging__sinks=["jsonl"], trainer__save_model=False)


def test_pass_at_k_by_hand():
    # prompt 0: one of three right; prompt 1: none; prompt 2: all right
    agree = [False, True, False, False, False, False, True, True, True]
    assert pass_at_k(agree, [0, 0, 0, 1, 1, 1, 2, 2, 2]) == pytest.approx(2 / 3)
    assert pass_at_k([True, False], [0, 1]) == 0.5  # one sample each: pass@1 is the accuracy


def test_several_greedy_samples_are_refused_in_one_sentence():
    with pytest.raises(ConfigError, match=r"eval.num_samples=4 .* set rollout.eval_temperature"):
        load_config(None, ["eval.num_samples=4"])
    assert load_config(None, ["eval.num_samples=4", "rollout.eval_temperature=0.7"]).eval.num_samples == 4


def test_pass_at_k_counts_prompts_with_any_exact_response(tmp_path):
    """Sample 4 responses to 16 held-out prompts; make the reference answer of prompts 0-7 one of their own samples
    (sample i % 4) and of prompts 8-15 an answer never produced; the same seed samples the same responses again.
    pass@4 is then 8/16, and eval/accuracy the share of all 64 responses that equal their prompt's answer."""
    actor = tiny_actor()
    rows = toy_prompts(16)
    seen: list[list[str]] = []

    def recorder(prompts, completions, **columns):
        seen.append(list(completions))
        return [0.0] * len(completions)

    settings = dict(eval__num_samples=4, rollout__eval_temperature=1.0, trainer__output_dir=str(tmp_path), **FAST)
    data = PromptDataset(rows, actor.tokenizer, max_length=16)
    trainer = RLTrainer(actor=actor, reward_fn=recorder, dataset=data, eval_dataset=data, **settings)
    first = trainer.evaluate()
    samples = seen[-1]
    assert len(samples) == 64 and first["eval/pass@4"] <= first["eval/accuracy"] * 4
    answered = [dict(row, answer=samples[4 * i + i % 4] if i < 8 else "never") for i, row in enumerate(rows)]
    trainer.parts.eval_dataset = PromptDataset(answered, actor.tokenizer, max_length=16)
    metrics = trainer.evaluate()
    assert seen[-1] == samples  # same seed, same step: the same responses
    exact = [samples[j].strip() == answered[j // 4]["answer"].strip() for j in range(64)]
    assert metrics["eval/pass@4"] == 0.5
    assert metrics["eval/accuracy"] == pytest.approx(sum(exact) / 64)
    assert "eval/pass@4" not in RLTrainer(actor=actor, reward_fn=recorder, dataset=data, eval_dataset=data,
                                          **{**settings, "eval__num_samples": 1}).evaluate()


def test_pass_at_k_is_named_in_the_console_summary_and_plot(tmp_path, capsys):
    metrics = {"reward/mean": 0.5, "eval/accuracy": 0.25, "eval/pass@4": 0.5, "actor/kl": 0.1}
    ConsoleSink(total_steps=10, progress=False).write(3, metrics)
    line = capsys.readouterr().out
    assert "reward=0.5 eval_exact=0.25 pass@4=0.5 kl=0.1" in line
    history = [{"step": 0, "eval/accuracy": 0.25, "eval/pass@4": 0.5},
               {"step": 2, "eval/accuracy": 0.5, "eval/pass@4": 0.75}]
    lines = run_summary(history, 1.0, tmp_path).splitlines()
    assert lines[1:3] == ["  eval/accuracy: 25.0% -> 50.0% (+25.0 points)",
                          "  eval/pass@4: 50.0% -> 75.0% (+25.0 points)"]
    titles = [title for _, title in panels_of(history + [{"step": 1, "reward/mean": 1.0}])]
    assert titles == ["reward (mean)", "held-out exact-match accuracy", "held-out pass@4 (exact match)"]
