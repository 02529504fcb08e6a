"""The rollout batch: generated sequences as padded tensors, plus everything computed about them.

Layout: prompts left-padded to P columns, responses right-padded to R columns, so response token t of
every sequence sits at column P + t and every per-token quantity (log-probs, advantages, masks) is a
(B, R) tensor aligned with `response_mask`.

The batch carries the sampling settings it was generated with (`sampling`): the log-prob passes and the
update must score tokens at the temperature that sampled them, so they read it here rather than from the
config, and an evaluation batch (greedy) cannot be scored at the training temperature by mistake.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from hybridrl.devices import host_to_device
from hybridrl.rollout.base import Generation, SamplingParams, as_list


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # (B, P + R)
    attention_mask: torch.Tensor  # (B, P + R)
    position_ids: torch.Tensor  # (B, P + R)
    response_mask: torch.Tensor  # (B, R) float, 1 on real response tokens
    sampler_logp: torch.Tensor  # (B, R) log-probs reported by the rollout backend
    truncated: torch.Tensor  # (B,) bool, response hit max_new_tokens
    prompt_index: torch.Tensor  # (B,) which prompt of the step each sequence answers
    scores: torch.Tensor | None = None  # (B,) total reward
    baseline_scores: torch.Tensor | None = None  # (B,) ReMax: the score of the greedy response to the row's prompt
    old_logp: torch.Tensor | None = None  # (B, R)
    ref_logp: torch.Tensor | None = None  # (B, R)
    old_values: torch.Tensor | None = None  # (B, R)
    advantages: torch.Tensor | None = None  # (B, R)
    returns: torch.Tensor | None = None  # (B, R)
    loss_mask: torch.Tensor | None = None  # (B, R) tokens the policy loss counts; None: response_mask
    texts: list[str] = field(default_factory=list)  # decoded responses, for rewards and logs
    sampling: SamplingParams = field(default_factory=SamplingParams)  # how the responses were sampled
    columns: dict[str, list] | None = None  # per-row columns for rewards (episodes: `episodes.py`); read by scoring

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        """Rows `index` of every tensor field (mini- and micro-batches)."""
        values, moved = {}, {}  # the index copied once per device, not once per field
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                if value.device not in moved:
                    moved[value.device] = host_to_device(index, value.device)
                value = value[moved[value.device]]
            elif f.name == "texts" and value:
                value = [value[i] for i in index.tolist()]
            elif f.name == "columns" and value:
                value = {key: [column[i] for i in index.tolist()] for key, column in value.items()}
            values[f.name] = value
        return RolloutBatch(**values)

    def to(self, device: torch.device | str) -> "RolloutBatch":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                values[key] = value.to(device)
        return RolloutBatch(**values)


def decode_responses(tokenizer, generations: list[Generation]) -> list[str]:
    """The responses as text (special tokens dropped), for rewards and logs.

    A fast tokenizer decodes the whole batch in its Rust backend, in parallel (transformers' own
    `batch_decode` loops in Python); tokenizers whose decode adds a Python clean-up step, and slow ones,
    go through `batch_decode` so the text is the same."""
    # Lists for the tokenizer, made here and not kept: a generation holding numpy rows keeps them (the gather
    # across processes pickles arrays faster than lists, and the batch builder reads them as they are).
    token_lists = [as_list(g.token_values) for g in generations]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode_batch(token_lists, skip_special_tokens=True)
    return tokenizer.batch_decode(token_lists, skip_special_tokens=True)


def _flatten(rows: list, dtype, total: int) -> np.ndarray:
    """Rows of lists or of numpy arrays (the built-in engine's) end to end in one array."""
    if rows and all(isinstance(row, np.ndarray) for row in rows):
        return np.concatenate(rows).astype(dtype, copy=False)
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=total)


def build_rollout_batch(prompts: list[list[int]], generations: list[Generation], pad_token_id: int,
                        max_new_tokens: int, sampling: SamplingParams | None = None) -> RolloutBatch:
    """Pad prompts left and responses right into one tensor batch (on CPU); `sampling` is what generated
    them (default: `SamplingParams(max_new_tokens)`, temperature 1).

    All responses' tokens and log-probs are read into numpy in one pass each and scattered to their rows with
    one indexed store (not a slice store per row), and each distinct prompt is padded once and gathered to its
    samples' rows (`benchmarks/host_batch.py` times it); what remains is mostly reading the Python lists."""
    num = len(generations)
    prompt_lens = np.array([len(prompts[g.prompt_index]) for g in generations], dtype=np.int64)
    response_lens = np.array([len(g.token_values) for g in generations], dtype=np.int64)
    prompt_len, response_len = int(prompt_lens.max()), max(1, int(response_lens.max()))
    ids = np.full((num, prompt_len + response_len), pad_token_id, dtype=np.int64)
    logps = np.zeros((num, response_len), dtype=np.float32)
    used = sorted({g.prompt_index for g in generations})
    padded_prompts = np.full((len(used), prompt_len), pad_token_id, dtype=np.int64)
    for row, index in enumerate(used):
        if prompts[index]:
            padded_prompts[row, prompt_len - len(prompts[index]):] = prompts[index]
    row_of_prompt = {index: row for row, index in enumerate(used)}
    ids[:, :prompt_len] = padded_prompts[[row_of_prompt[g.prompt_index] for g in generations]]
    total = int(response_lens.sum())
    rows = np.repeat(np.arange(num), response_lens)
    columns = np.arange(total) - np.repeat(np.cumsum(response_lens) - response_lens, response_lens)
    ids[rows, prompt_len + columns] = _flatten([g.token_values for g in generations], np.int64, total)
    logps[rows, columns] = _flatten([g.logprob_values for g in generations], np.float32, total)
    input_ids, sampler_logp = torch.from_numpy(ids), torch.from_numpy(logps)
    first = torch.from_numpy(prompt_len - prompt_lens)[:, None]
    end = torch.from_numpy(prompt_len + response_lens)[:, None]
    column = torch.arange(prompt_len + response_len)
    attention_mask = ((column >= first) & (column < end)).long()
    position_ids = torch.minimum((column - first).clamp(min=0), end - first - 1)  # padding repeats the edge
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        response_mask=attention_mask[:, prompt_len:].float(), sampler_logp=sampler_logp,
        truncated=torch.tensor([g.finish_reason == "length" for g in generations]),
        prompt_index=torch.tensor([g.prompt_index for g in generations]),
        sampling=sampling if sampling is not None else SamplingParams(max_new_tokens=max_new_tokens),
    )
