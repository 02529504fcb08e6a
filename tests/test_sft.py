"""`hybridrl sft`: it learns, and with `data.eval_path` it reports held-out loss and exact-match accuracy."""

import json

import pytest

from hybridrl.config import load_config
from hybridrl.data.datasets import DataError
from hybridrl.data.tasks import write_arithmetic_task
from hybridrl.training.evaluation import answer_column, exact_agreement
from hybridrl.training.sft import run_sft


def sft_config(tmp_path, **overrides):
    paths = write_arithmetic_task(tmp_path / "data", num_train=256, num_eval=24, seed=5)
    base = {"model.path": "tiny:llama", "data.train_path": str(paths["train"]), "data.eval_path": str(paths["eval"]),
            "sft.batch_size": 32, "sft.lr": 3e-3, "sft.max_steps": 24, "sft.num_epochs": 10, "sft.max_length": 32,
            "trainer.device": "cpu", "trainer.output_dir": str(tmp_path / "sft"), "trainer.eval_every": 10,
            "logging.sinks": ["jsonl"], **overrides}
    return load_config(overrides=[f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in base.items()])


def test_exact_agreement_and_answer_column_by_hand():
    assert exact_agreement([" 12", "7.", "3", "x"], ["12", "7", 3, None]) == [True, False, True, False]
    assert answer_column({"answer": ["1", "2"]}, "answer") == ["1", "2"]
    assert answer_column({"answer": [None, None]}, "answer") is None
    assert answer_column({"other": ["1"]}, "answer") is None and answer_column({"answer": ["1"]}, None) is None


def test_sft_evaluates_held_out_loss_and_accuracy_during_and_after(tmp_path, capsys):
    run_sft(sft_config(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if "eval/loss" in row]
    assert [row["step"] for row in evals] == [0, 10, 20, 24]
    assert all(0.0 <= row["eval/accuracy"] <= 1.0 for row in evals)
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]  # it learned something held-out
    losses = [row["sft/loss"] for row in rows if "sft/loss" in row]
    assert losses[-1] < losses[0]
    out = capsys.readouterr().out
    assert "== SFT summary" in out and "eval/accuracy: " in out and "eval/loss: " in out and "24 steps in" in out


def test_sft_eval_data_without_answers_or_responses_is_refused_before_training(tmp_path):
    bare = tmp_path / "bare.jsonl"
    bare.write_text('{"prompt": "1+1="}\n')
    with pytest.raises(DataError, match="neither a 'response' column .* nor a 'answer' column"):
        run_sft(sft_config(tmp_path, **{"data.eval_path": str(bare)}))
    assert not (tmp_path / "sft" / "model").exists()


def test_sft_eval_with_answers_only_logs_accuracy(tmp_path):
    answers_only = tmp_path / "answers.jsonl"
    answers_only.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    run_sft(sft_config(tmp_path, **{"data.eval_path": str(answers_only), "sft.max_steps": 3}))
    final = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()][-1]
    assert "eval/accuracy" in final and "eval/loss" not in final
