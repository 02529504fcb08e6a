"""A generative judge reward: a causal LM reads a prompt built from a template and its answer becomes the score.

The template holds `{response}` and may hold `{prompt}` and `{reference}` (the data column `reference_key`).
Three ways to read the judge's answer (`parse`):
- `number`: greedy generation, the final number in the judge's text (`rewards.extract_number`).
- `scale`: greedy generation, the last integer 1..10 in the text ("7", "7/10"), mapped to (s - 1) / 9 in [0, 1].
- `yes_no`: no generation; one forward pass, and the score is P(yes) / (P(yes) + P(no)) from the judge's
  next-token log-probs, P(word) being the mass of the word's first token with and without a leading space.
  It never fails to parse.

Choices:
- It sits above rollout (it generates with a rollout backend) and below training; rewards.py does not import it:
  `training/components.py` builds it from `reward.judge_*` and hands the `RewardComposer` a plain callable.
- Generation is greedy through the built-in engine where it supports the judge (`BuiltinBackend.supports`), else
  the Hugging Face backend; the judge lives on the reward device (the actor's unless `trainer.device_mesh` places
  `reward` elsewhere), so by default it is colocated with the actor; `offload` (`reward.judge_offload`) keeps its
  weights in host memory between calls (`HostOffloadedWeights`, as `model.reference_offload` does for the reference).
- A text the parser cannot read scores `failure_score` and is counted: each call leaves `last_metrics`
  (`reward/judge_parse_failures`, the count in that call, and `timing/judge_s`), which the trainer logs.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridrl.config.checks import judge_template_problem
from hybridrl.config.schema import RewardConfig
from hybridrl.models.loading import HostOffloadedWeights, load_hf_model
from hybridrl.rewards import extract_number
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.hf import HFBackend

DEFAULT_TEMPLATE = ("Question: {prompt}\nReference answer: {reference}\nResponse: {response}\n"
                    "Is the response correct? Answer Yes or No.\nAnswer:")


def parse_number(text: str) -> float | None:
    """The final number in the judge's text (after `####`, in the last `\\boxed{}`, else the last one)."""
    return extract_number(text)


# "7", "7/10", "7 out of 10": an integer 1..10 not inside a longer number; the "/10" is the scale, not a score.
_SCALE = re.compile(r"(?<![\d.])(10|[1-9])(?![\d.])(?:\s*(?:/|out of)\s*10(?![\d.]))?")


def parse_scale(text: str) -> float | None:
    """The last integer 1..10 in the text as (s - 1) / 9, so 1 -> 0.0 and 10 -> 1.0; None when there is none."""
    matches = _SCALE.findall(text)
    return (int(matches[-1]) - 1) / 9 if matches else None


def yes_no_score(logprob_yes: float, logprob_no: float) -> float:
    """P(yes) / (P(yes) + P(no)) from the two answer tokens' log-probs: the sigmoid of their difference."""
    difference = logprob_yes - logprob_no
    if difference >= 0:  # each branch exponentiates a non-positive number: no overflow at extreme log-probs
        return 1.0 / (1.0 + math.exp(-difference))
    return math.exp(difference) / (1.0 + math.exp(difference))


TEXT_PARSERS: dict[str, Callable[[str], float | None]] = {"number": parse_number, "scale": parse_scale}
PARSE_MODES = (*TEXT_PARSERS, "yes_no")


