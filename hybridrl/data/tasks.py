"""Synthetic tasks with verifiable answers, for the CPU demo and the tests.

`arithmetic`: prompts like "37+58=" whose answer is the decimal result. Files are JSONL with
`prompt`, `answer` (ground truth, read by the `exact_match` reward) and `response` (the SFT target).

The SFT targets can come from an inconsistent teacher (`period_rate`): on that fraction of problems
it writes the answer with a trailing period ("95."), which the strict `exact_match` verifier rejects.
The SFT model imitates both styles; RL, rewarded by the verifier, has to learn which one counts, as
it must for any real answer format. Train and held-out splits never share a question.

The teacher can also slip in the arithmetic itself (`slip_rate`): on that fraction of the problems that need a
carry or a borrow it makes one of the two classic column-arithmetic errors (`slipped_answer`). Whether a problem
needs one depends on its units digits, so a model that RL moves away from the slips has learned when to carry,
which is the arithmetic skill and not a format.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def slipped_answer(a: int, operator: str, b: int) -> int | None:
    """The answer of a solver who adds column by column without carrying (37+58 -> 85) or subtracts the smaller
    digit from the larger in each column instead of borrowing (73-58 -> 25; 58-73 -> -25); None where the problem
    needs no carry or borrow (the slip would give the right answer)."""
    if operator == "+":
        if a % 10 + b % 10 < 10:
            return None
        return (a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10
    if a < b:
        slipped = slipped_answer(b, "-", a)
        return None if slipped is None else -slipped
    if a % 10 >= b % 10:
        return None
    return (a // 10 - b // 10) * 10 + b % 10 - a % 10


def arithmetic_problems(num: int, seed: int, max_operand: int = 99, operators: str = "+-",
                        period_rate: float = 0.0, slip_rate: float = 0.0) -> list[dict[str, str]]:
    capacity = (max_operand + 1) ** 2 * len(operators)
    if num > capacity:
        raise ValueError(f"asked for {num} distinct problems but operands 0..{max_operand} with "
                         f"{operators!r} give only {capacity}; ask for fewer or raise max_operand.")
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < num:
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(operators)
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        answer = a + b if op == "+" else a - b
        taught = f"{answer}." if rng.random() < period_rate else str(answer)
        slipped = slipped_answer(a, op, b) if slip_rate else None  # no draw without slips: the demo's data stays
        if slipped is not None and rng.random() < slip_rate:
            taught = str(slipped)
        rows.append({"prompt": f"{a}{op}{b}=", "answer": str(answer), "response": taught})
    return rows


def write_arithmetic_task(out_dir: str | Path, num_train: int = 9500, num_eval: int = 500, seed: int = 1234,
                          max_operand: int = 99, operators: str = "+-",
                          period_rate: float = 0.0, slip_rate: float = 0.0) -> dict[str, Path]:
    """Write train.jsonl and eval.jsonl (disjoint questions) under `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = arithmetic_problems(num_train + num_eval, seed, max_operand, operators, period_rate, slip_rate)
    paths = {"train": out_dir / "train.jsonl", "eval": out_dir / "eval.jsonl"}
    for split, part in (("train", rows[:num_train]), ("eval", rows[num_train:])):
        with paths[split].open("w") as file:
            for row in part:
                file.write(json.dumps(row) + "\n")
    return paths
