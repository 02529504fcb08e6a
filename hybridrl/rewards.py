"""Reward functions: one interface, the built-ins, user code from a file, a reward model, and their sum.

A reward function is `fn(prompts: list[str], completions: list[str], **columns) -> list[float]`. The
`columns` are the dataset's other columns as lists aligned with the batch (`answer=[...]`); a function
takes the ones it needs and ignores the rest through `**columns`.

Choices:
- Everything scores decoded text, so a reward model may use a different tokenizer from the actor.
- Built-ins are found in the small dict `BUILTIN_REWARDS`; user code is `path/to/file.py:function`,
  imported from its path (no package or registry needed).
- `RewardComposer` sums the weighted rewards and keeps each unweighted score so it can be logged as
  `reward/<name>`. Anything wrong in reward code (an exception, the wrong number of values, a value that
  is not a finite number) becomes one `RewardError` naming the function and the first bad sample.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridrl.config.schema import RewardConfig
from hybridrl.user_code import import_user_file, where

RewardFunction = Callable[..., Sequence[float]]


class RewardError(RuntimeError):
    """Reward code failed or returned something unusable; the message names the function and the sample."""


class RewardSpecError(ValueError):
    """A reward spec (`name` or `file.py:function`) cannot be resolved; the message says how to fix it."""


# ----------------------------------------------------------------------------------------------
# Built-in rewards


def exact_match(prompts: list[str], completions: list[str], *, answer_key: str = "answer",
                **columns: Any) -> list[float]:
    """1.0 where the stripped completion equals the stripped `answer_key` column, else 0.0."""
    answers = _column(columns, answer_key, "exact_match")
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]


# A number: optional sign and `$`, digits with strict thousands commas ("1,234") or none, optional decimals.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-−])?(?:\$\s?)?(?P<digits>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<decimals>\.\d+)?")


def extract_number(text: str) -> float | None:
    """The final numeric answer in `text`: after the last GSM8K `####`, else in the last `\\boxed{}`, else
    the last number anywhere. Commas, `$` and trailing `.0` are tolerated; None when there is no number."""
    if "####" in text:
        return _first_number(text.rsplit("####", 1)[1])
    boxed = _last_boxed(text)
    if boxed is not None:
        return _last_number(boxed)
    return _last_number(text)


def numeric_match(prompts: list[str], completions: list[str], *, answer_key: str = "answer",
                  rel_tol: float = 1e-6, **columns: Any) -> list[float]:
    """1.0 where `extract_number(completion)` equals the ground truth within `rel_tol`, else 0.0 (also when
    the completion holds no number). The ground truth may be a number or text such as a GSM8K solution."""
    rewards = []
    for i, (completion, answer) in enumerate(zip(completions, _column(columns, answer_key, "numeric_match"))):
        truth = float(answer) if isinstance(answer, numbers.Real) else extract_number(str(answer))
        if truth is None:
            raise ValueError(f"column {answer_key!r} of sample {i} holds no number ({answer!r}); "
                             "numeric_match needs a numeric ground truth.")
        predicted = extract_number(completion)
        rewards.append(float(predicted is not None and math.isclose(predicted, truth, rel_tol=rel_tol, abs_tol=1e-9)))
    return rewards


def format_reward(prompts: list[str], completions: list[str], *, pattern: str, fullmatch: bool = False,
                  **columns: Any) -> list[float]:
    """1.0 where the regex `pattern` is found in the completion (`re.search`), or matches all of it when
    `fullmatch` is true; else 0.0. `.` matches newlines too (re.DOTALL), as completions span lines."""
    regex = re.compile(pattern, re.DOTALL)
    match = regex.fullmatch if fullmatch else regex.search
    return [float(match(c) is not None) for c in completions]


def length_penalty(prompts: list[str], completions: list[str], *, target_length: int = 0, scale: float = 1000.0,
                   unit: str = "chars", **columns: Any) -> list[float]:
    """-max(0, length - target_length) / scale, where length counts characters (`unit="chars"`) or
    whitespace-separated words (`unit="words"`). The defaults give -len(completion)/1000."""
    if unit not in ("chars", "words"):
        raise ValueError(f"length_penalty unit must be 'chars' or 'words'; got {unit!r}.")
    lengths = [len(c) if unit == "chars" else len(c.split()) for c in completions]
    return [-max(0, n - target_length) / scale for n in lengths]


def env_reward(prompts: list[str], completions: list[str], *, env_reward: list[float | None],
               **columns: Any) -> list[float]:
    """Multi-turn episodes: the environment's own reward (its last non-None `StepResult.reward`). The reward of a
    run with an environment and no reward function configured."""
    missing = next((i for i, value in enumerate(env_reward) if value is None), None)
    if missing is not None:
        raise ValueError(f"the environment gave no reward for sample {missing} (every step returned reward=None); "
                         "return a reward from step, or configure reward.functions to score the episode.")
    return [float(value) for value in env_reward]


def called_tool(prompts: list[str], completions: list[str], *, tool_calls: list[list[dict]],
                **columns: Any) -> list[float]:
    """Multi-turn episodes: 1.0 where the episode called a tool at least once (a parsed call, whatever it
    returned), else 0.0. With weight 0 it scores nothing and is logged: `reward/called_tool` and
    `eval/reward/called_tool` are then the tool-call rate of the samples and of the held-out episodes."""
    return [float(any(not call.get("malformed") for call in calls or [])) for calls in tool_calls]


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "format": format_reward,
    "length_penalty": length_penalty,
    "env_reward": env_reward,
    "called_tool": called_tool,
}


def _column(columns: dict[str, Any], key: str, reward: str) -> list[Any]:
    if key not in columns:
        raise ValueError(f"{reward} needs the dataset column {key!r} but the columns are {sorted(columns)}; "
                       "add it to the data or pass answer_key=<column>.")
    return columns[key]


def _to_float(match: re.Match) -> float:
    value = float(match["digits"].replace(",", "") + (match["decimals"] or ""))
    return -value if match["sign"] else value


def _first_number(text: str) -> float | None:
    match = _NUMBER.search(text)
    return _to_float(match) if match else None


def _last_number(text: str) -> float | None:
    matches = list(_NUMBER.finditer(text))
    return _to_float(matches[-1]) if matches else None


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, with nested braces; None if there is none or it is unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None


# ----------------------------------------------------------------------------------------------
# Resolving a spec string


def load_reward_function(spec: str) -> RewardFunction:
    """A built-in name (a key of `BUILTIN_REWARDS`) or `path/to/file.py:function`, imported from its path."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise RewardSpecError(f"unknown reward {spec!r}; use a built-in ({', '.join(BUILTIN_REWARDS)}) "
                              "or path/to/file.py:function.")
    file, name = spec.rsplit(":", 1)
    module = import_user_file(file, "reward", RewardSpecError)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")]
        raise RewardSpecError(f"reward file {file!r} has no function {name!r} (functions in it: "
                              f"{', '.join(found) or 'none'}); define it or fix the name after ':'.")
    return fn


