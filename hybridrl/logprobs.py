"""Per-token log-probabilities (and entropy) of response tokens under a causal LM.

Batches are laid out with prompts left-padded to a common length P and responses right-padded to R
(see `batch.py`), so every response starts at column P and only the last R+1 positions need logits
(`logits_to_keep`). The log-softmax is taken in float32 over chunks of positions so the full
(B, R, vocab) float32 tensor never exists at once.
"""

from __future__ import annotations

import torch
from torch import nn


def response_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor, response_length: int, temperature: float = 1.0,
                      with_entropy: bool = False, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token t | prefix) for the last `response_length` columns: (B, R) float32, and entropy."""
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=response_length + 1, use_cache=False)
    logits = outputs.logits[:, :-1]  # (B, R, V): position t predicts response token t
    targets = input_ids[:, -response_length:]  # (B, R)
    scale = 1.0 / temperature if temperature > 0 else 1.0
    logps, entropies = [], []
    for start in range(0, response_length, chunk_size):
        chunk = logits[:, start:start + chunk_size].float() * scale  # (B, C, V)
        log_norm = torch.logsumexp(chunk, dim=-1)  # (B, C)
        picked = chunk.gather(-1, targets[:, start:start + chunk_size, None]).squeeze(-1)
        logps.append(picked - log_norm)
        if with_entropy:
            probs = torch.softmax(chunk, dim=-1)
            entropies.append(log_norm - (probs * chunk).sum(-1))
    logp = torch.cat(logps, dim=1)
    return logp, (torch.cat(entropies, dim=1) if with_entropy else None)
