"""benchmarks/skill_task.py: greedy answers sorted into right, the teacher's slip and other errors; and the carry
task's wiring (`hybridrl demo --task carry`, `learning_vs_trl.py --task carry`)."""

from benchmarks import learning_vs_trl
from benchmarks.skill_task import classify, operands
from hybridrl.cli import DEMO_DIRS, DEMO_TEACHERS, build_parser
from hybridrl.data.tasks import arithmetic_problems


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
    teacher, _ = learning_vs_trl.TASKS["carry"]
    assert teacher == DEMO_TEACHERS["carry"] and teacher["slip_rate"] > 0
    rows = arithmetic_problems(500, seed=0, **teacher)
    assert any(row["response"] != row["answer"] for row in rows)  # the teacher does slip


def test_make_data_writes_the_carry_teacher(tmp_path):
    from hybridrl.cli import main
    from hybridrl.data.tasks import write_arithmetic_task

    assert main(["make-data", str(tmp_path / "cli"), "--period-rate", "0", "--slip-rate", "0.3", "--num-train", "50",
                 "--num-eval", "10"]) in (0, None)
    expected = write_arithmetic_task(tmp_path / "direct", num_train=50, num_eval=10, slip_rate=0.3)
    assert (tmp_path / "cli" / "train.jsonl").read_text() == expected["train"].read_text()
