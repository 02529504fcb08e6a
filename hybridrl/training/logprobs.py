"""Per-token log-probabilities (and entropy) of response tokens under a causal LM, without full logits.

One function, `response_logprobs`, serves the actor's update, the old-policy and reference passes and
the rollout mismatch check, so all of them see exactly the same numbers.

Choices:
- The backbone runs once and returns hidden states; the LM head is applied here, only at the positions
  that predict a response token (`logits_to_keep` in spirit), and only `chunk_tokens` positions at a
  time. Each chunk's logits are made in the head's dtype, reduced to (log-prob, entropy, log-normaliser)
  of softmax(logits / temperature) in float32 and dropped, so (tokens, vocab) logits never exist, in
  float32 or bf16. On CUDA the reduction is one Triton pass (`fused_head.py`), elsewhere PyTorch.
- Backward does not keep the chunks either: `_ChunkedHeadLogprobs` recomputes each chunk's logits from
  the saved hidden states and head weight and turns them, in place, into d(logits) in closed form
  (softmax minus one-hot, and -p (log p + H) for entropy) from the saved log-normaliser and entropy.
  The head's weight gradient is accumulated in float32.
- Padding is removed before the forward pass when it is worth it (`pack`): the real tokens of all rows
  are packed into rows with position ids restarting at 0 for each sequence (see `packing.py`), and
  transformers turns those resets into block-diagonal attention (sdpa) or varlen kernels (flash).
- Models whose logits are not a plain linear head of the last hidden state (soft-capping, logit scale,
  an adapter on the head) fall back to the model's own forward with the same chunked reduction.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from hybridrl.models.loading import decoder_hidden_states
from hybridrl.training.fused_head import reference_softmax_stats, softmax_grad_, softmax_stats
from hybridrl.training.packing import flash_attention, pack_rows, plan_rows
from hybridrl.training.shared_prompt import (
    FLEX_BLOCK,
    PromptLayout,
    attention_mask_for,
    flex_kernel_options,
    pack_shared_prompts,
    uses_flex_attention,
)

CHUNK_ELEMENTS = 64 * 2**20
"""Logit elements per chunk: 64 Mi values (128 MiB in bf16; ~440 positions for a 152k vocabulary). The
fused kernels make no float32 copy of a chunk; the unfused path (CPU) makes a few."""


GRAD_CHUNKS_PER_PRODUCT = 4
"""The backward pass makes each chunk's d(loss)/d(logits) as the forward makes its logits, one chunk at a time, but
keeps this many chunks of them side by side for the products with the head weight. The weight's gradient is a
float32 (V, H) sum that a product reads and writes whole: one product per chunk of ~440 positions is bound by that
traffic, not by its arithmetic. Costs
(this - 1) more chunks of logits (128 MiB each at the default size) during the head's backward, only where the
head is trained (a frozen head, as under LoRA, keeps one chunk at a time)."""


def default_chunk_tokens(vocab_size: int) -> int:
    return max(16, CHUNK_ELEMENTS // max(1, vocab_size))


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """(hidden (N, H), head weight (V, H), bias (V,) | None, targets (N,)) -> log p (N,), entropy (N,)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, chunk_tokens, with_entropy):
        logps, entropies, log_norms = [], [], []
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
            logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
            logp, entropy, log_norm = softmax_stats(logits, t, scale)
            logps.append(logp)
            entropies.append(entropy)
            log_norms.append(log_norm)
        entropy = torch.cat(entropies)
        ctx.save_for_backward(hidden, weight, bias, targets, torch.cat(log_norms), entropy)
        ctx.scale, ctx.chunk_tokens, ctx.with_entropy = scale, chunk_tokens, with_entropy
        return torch.cat(logps), entropy if with_entropy else torch.zeros_like(entropy)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, log_norm, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        if not ctx.with_entropy:
            grad_entropy = torch.zeros_like(grad_logp)
        # d(loss)/d(logits) of GRAD_CHUNKS_PER_PRODUCT chunks side by side, so that the products with the head
        # weight run over that many positions at once; one chunk at a time when the head is frozen (LoRA), whose
        # hidden-state product gains nothing from it
        rows = min(hidden.shape[0], ctx.chunk_tokens * (GRAD_CHUNKS_PER_PRODUCT if need_weight else 1))
        group_grad = torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=weight.device)
        for group_start in range(0, hidden.shape[0], rows):
            group = slice(group_start, min(group_start + rows, hidden.shape[0]))
            for start in range(group.start, group.stop, ctx.chunk_tokens):
                chunk = slice(start, min(start + ctx.chunk_tokens, group.stop))
                h, into = hidden[chunk], group_grad[chunk.start - group.start: chunk.stop - group.start]
                logits = torch.mm(h, weight.t(), out=into) if bias is None else torch.addmm(bias, h, weight.t(), out=into)
                # d(loss)/d(logits) (C, V) in the weight's dtype, possibly written over `logits`
                grad_logits = softmax_grad_(logits, targets[chunk], log_norm[chunk], entropy[chunk], grad_logp[chunk],
                                            grad_entropy[chunk], ctx.scale)
                if grad_logits.data_ptr() != into.data_ptr():
                    into.copy_(grad_logits)
            grads = group_grad[: group.stop - group.start]
            if need_hidden:
                grad_hidden[group] = grads @ weight
            if need_weight:
                accumulate_matmul_(grad_weight, grads.t(), hidden[group])  # bf16 products, float32 sum
            if need_bias:
                grad_bias.add_(grads.float().sum(0))
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def accumulate_matmul_(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total (float32) += a @ b for low-precision a, b: on CUDA one addmm accumulating into `total` in
    float32 (`out_dtype`), elsewhere (or on torch without it) a product in a's dtype then a float32 add."""
    if total.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        try:
            torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
            return
        except (TypeError, RuntimeError):  # torch without addmm(out_dtype=...) for this case
            pass
    total.add_((a @ b).float())


def token_logprobs(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_tokens: int | None = None, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and entropy (zeros unless `with_entropy`) from hidden states (N, H) through `head`: (N,), (N,)."""
    scale = 1.0 / temperature if temperature > 0 else 1.0
    chunk_tokens = chunk_tokens or default_chunk_tokens(head.weight.shape[0])
    hidden = hidden.to(head.weight.dtype)
    return _ChunkedHeadLogprobs.apply(hidden, head.weight, head.bias, targets, scale, chunk_tokens, with_entropy)


def plain_head(model: nn.Module) -> nn.Linear | None:
    """The LM head when logits are exactly `head(last hidden state)`, else None (use the model's forward)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if type(head) is not nn.Linear or not hasattr(model, "get_decoder"):
        return None  # missing, or wrapped (e.g. a LoRA layer on the head)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    return head


def _hidden_states(model: nn.Module, input_ids, attention_mask, position_ids, **attention_options) -> torch.Tensor:
    # Under FSDP2, `fsdp.parallelize` registers this call as a forward of the root module, so the
    # embeddings, final norm and head are gathered for it (they live in the root, not in a layer).
    sharded_forward = getattr(model, "fsdp_hidden_states", None)
    if sharded_forward is not None:
        return sharded_forward(input_ids, attention_mask, position_ids, **attention_options)
    return decoder_hidden_states(model, input_ids, attention_mask, position_ids, **attention_options)


def _fallback_logprobs(model, input_ids, attention_mask, position_ids, positions, targets, scale, **attention_options):
    """Models with a non-plain head: their own forward, then the same float32 reduction (logits do exist)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False, **attention_options).logits
    picked = logits.flatten(0, 1)[positions]  # (N, V)
    logp, entropy, _ = reference_softmax_stats(picked, targets, scale)
    return logp, entropy


def _model_and_context(model: nn.Module):
    """A LoRA reference (`lora.AdapterDisabled`) runs the actor's modules with the adapter switched off."""
    inner = getattr(model, "adapter_disabled_model", None)
    if inner is not None:
        return inner, inner.disable_adapter()
    return model, nullcontext()


def response_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor, response_length: int, temperature: float = 1.0,
                      with_entropy: bool = False, chunk_tokens: int | None = None,
                      pack: bool | None = None, real_tokens: int | None = None,
                      prompt_layout: PromptLayout | None = None,
                      fixed_shape: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token t | prefix) for the last `response_length` columns: (B, R) float32, and entropy.

    `pack`: remove padding by packing sequences into rows (None: when at least 1/8 of the tokens are padding and
    packing leaves at most 7/8 of the rows, `packing.RowPlan.saves_rows`).
    `real_tokens`: the attention mask's sum when the caller knows it on the host; it spares a device sync,
    and rows without any padding then run with no mask at all (causal attention, no mask checks).
    `prompt_layout`: which prompt each row answers (and its lengths, on the host); rows of one prompt then
    share one pass over it (`shared_prompt.py`, `actor.share_prompt_tokens`).
    `fixed_shape`: the padded rows as they are, with their attention mask, whatever the padding (no packing, no
    host read): the same kernels at every call, as a CUDA graph of the pass needs (`graphed_pass.py`).
    Values at padded response positions are 0.
    """
    model, context = _model_and_context(model)
    num_rows, width = input_ids.shape
    prompt_width = width - response_length
    if prompt_layout is not None:
        packed = pack_shared_prompts(input_ids, prompt_width, prompt_layout,
                                     multiple=FLEX_BLOCK if uses_flex_attention(model) else 1)
        inputs = (packed.input_ids, attention_mask_for(model, packed), packed.position_ids)
        positions, targets, pack = packed.logit_positions, packed.targets, True
        attention_options = flex_kernel_options(model, input_ids.device)
    else:
        attention_options = {}
        if fixed_shape:
            pack, real_tokens = False, -1  # never packed, the mask always kept
        if real_tokens is None:
            real_tokens = int(attention_mask.sum().item())
        plan = None
        if pack is None:  # worth it when padding is at least 1/8 of the tokens and packing saves rows
            pack = real_tokens < 0.875 * attention_mask.numel()
            plan = plan_rows(attention_mask, prompt_width, one_row=flash_attention(model)) if pack else None
            pack = pack and plan.saves_rows()
        if not pack and real_tokens == attention_mask.numel():  # no padding: positions are 0..width-1 in every row
            attention_mask = position_ids = None
        if pack:
            plan = plan or plan_rows(attention_mask, prompt_width, one_row=flash_attention(model))
            packed = pack_rows(input_ids, attention_mask, prompt_width, plan=plan)
            inputs = (packed.input_ids, None, packed.position_ids)
            positions, targets = packed.logit_positions, packed.targets
        else:
            inputs = (input_ids, attention_mask, position_ids)
            columns = torch.arange(prompt_width - 1, width - 1, device=input_ids.device)
            positions = (torch.arange(num_rows, device=input_ids.device)[:, None] * width + columns).flatten()
            targets = input_ids[:, prompt_width:].flatten()
    scale = 1.0 / temperature if temperature > 0 else 1.0
    with context:
        head = plain_head(model)
        if head is None:
            logp, entropy = _fallback_logprobs(model, *inputs, positions, targets, scale, **attention_options)
        else:
            hidden = _hidden_states(model, *inputs, **attention_options)
            logp, entropy = token_logprobs(hidden.flatten(0, 1)[positions], head, targets, temperature, chunk_tokens,
                                           with_entropy)
    if pack:
        logp, entropy = packed.unpack(logp, (num_rows, response_length)), packed.unpack(entropy, (num_rows, response_length))
    else:
        logp, entropy = logp.view(num_rows, response_length), entropy.view(num_rows, response_length)
        if attention_mask is not None:
            real = attention_mask[:, prompt_width:].bool()
            logp, entropy = logp.masked_fill(~real, 0.0), entropy.masked_fill(~real, 0.0)
    return logp, (entropy if with_entropy else None)
