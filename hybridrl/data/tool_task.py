"""The tool task: multiply a 3-digit by a 2-digit number, with a `calc` tool the tiny model cannot do without.

Prompts are "123*45"; the answer is the exact product. A tiny character-level model does not learn
multi-digit multiplication from a few thousand examples, but it does learn to copy digits, so calling
`calc` (`envs/builtin_tools.py`) and copying its result back is the way to be right.

Files (`write_tool_task`): `train.jsonl` and `eval.jsonl` have `prompt` and `answer` (for RL and held-out
accuracy; disjoint questions), `sft.jsonl` has the same training questions with `messages`, the teacher's
conversation, for SFT. The teacher calls the tool on a fraction `tool_rate` of the problems:

    Q123*45\nA[[{"name":"calc","arguments":{"expr":"123*45"}}]]<eos>R5535\nA 5535<eos>    (with the tool)
    Q123*45\nA 5400<eos>                                                                     (in its head)

(rendered by the tiny model's chat template, `CHAR_CHAT_TEMPLATE`). In its head the teacher rounds the first
factor to tens, so it is usually wrong; the SFT model imitates both habits, and RL, rewarded by exact match,
has to find out that the tool is what makes answers right.

Choices:
- Every final answer starts with a space, so the choice between calling the tool and answering is one token
  (the tag's first character or the space); otherwise greedy decoding would weigh the tag against the single
  most likely digit, and the tool-call rate would say more about digit statistics than about the policy.
- Short tags (`[[`, `]]`) and compact JSON: every character is a token of the tiny model. The call's argument is
  the prompt itself (`"expr":"123*45"`), one contiguous span to copy, which a tiny model learns far sooner than
  two numbers copied into two places.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

TOOL_CALL_START = "[["
TOOL_CALL_END = "]]"


def multiplication_problems(num: int, seed: int) -> list[tuple[int, int]]:
    """`num` distinct pairs (a, b) with 100 <= a <= 999 and 10 <= b <= 99, in a seeded random order."""
    capacity = 900 * 90
    if num > capacity:
        raise ValueError(f"asked for {num} distinct problems but 3-digit times 2-digit gives only {capacity}; "
                         "ask for fewer.")
    rng = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(pairs) < num:
        pair = (rng.randint(100, 999), rng.randint(10, 99))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return pairs


def tool_call_text(a: int, b: int, start: str = TOOL_CALL_START, end: str = TOOL_CALL_END) -> str:
    """The assistant's call of `calc("a*b")` in the format `envs/tools.py` parses."""
    call = {"name": "calc", "arguments": {"expr": f"{a}*{b}"}}
    return start + json.dumps(call, separators=(",", ":")) + end


def teacher_messages(a: int, b: int, use_tool: bool, start: str = TOOL_CALL_START,
                     end: str = TOOL_CALL_END) -> list[dict[str, str]]:
    """The teacher's conversation for one problem: with the tool (call, result, answer) or in its head (the
    first factor rounded to tens)."""
    user = {"role": "user", "content": f"{a}*{b}"}
    if not use_tool:
        return [user, {"role": "assistant", "content": f" {round(a, -1) * b}"}]
    return [user, {"role": "assistant", "content": tool_call_text(a, b, start, end)},
            {"role": "tool", "name": "calc", "content": str(a * b)},
            {"role": "assistant", "content": f" {a * b}"}]


def tool_task_rows(pairs: list[tuple[int, int]], tool_rate: float, seed: int,
                   start: str = TOOL_CALL_START, end: str = TOOL_CALL_END) -> list[dict[str, Any]]:
    """Rows with `prompt`, `answer` and the teacher's `messages` (tool use drawn with probability `tool_rate`)."""
    if not 0.0 <= tool_rate <= 1.0:
        raise ValueError(f"tool_rate is the fraction of problems the teacher solves with the tool, between 0 and 1; "
                         f"got {tool_rate}.")
    rng = random.Random(seed)
    return [{"prompt": f"{a}*{b}", "answer": str(a * b),
             "messages": teacher_messages(a, b, rng.random() < tool_rate, start, end)} for a, b in pairs]


def write_tool_task(out_dir: str | Path, num_train: int = 4000, num_eval: int = 200, seed: int = 1234,
                    tool_rate: float = 0.5) -> dict[str, Path]:
    """Write train.jsonl and eval.jsonl (prompt, answer; disjoint questions) and sft.jsonl (the training
    questions with the teacher's messages) under `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = tool_task_rows(multiplication_problems(num_train + num_eval, seed), tool_rate, seed + 1)
    train, held_out = rows[:num_train], rows[num_train:]
    paths = {"train": out_dir / "train.jsonl", "eval": out_dir / "eval.jsonl", "sft": out_dir / "sft.jsonl"}
    parts = {"train": _without(train, "messages"), "eval": _without(held_out, "messages"),
             "sft": [{key: row[key] for key in ("messages", "answer")} for row in train]}
    for split, part in parts.items():
        with paths[split].open("w") as file:
            for row in part:
                file.write(json.dumps(row) + "\n")
    return paths


def _without(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The RL files have no `messages` column: the tool environment would take it as the first messages."""
    return [{k: v for k, v in row.items() if k != key} for row in rows]
