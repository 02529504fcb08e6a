"""The rollout batch: generated sequences as padded tensors, plus everything computed about them.

Layout: prompts left-padded to P columns, responses right-padded to R columns, so response token t of
every sequence sits at column P + t and every per-token quantity (log-probs, advantages, masks) is a
(B, R) tensor aligned with `response_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from hybridrl.packing import host_to_device
from hybridrl.rollout.base import Generation


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
    old_logp: torch.Tensor | None = None  # (B, R)
    ref_logp: torch.Tensor | None = None  # (B, R)
    old_values: torch.Tensor | None = None  # (B, R)
    advantages: torch.Tensor | None = None  # (B, R)
    returns: torch.Tensor | None = None  # (B, R)
    loss_mask: torch.Tensor | None = None  # (B, R) tokens the policy loss counts; None: response_mask
    texts: list[str] = field(default_factory=list)  # decoded responses, for rewards and logs

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
    `batch_decode` loops in Python, ~0.2 s for 512 x 256 tokens); tokenizers whose decode adds a
    Python clean-up step, and slow ones, go through `batch_decode` so the text is the same."""
    token_lists = [g.token_ids for g in generations]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode_batch(token_lists, skip_special_tokens=True)
    return tokenizer.batch_decode(token_lists, skip_special_tokens=True)


def build_rollout_batch(prompts: list[list[int]], generations: list[Generation], pad_token_id: int,
                        max_new_tokens: int) -> RolloutBatch:
    """Pad prompts left and responses right into one tensor batch (on CPU).

    Rows are written into preallocated numpy arrays (a slice assignment per prompt and response), and the
    mask comes from the lengths: one `torch.tensor` per row cost more than the GPU's work on 512 sequences,
    and padding Python lists first was slower still."""
    num = len(generations)
    prompt_len = max(len(prompts[g.prompt_index]) for g in generations)
    response_len = max(1, max(len(g.token_ids) for g in generations))
    ids = np.full((num, prompt_len + response_len), pad_token_id, dtype=np.int64)
    logps = np.zeros((num, response_len), dtype=np.float32)
    for row, gen in enumerate(generations):
        prompt, generated = prompts[gen.prompt_index], len(gen.token_ids)
        ids[row, prompt_len - len(prompt):prompt_len] = prompt
        ids[row, prompt_len:prompt_len + generated] = gen.token_ids
        logps[row, :generated] = gen.logprobs
    input_ids, sampler_logp = torch.from_numpy(ids), torch.from_numpy(logps)
    first = torch.tensor([prompt_len - len(prompts[g.prompt_index]) for g in generations])[:, None]
    end = torch.tensor([prompt_len + len(g.token_ids) for g in generations])[:, None]
    column = torch.arange(prompt_len + response_len)
    attention_mask = ((column >= first) & (column < end)).long()
    position_ids = torch.minimum((column - first).clamp(min=0), end - first - 1)  # padding repeats the edge
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        response_mask=attention_mask[:, prompt_len:].float(), sampler_logp=sampler_logp,
        truncated=torch.tensor([g.finish_reason == "length" for g in generations]),
        prompt_index=torch.tensor([g.prompt_index for g in generations]),
    )
