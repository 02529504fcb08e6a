"""Synthetic tasks with verifiable answers, for the CPU demo and the tests.

`arithmetic`: prompts like "37+58=" whose answer is the decimal result. Files are JSONL with
`prompt`, `answer` (ground truth, read by the `exact_match` reward) and `response` (the SFT target).

The SFT targets can come from an imperfect teacher (`teacher_error_rate`): on that fraction of
problems it forgets to carry or borrow, the classic schoolchild mistake ("37+58=85"). The SFT model
imitates those mistakes; RL, rewarded by the verifier against `answer`, has to unlearn them. That
is the situation RL post-training exists for, and it makes the demo's improvement measurable in
minutes on a CPU. Train and held-out splits never share a question.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def without_carry(a: int, b: int, op: str) -> int:
    """Digit-by-digit sum or difference that drops carries and borrows (37+58 -> 85, 52-17 -> 45)."""
    if op == "-" and a < b:
        return -without_carry(b, a, op)
    digits, place = 0, 1
    while a or b:
        da, db = a % 10, b % 10
        digits += ((da + db) % 10 if op == "+" else abs(da - db)) * place
        a, b, place = a // 10, b // 10, place * 10
    return digits


def arithmetic_problems(num: int, seed: int, max_operand: int = 99, operators: str = "+-",
                        teacher_error_rate: float = 0.0) -> list[dict[str, str]]:
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
        taught = without_carry(a, b, op) if rng.random() < teacher_error_rate else answer
        rows.append({"prompt": f"{a}{op}{b}=", "answer": str(answer), "response": str(taught)})
    return rows


def write_arithmetic_task(out_dir: str | Path, num_train: int = 9500, num_eval: int = 500, seed: int = 1234,
                          max_operand: int = 99, operators: str = "+-",
                          teacher_error_rate: float = 0.0) -> dict[str, Path]:
    """Write train.jsonl and eval.jsonl (disjoint questions) under `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = arithmetic_problems(num_train + num_eval, seed, max_operand, operators, teacher_error_rate)
    paths = {"train": out_dir / "train.jsonl", "eval": out_dir / "eval.jsonl"}
    for split, part in (("train", rows[:num_train]), ("eval", rows[num_train:])):
        with paths[split].open("w") as file:
            for row in part:
                file.write(json.dumps(row) + "\n")
    return paths