# ----------------------------------------------------------------------------------------------
# Reward model


class RewardModelScorer:
    """Scores `prompt + completion` text with a Hugging Face sequence-classification model and its own
    tokenizer: batched, without gradients, on `device`. The score is the logit of `label_index` (label 0 of
    a single-output reward model). Texts longer than `max_length` tokens keep their last tokens.

    With `use_chat_template` and a tokenizer that has a chat template, the pair is rendered as a user turn
    and an assistant turn, which is how most released reward models were trained; prompts should then be
    the raw (untemplated) prompt text."""

    __name__ = "reward_model"

    def __init__(self, model: str | torch.nn.Module, tokenizer: Any | None = None, *,
                 device: str | torch.device = "cpu", batch_size: int = 16, max_length: int = 2048,
                 label_index: int = 0, use_chat_template: bool = True,
                 dtype: torch.dtype | str = "auto", trust_remote_code: bool = False):
        if isinstance(model, str):
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
            model = AutoModelForSequenceClassification.from_pretrained(
                model, dtype=dtype, trust_remote_code=trust_remote_code)
        elif tokenizer is None:
            raise ValueError("RewardModelScorer got a built model without its tokenizer; pass tokenizer=<tokenizer>.")
        text_config = model.config.get_text_config()
        if not 0 <= label_index < model.config.num_labels:
            raise ValueError(f"label_index={label_index} is out of range for a reward model with "
                             f"{model.config.num_labels} labels.")
        if text_config.pad_token_id is None:
            # The model pools the last token that is not padding; it needs to know the padding id.
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            if pad is None:
                raise ValueError("the reward model defines no padding token and its tokenizer has neither a pad nor an "
                                 "eos token; set model.config.pad_token_id.")
            text_config.pad_token_id = pad
        self.pad_token_id: int = text_config.pad_token_id
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_length = max_length
        self.label_index = label_index
        self.use_chat_template = use_chat_template and bool(getattr(tokenizer, "chat_template", None))

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        ids = [self._encode(p, c) for p, c in zip(prompts, completions)]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch: less padding
        scores = [0.0] * len(ids)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            for i, score in zip(chunk, self._score_batch([ids[i] for i in chunk])):
                scores[i] = score
        return scores

    def _encode(self, prompt: str, completion: str) -> list[int]:
        if self.use_chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template holds them
        else:
            ids = self.tokenizer(prompt + completion)["input_ids"]
        return ids[-self.max_length:]

    @torch.no_grad()
    def _score_batch(self, ids: list[list[int]]) -> list[float]:
        # Right padding: causal attention keeps every real token's state independent of the padding.
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((len(ids), width), dtype=torch.long)  # (B, T)
        for row, x in enumerate(ids):
            input_ids[row, :len(x)] = torch.tensor(x, dtype=torch.long)
            attention_mask[row, :len(x)] = 1
        logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)).logits
        return logits[:, self.label_index].float().tolist()  # (B, num_labels) -> (B,)


