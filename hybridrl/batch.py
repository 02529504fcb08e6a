"""The rollout batch: generated sequences as padded tensors, plus everything computed about them.

Layout: prompts left-padded to P columns, responses right-padded to R columns, so response token t of
every sequence sits at column P + t and every per-token quantity (log-probs, advantages, masks) is a
(B, R) tensor aligned with `response_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

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
    texts: list[str] = field(default_factory=list)  # decoded responses, for rewards and logs

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        """Rows `index` of every tensor field (mini- and micro-batches)."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[index.to(value.device)]
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


def build_rollout_batch(prompts: list[list[int]], generations: list[Generation], pad_token_id: int,
                        max_new_tokens: int) -> RolloutBatch:
    """Pad prompts left and responses right into one tensor batch (on CPU)."""
    num = len(generations)
    prompt_len = max(len(prompts[g.prompt_index]) for g in generations)
    response_len = max(1, max(len(g.token_ids) for g in generations))
    input_ids = torch.full((num, prompt_len + response_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((num, prompt_len + response_len), dtype=torch.long)
    sampler_logp = torch.zeros((num, response_len), dtype=torch.float32)
    for row, gen in enumerate(generations):
        prompt = prompts[gen.prompt_index]
        input_ids[row, prompt_len - len(prompt):prompt_len] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, prompt_len - len(prompt):prompt_len] = 1
        count = len(gen.token_ids)
        if count:
            input_ids[row, prompt_len:prompt_len + count] = torch.tensor(gen.token_ids, dtype=torch.long)
            attention_mask[row, prompt_len:prompt_len + count] = 1
            sampler_logp[row, :count] = torch.tensor(gen.logprobs, dtype=torch.float32)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        response_mask=attention_mask[:, prompt_len:].float(), sampler_logp=sampler_logp,
        truncated=torch.tensor([g.finish_reason == "length" for g in generations]),
        prompt_index=torch.tensor([g.prompt_index for g in generations]),
    )
