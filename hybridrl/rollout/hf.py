"""Rollout through Hugging Face `generate`: slow, but covers every architecture transformers has.

Prompts are left-padded into one batch; `num_return_sequences=n` keeps outputs prompt-major. The
sampler's log-probs are recomputed from the raw logits that `generate` returns
(log_softmax(logits / T), before any top-p/top-k filtering), matching `base.Generation`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridrl.envs.base import EnvironmentSession
from hybridrl.envs.episode import Episode
from hybridrl.envs.rendering import ObservationRenderer
from hybridrl.rollout.base import Generation, SamplingParams
from hybridrl.rollout.multiturn import EpisodeBudget, generate_episodes_reference


class HFBackend:
    def __init__(self, model: nn.Module, tokenizer: Any, logits_memory_gib: float = 4.0):
        self.model = model
        self.tokenizer = tokenizer
        self.logits_memory_gib = logits_memory_gib
        """`generate` keeps every step's logits until it returns; sequences per call are capped to fit this."""
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        logits_bytes = vocab * params.max_new_tokens * 2  # per sequence, bf16/fp16 or half of fp32
        per_call = max(1, min(1024, int(self.logits_memory_gib * 2**30 / logits_bytes)) // params.n)
        outputs: list[Generation] = []
        for start in range(0, len(prompts), per_call):
            outputs += self._generate_chunk(prompts[start:start + per_call], params, offset=start)
        return outputs

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, offset: int) -> list[Generation]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        greedy = params.temperature == 0
        # `generate` refuses num_return_sequences > 1 when greedy: repeat the prompts instead (same order)
        rows = [prompt for prompt in prompts for _ in range(params.n if greedy else 1)]
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(rows):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        stop_ids = sorted(self.eos_ids | set(params.stop_token_ids))
        was_training = self.model.training
        self.model.eval()
        # Layers compiled for training (`model.compile`) would recompile here at every new KV length and for each
        # layer's cache until dynamo's limit, then run eagerly anyway: generate runs them eagerly from the start.
        with torch.compiler.set_stance("force_eager"):
            out = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                do_sample=not greedy, temperature=None if greedy else params.temperature,
                top_p=None if greedy else params.top_p, top_k=None if greedy else (params.top_k or None),
                min_p=None if greedy or not params.min_p else params.min_p,
                max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens if params.ignore_eos else None,
                num_return_sequences=1 if greedy else params.n, eos_token_id=stop_ids, pad_token_id=self.pad_id,
                stop_strings=params.stop_strings or None, tokenizer=self.tokenizer if params.stop_strings else None,
                return_dict_in_generate=True, output_logits=True, use_cache=True)
        self.model.train(was_training)
        sequences = out.sequences[:, width:].cpu()  # (B*n, R)
        scale = 1.0 if greedy else 1.0 / params.temperature
        tokens = out.sequences[:, width:]
        logp = torch.stack([  # one step at a time: never a (B*n, R, V) float32 tensor
            torch.log_softmax(step_logits.float() * scale, dim=-1).gather(-1, tokens[:, t, None]).squeeze(-1)
            for t, step_logits in enumerate(out.logits)], dim=1).cpu()  # (B*n, R)
        return [self._finish(row, sequences[row].tolist(), logp[row].tolist(), offset + row // params.n, params, stop_ids)
                for row in range(sequences.shape[0])]

    def _finish(self, row: int, tokens: list[int], logps: list[float], prompt_index: int,
                params: SamplingParams, stop_ids: list[int]) -> Generation:
        """Cut at the first stop token (kept) or stop string; the rest is padding from `generate`."""
        for position, token in enumerate(tokens):
            if token in stop_ids and not params.ignore_eos:
                return Generation(prompt_index, tokens[:position + 1], logps[:position + 1], "stop")
        if params.stop_strings:
            text = ""
            for position, token in enumerate(tokens):
                text += self.tokenizer.decode([token])
                if any(text.endswith(s) or s in text for s in params.stop_strings):
                    return Generation(prompt_index, tokens[:position + 1], logps[:position + 1], "stop")
        return Generation(prompt_index, tokens, logps, "length")

    def generate_episodes(self, sessions: list[EnvironmentSession], renderer: ObservationRenderer,
                          params: SamplingParams, budget: EpisodeBudget) -> list[Episode]:
        """Multi-turn episodes by the plain reference loop (`rollout/multiturn.py`): every turn regenerates from the
        whole sequence so far. Slow; the built-in engine is compared against it."""
        return generate_episodes_reference(self, sessions, renderer, params, budget,
                                           self.eos_ids | set(params.stop_token_ids))

    def release_memory(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