# ----------------------------------------------------------------------------------------------
# Weighted sum with per-function scores


@dataclass
class WeightedReward:
    name: str
    """Log name: the metric is `reward/<name>`."""
    fn: RewardFunction
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to `fn` on every call; they win over dataset columns of the same name."""


def columns_read(reward: WeightedReward) -> set[str]:
    """The data columns `reward` cannot score without: its parameters after (prompts, completions) that have no
    default and are not given in its kwargs, and the column an `answer_key` parameter names (the built-ins)."""
    try:
        parameters = list(inspect.signature(reward.fn).parameters.values())[2:]
    except (TypeError, ValueError):  # a callable without an inspectable signature: nothing to check
        return set()
    needed = {p.name for p in parameters if p.default is inspect.Parameter.empty and p.name not in reward.kwargs
              and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    for p in parameters:
        if p.name == "answer_key":
            needed.add(reward.kwargs.get("answer_key", p.default))
    return needed


class RewardComposer:
    """The weighted sum of reward functions, keeping each function's unweighted scores for logging."""

    def check_columns(self, columns: Sequence[str], source: str) -> None:
        """Refuse, before any model loads, data that lacks a column a reward function reads (all at once)."""
        missing = [f"reward function {r.name!r} reads column {column!r}" for r in self.rewards
                   for column in sorted(columns_read(r)) if column not in columns]
        if missing:
            raise RewardSpecError(f"{'; '.join(missing)}, which {source} does not have (its columns: "
                                  f"{', '.join(columns)}); add the column, or name the right one in the reward's "
                                  "kwargs (e.g. answer_key: solution).")

    def __init__(self, rewards: Sequence[WeightedReward | tuple[str, RewardFunction, float]]):
        if not rewards:
            raise ValueError("no reward functions were given; set reward.functions (e.g. [{fn: numeric_match}]), "
                             "reward.reward_model or reward.judge_model.")
        self.rewards: list[WeightedReward] = []
        used: set[str] = set()
        for reward in rewards:
            if not isinstance(reward, WeightedReward):
                reward = WeightedReward(*reward)
            name, suffix = reward.name, 2
            while name in used:  # the same function twice (e.g. two formats) is logged as name, name_2, ...
                name, suffix = f"{reward.name}_{suffix}", suffix + 1
            used.add(name)
            self.rewards.append(WeightedReward(name, reward.fn, reward.weight, dict(reward.kwargs)))

    @classmethod
    def from_config(cls, config: RewardConfig, *, device: str | torch.device = "cpu",
                    extra: Sequence[WeightedReward] = ()) -> RewardComposer:
        """The configured functions and reward model, then `extra` (rewards built above this layer: the judge)."""
        rewards = []
        for i, spec in enumerate(config.functions):
            try:
                fn = load_reward_function(spec.fn)
            except RewardSpecError as error:
                # Chain only what the spec error chained (a user file's import error), not the error twice.
                raise RewardSpecError(f"reward.functions[{i}].fn: {error}") from error.__cause__
            name = spec.fn if spec.fn in BUILTIN_REWARDS else getattr(fn, "__name__", spec.fn.rsplit(":", 1)[1])
            rewards.append(WeightedReward(name, fn, spec.weight, spec.kwargs))
        if config.reward_model:
            scorer = RewardModelScorer(config.reward_model, device=device)
            rewards.append(WeightedReward("reward_model", scorer, config.reward_model_weight))
        return cls(rewards + list(extra))

    def last_metrics(self) -> dict[str, float]:
        """What reward functions report about their last call (a judge's parse failures and time): the
        `last_metrics` dict of each function that has one."""
        return {key: value for r in self.rewards for key, value in (getattr(r.fn, "last_metrics", None) or {}).items()}

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list] | None = None,
              first_index: int = 0) -> tuple[torch.Tensor, dict[str, list[float]]]:
        """Total weighted reward (B,) float32, and each function's unweighted scores keyed by its name.
        `first_index`: the batch position of the first completion, for sample numbers in error messages
        (a process scoring its share of a larger batch)."""
        columns = columns or {}
        size = len(completions)
        if len(prompts) != size:
            raise ValueError(f"got {len(prompts)} prompts for {size} completions; pass one prompt per completion.")
        for key, values in columns.items():
            if len(values) != size:
                raise ValueError(f"column {key!r} has {len(values)} values for {size} completions; "
                                 "repeat each row once per sample.")
        per_function = {r.name: _call_checked(r, prompts, completions, columns, first_index) for r in self.rewards}
        total = [sum(r.weight * per_function[r.name][i] for r in self.rewards) for i in range(size)]
        return torch.tensor(total, dtype=torch.float32), per_function


