"""benchmarks/skill_task.py: greedy answers sorted into right, the teacher's slip and other errors; and the carry
task's wiring (`hybridrl demo --task carry`, `learning_vs_trl.py --task carry`)."""

import json

from benchmarks import learning_vs_trl
from benchmarks.skill_task import classify, operands
from hybridrl import cli
from hybridrl.cli import DEMO_DIRS, DEMO_SFT_OVERRIDES, DEMO_TEACHERS, build_parser
from hybridrl.data.tasks import arithmetic_problems, slipped_answer


def test_operands_read_both_operators():
    assert operands("37+58=") == (37, "+", 58)
    assert operands("5-73=") == (5, "-", 73)


def test_answers_are_sorted_into_right_slip_and_other():
    carry = {"prompt": "37+58=", "answer": "95"}
    assert [classify(text, carry) for text in ("95", " 95 ", "85", "94", "95.")] == \
        ["right", "right", "slip", "other", "other"]
    no_carry = {"prompt": "12+34=", "answer": "46"}  # no slip exists: every wrong answer is "other"
    assert classify("46", no_carry) == "right" and classify("36", no_carry) == "other"
    assert classify("-25", {"prompt": "58-73=", "answer": "-15"}) == "slip"


def test_carry_task_is_wired_into_the_demo_and_the_learning_benchmark():
    assert build_parser().parse_args(["demo", "--task", "carry"]).task == "carry" and "carry" in DEMO_DIRS
    teacher, sft_overrides = learning_vs_trl.TASKS["carry"]
    assert teacher == DEMO_TEACHERS["carry"] and teacher["slip_rate"] > 0
    assert sft_overrides == DEMO_SFT_OVERRIDES["carry"]  # the benchmark's SFT model is the demo's
    rows = arithmetic_problems(500, seed=0, **teacher)
    assert any(row["response"] != row["answer"] for row in rows)  # the teacher does slip


def test_make_data_writes_the_carry_teacher(tmp_path):
    from hybridrl.cli import main
    from hybridrl.data.tasks import write_arithmetic_task

    assert main(["make-data", str(tmp_path / "cli"), "--period-rate", "0", "--slip-rate", "0.3", "--num-train", "50",
                 "--num-eval", "10"]) in (0, None)
    expected = write_arithmetic_task(tmp_path / "direct", num_train=50, num_eval=10, slip_rate=0.3)
    assert (tmp_path / "cli" / "train.jsonl").read_text() == expected["train"].read_text()


def test_carry_demo_passes_its_sft_and_rl_settings_to_both_stages(tmp_path, monkeypatch):
    """The measured settings (docs/benchmarks.md, the carry task) reach the configs the demo's two stages run with:
    the SFT at lr 1e-3 on the slipping teacher's data, GRPO for 100 steps at 1e-4; the arithmetic demo keeps its own."""
    seen = {}

    def fake_sft(config):
        seen["sft"] = config
        return tmp_path / "sft_model"

    class FakeTrainer:
        def __init__(self, config):
            seen["rl"] = config

        def train(self):
            return [{"eval/accuracy": 0.5}, {"eval/accuracy": 0.6}]

    monkeypatch.setattr(cli, "run_sft", fake_sft)
    monkeypatch.setattr(cli, "RLTrainer", FakeTrainer)
    for task, sft_lr, rl_lr, steps in (("carry", 1e-3, 1e-4, 100), ("arithmetic", 3e-3, 3e-5, 60)):
        assert cli.main(["demo", "--task", task, "--out-dir", str(tmp_path / task)]) == 0
        assert (seen["sft"].sft.lr, seen["rl"].actor.lr, seen["rl"].trainer.total_steps) == (sft_lr, rl_lr, steps)
    rows = [json.loads(line) for line in (tmp_path / "carry" / "data" / "train.jsonl").read_text().splitlines()]
    needing = [row for row in rows if slipped_answer(*operands(row["prompt"])) is not None]
    slipped = sum(row["response"] != row["answer"] for row in needing) / len(needing)
    assert abs(slipped - DEMO_TEACHERS["carry"]["slip_rate"]) < 0.03  # the teacher slips at the demo's rate