class JudgeReward:
    """Reward function `(prompts, completions, **columns) -> scores` asking the causal LM `model` (with its
    `tokenizer`) to judge each completion. See the module docstring for the parse modes."""

    __name__ = "judge"

    def __init__(self, model: torch.nn.Module, tokenizer: Any, template: str = DEFAULT_TEMPLATE, *,
                 parse: str = "yes_no", failure_score: float = 0.0, max_new_tokens: int = 32,
                 reference_key: str = "answer", answer_words: tuple[str, str] = ("Yes", "No"),
                 backend: str = "auto", use_chat_template: bool = False, batch_size: int = 64,
                 offload: bool = False):
        if (problem := judge_template_problem(template)) is not None:
            raise ValueError(problem)
        if parse not in PARSE_MODES:
            raise ValueError(f"judge parse mode must be one of {', '.join(PARSE_MODES)}; got {parse!r}.")
        if backend not in ("auto", "builtin", "hf"):
            raise ValueError(f"judge backend must be auto, builtin or hf; got {backend!r}.")
        self.model, self.tokenizer, self.template = model.eval(), tokenizer, template
        self.parse, self.failure_score, self.max_new_tokens = parse, failure_score, max_new_tokens
        self.reference_key, self.batch_size = reference_key, batch_size
        self.use_chat_template = use_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.answer_ids = self._answer_tokens(answer_words)
        self.backend = None
        if parse in TEXT_PARSERS:
            builtin = backend == "builtin" or (backend == "auto" and BuiltinBackend.supports(model)[0])
            self.backend = BuiltinBackend(model, tokenizer, kv_cache_memory=0.2) if builtin else \
                HFBackend(model, tokenizer)
        self.last_metrics: dict[str, float] = {}
        # Between calls the judge's weights wait in host memory (`reward.judge_offload`), leaving the device to the
        # actor's update and rollout; each call copies them back first.
        self.offload = HostOffloadedWeights(model, next(model.parameters()).device) if offload else None
        if "{reference}" in template:  # the composer's column check then sees the column this judge reads
            parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                          for name in ("prompts", "completions")]
            parameters += [inspect.Parameter(reference_key, inspect.Parameter.KEYWORD_ONLY),
                           inspect.Parameter("columns", inspect.Parameter.VAR_KEYWORD)]
            self.__signature__ = inspect.Signature(parameters)

    @classmethod
    def from_config(cls, config: RewardConfig, device: str | torch.device = "cpu", seed: int = 0) -> JudgeReward:
        """The judge of `reward.judge_*`, loaded on `device` (the reward device)."""
        model, tokenizer = load_hf_model(config.judge_model, device=device, seed=seed)
        return cls(model, tokenizer, config.judge_template, parse=config.judge_parse,
                   failure_score=config.judge_parse_failure_score, max_new_tokens=config.judge_max_new_tokens,
                   reference_key=config.judge_reference_key, answer_words=tuple(config.judge_answer_words),
                   use_chat_template=config.judge_use_chat_template, offload=config.judge_offload)

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        start = time.perf_counter()
        if "{reference}" in self.template and self.reference_key not in columns:
            raise ValueError(f"the judge template holds {{reference}} but the data has no column "
                             f"{self.reference_key!r} (columns: {sorted(columns)}); add it or set "
                             "reward.judge_reference_key.")
        references = columns.get(self.reference_key, [""] * len(completions))
        ids = [self._encode(self.render(p, c, str(r))) for p, c, r in zip(prompts, completions, references)]
        with self.offload.on_device() if self.offload else contextlib.nullcontext():
            if self.parse == "yes_no":
                scores, failures = self._yes_no(ids), 0
            else:
                scores, failures = self._generate_and_parse(ids)
        self.last_metrics = {"reward/judge_parse_failures": float(failures),
                             "timing/judge_s": time.perf_counter() - start}
        return scores

    def render(self, prompt: str, response: str, reference: str) -> str:
        """The judge's prompt text for one sample (the template filled in)."""
        return self.template.format(prompt=prompt, response=response, reference=reference)

    def _encode(self, text: str) -> list[int]:
        if self.use_chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(text)["input_ids"]

    def _answer_tokens(self, words: tuple[str, str]) -> tuple[list[int], list[int]]:
        """For each answer word, the first tokens of the word and of the word after a space ("Yes" and " Yes" are
        distinct tokens of BPE vocabularies, and which one follows "Answer:" depends on the judge); a token that
        could begin either word (a lone space in a character vocabulary) is left out of both."""
        starts = []
        for word in words:
            firsts = {ids[0] for ids in (self.tokenizer.encode(text, add_special_tokens=False)
                                         for text in (word, " " + word.lstrip())) if ids}
            if not word.strip() or not firsts:
                raise ValueError(f"the judge's answer word {word!r} encodes to no token; give a non-empty word.")
            starts.append(firsts)
        yes, no = starts[0] - starts[1], starts[1] - starts[0]
        if not yes or not no:
            raise ValueError(f"the judge's answer words {words} begin with the same tokens; choose words whose "
                             "first tokens differ (e.g. Yes and No).")
        return sorted(yes), sorted(no)

    def _generate_and_parse(self, ids: list[list[int]]) -> tuple[list[float], int]:
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, n=1)
        generations = self.backend.generate(ids, params)
        texts = self.tokenizer.batch_decode([g.token_ids for g in generations], skip_special_tokens=True)
        parsed = [TEXT_PARSERS[self.parse](text) for text in texts]
        scores = [self.failure_score if value is None else float(value) for value in parsed]
        return scores, sum(value is None for value in parsed)

    @torch.no_grad()
    def _yes_no(self, ids: list[list[int]]) -> list[float]:
        device = next(self.model.parameters()).device
        scores = []
        for start in range(0, len(ids), self.batch_size):
            chunk = ids[start:start + self.batch_size]
            # Right padding: under causal attention each row's last real token ignores the padding after it.
            width = max(len(x) for x in chunk)
            input_ids = torch.zeros((len(chunk), width), dtype=torch.long)  # (B, T)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)  # (B, T)
            for row, x in enumerate(chunk):
                input_ids[row, :len(x)] = torch.tensor(x, dtype=torch.long)
                attention_mask[row, :len(x)] = 1
            # The head runs on each row's last position only: full (B, T, V) logits of a 150k vocabulary would cost
            # gigabytes for a batch of long prompts.
            hidden = self.model.get_decoder()(input_ids=input_ids.to(device),
                                              attention_mask=attention_mask.to(device)).last_hidden_state  # (B, T, H)
            last = hidden[torch.arange(len(chunk)), attention_mask.sum(1).to(device) - 1]  # (B, H)
            logits = self.model.get_output_embeddings()(last).float()  # (B, V)
            if cap := getattr(self.model.config, "final_logit_softcapping", None):  # Gemma 2 caps its logits
                logits = torch.tanh(logits / cap) * cap
            logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
            yes, no = (logprobs[:, ids].logsumexp(dim=-1).tolist() for ids in self.answer_ids)  # (B,) each
            scores += [yes_no_score(y, n) for y, n in zip(yes, no)]
        return scores