def _call_checked(reward: WeightedReward, prompts: list[str], completions: list[str],
                  columns: dict[str, list], first_index: int = 0) -> list[float]:
    """Call one reward on the batch; anything wrong becomes a RewardError naming it and the sample (numbered
    from `first_index`)."""
    size = len(completions)
    call = lambda p, c, cols: reward.fn(p, c, **{**cols, **reward.kwargs})  # noqa: E731
    try:
        values = call(prompts, completions, columns)
    except Exception as error:
        index, sample_error = _first_failing_sample(call, prompts, completions, columns)
        if index is None:
            raise RewardError(f"reward function {reward.name!r} raised {type(error).__name__}: {error}{where(error)} "
                              f"while scoring a batch of {size}, though each sample alone scored fine.") from error
        raise RewardError(f"reward function {reward.name!r} raised {type(sample_error).__name__}: {sample_error}"
                          f"{where(sample_error)} on sample {first_index + index} (the first failing one of a batch "
                          f"of {size}); fix the function or that sample's data.") from error
    if hasattr(values, "tolist"):  # a tensor or an array
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise RewardError(f"reward function {reward.name!r} returned {type(values).__name__} for a batch of "
                          f"{size}; it must return a list of {size} floats.")
    if len(values) != size:
        raise RewardError(f"reward function {reward.name!r} returned {len(values)} values for a batch of {size} "
                          "completions; it must return one float per completion.")
    for i, value in enumerate(values):
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"reward function {reward.name!r} returned {value!r} for sample {first_index + i}; "
                              "every reward must be a finite number.")
    return [float(v) for v in values]


def _first_failing_sample(call: Callable, prompts: list[str], completions: list[str],
                          columns: dict[str, list]) -> tuple[int | None, Exception | None]:
    # Only runs after a failure, so re-scoring sample by sample costs nothing on the normal path.
    for i in range(len(completions)):
        try:
            call(prompts[i:i + 1], completions[i:i + 1], {k: v[i:i + 1] for k, v in columns.items()})
        except Exception as error:
            return i, error
    return None, None
