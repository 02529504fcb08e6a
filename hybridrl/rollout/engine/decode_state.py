"""The engine's per-slot decode state and the sampling step that updates it in place.

`DecodeState` holds one row per KV-cache slot (last token, lengths, finished flags, the tokens and log-probs
so far, and the uniforms each sequence was given at admission); a decode step reads and writes the first
`batch` rows on the device, so a captured CUDA graph replays it without the host. `sample_and_record` is
that step's sampling and bookkeeping, compiled into a few kernels on GPU (`compiled_sample_and_record`).
"""

from __future__ import annotations

import torch

from hybridrl.devices import host_to_device
from hybridrl.rollout.engine.sampling import SamplerSettings, sample


class DecodeState:
    """Per-slot device tensors; a decode step reads and updates the first `batch` rows in place."""

    def __init__(self, num_slots: int, max_new_tokens: int, stop_ids: list[int], device) -> None:
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.last_token = zeros(num_slots)
        self.prompt_len = zeros(num_slots)
        self.prompt_entry = zeros(num_slots)  # prefix-shared layout: the slot's prompt-cache entry
        self.gen_len = torch.ones(num_slots, dtype=torch.long, device=device)  # free slots sit at position 0
        self.done = torch.ones(num_slots, dtype=torch.bool, device=device)
        self.out_tokens = zeros(num_slots, max_new_tokens)
        self.out_logprobs = zeros(num_slots, max_new_tokens, dtype=torch.float32)
        # One uniform per (slot, response position), drawn when a sequence is admitted: a decode step reads its
        # own from the table, so no random draw (a launch and a gap after it) sits between graph replays.
        self.uniform_table = zeros(num_slots, max_new_tokens, dtype=torch.float32)
        self.stop_ids = host_to_device(torch.tensor(stop_ids or [-1], dtype=torch.long), device)
        self.max_new_tokens = max_new_tokens

    def reset(self) -> None:
        """Back to the state of a new `DecodeState`, in place (a kept run's graphs read these very tensors)."""
        for tensor in (self.last_token, self.prompt_len, self.prompt_entry, self.out_tokens, self.out_logprobs,
                       self.uniform_table):
            tensor.zero_()
        self.gen_len.fill_(1)
        self.done.fill_(True)

    def per_slot(self) -> list[torch.Tensor]:
        return [self.last_token, self.prompt_len, self.prompt_entry, self.gen_len, self.done, self.out_tokens,
                self.out_logprobs, self.uniform_table]

    def free(self, index: torch.Tensor) -> None:
        """Park the freed slots `index` (on the device) at position 0: a stale position could lie past a later,
        shorter key bucket. (prompt_len 0 also makes a freed slot read no prompt keys, so its stale entry index is
        harmless.)"""
        # index_fill_, not `tensor[index] = value`: a Python scalar assigned through a tensor index is first
        # made a CPU tensor and copied over from pageable memory, which synchronizes the stream.
        self.done.index_fill_(0, index, True)
        self.prompt_len.index_fill_(0, index, 0)
        self.gen_len.index_fill_(0, index, 1)

    def is_stop(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens[:, None] == self.stop_ids[None, :]).any(-1)


def sample_and_record(logits: torch.Tensor, settings: SamplerSettings, uniform_table: torch.Tensor, done: torch.Tensor,
                      gen_len: torch.Tensor, last_token: torch.Tensor, out_tokens: torch.Tensor,
                      out_logprobs: torch.Tensor, stop_ids: torch.Tensor, max_new_tokens: int) -> None:
    """Sample one token per slot and record it in the per-slot state (rows 0..B-1, updated in place);
    finished slots keep their state. One function so that `torch.compile` makes the sampler and this
    bookkeeping a few kernels: a decode step is bound by its kernel count, not by their work."""
    column = gen_len.clamp(max=max_new_tokens - 1)  # the response position this step draws
    tokens, logprobs = sample(logits, settings, uniform_table.gather(1, column[:, None])[:, 0])
    live = ~done
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    out_tokens[rows, column] = torch.where(live, tokens, out_tokens[rows, column])
    out_logprobs[rows, column] = torch.where(live, logprobs, out_logprobs[rows, column])
    last_token.copy_(torch.where(live, tokens, last_token))
    new_len = gen_len + live.long()
    gen_len.copy_(new_len)
    stopped = (tokens[:, None] == stop_ids[None, :]).any(-1)
    done |= live & (stopped | (new_len >= max_new_tokens))


def compiled_sample_and_record():
    """`sample_and_record` under `torch.compile`, the batch dimension dynamic (one compilation per setting)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # see llama_forward
    compiled = torch.compile(sample_and_record, fullgraph=True)

    def call(logits, settings, uniform_table, *state_and_limits):
        for tensor in (logits, uniform_table) + state_and_limits[:5]:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return compiled(logits, settings, uniform_table, *state_and_limits)

    return call
