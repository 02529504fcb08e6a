import json

import pytest

from hybridrl.data.tasks import arithmetic_problems, slipped_answer, write_arithmetic_task
from hybridrl.rewards import exact_match


def test_answers_are_right_and_period_style_fails_exact_match():
    rows = arithmetic_problems(400, seed=0, period_rate=0.5)
    for row in rows:
        a, op, b = row["prompt"][:-1].partition("+") if "+" in row["prompt"] else row["prompt"][:-1].partition("-")
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    with_period = [r for r in rows if r["response"].endswith(".")]
    assert 150 < len(with_period) < 250  # about half
    scores = exact_match([r["prompt"] for r in rows], [r["response"] for r in rows], answer=[r["answer"] for r in rows])
    assert sum(scores) == len(rows) - len(with_period)


def test_splits_are_disjoint_and_seeded(tmp_path):
    paths = write_arithmetic_task(tmp_path, num_train=300, num_eval=50, seed=3)
    train = [json.loads(line)["prompt"] for line in paths["train"].read_text().splitlines()]
    held_out = [json.loads(line)["prompt"] for line in paths["eval"].read_text().splitlines()]
    assert len(train) == 300 and len(held_out) == 50 and not set(train) & set(held_out)
    assert arithmetic_problems(10, seed=3) == arithmetic_problems(10, seed=3)


def test_asking_for_more_problems_than_exist_is_an_error():
    with pytest.raises(ValueError, match="give only 200"):
        arithmetic_problems(201, seed=0, max_operand=9)


@pytest.mark.parametrize("a, operator, b, slipped", [
    (37, "+", 58, 85),    # 7+8=15: the 1 is not carried
    (95, "+", 17, 102),   # tens 9+1 written in full, units carry dropped (right: 112)
    (12, "+", 34, None),  # no carry needed: nothing to slip on
    (73, "-", 58, 25),    # units 3-8 becomes 8-3, no borrow from the tens (right: 15)
    (58, "-", 73, -25),   # negative result: the same slip on 73-58
    (75, "-", 32, None),
    (5, "-", 8, None),    # -(8-5): no borrow
    (40, "-", 7, 47),     # 0-7 becomes 7-0 (right: 33)
])
def test_slipped_answer_makes_the_classic_column_errors(a, operator, b, slipped):
    assert slipped_answer(a, operator, b) == slipped


def test_slipping_teacher_errs_only_where_a_carry_or_borrow_is_needed_and_keeps_the_true_answer():
    rows = arithmetic_problems(2000, seed=0, slip_rate=0.5)
    num_needing = num_slipped = 0
    for row in rows:
        body = row["prompt"][:-1]  # operands are >= 0, so the first sign in the prompt is the operator
        operator = "+" if "+" in body else "-"
        a, b = (int(x) for x in body.split(operator))
        assert int(row["answer"]) == (a + b if operator == "+" else a - b)
        possible = slipped_answer(a, operator, b)
        assert row["response"] in ({row["answer"]} if possible is None else {row["answer"], str(possible)})
        num_needing += possible is not None
        num_slipped += row["response"] != row["answer"]
    assert 0.4 * num_needing < num_slipped < 0.6 * num_needing  # about half of those that need a carry or borrow
    assert arithmetic_problems(300, seed=1, period_rate=0.5) == arithmetic_problems(300, seed=1, period_rate=0.5,
                                                                                      slip_rate=0.0)
