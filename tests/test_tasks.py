import json

import pytest

from hybridrl.data.tasks import arithmetic_problems, write_arithmetic_task
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
