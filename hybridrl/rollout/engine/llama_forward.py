"""Forward pass of the Llama family over the engine's weight references (`weights.py`): prefill and decode steps.

`prefill` and the decode functions are plain functions of `ModelWeights` and a KV cache, so the runner can compile
them and capture them in CUDA graphs. Covered: grouped-query attention; tied embeddings; the RoPE variants of the
supported configs, taken from the model's own rotary module so they are not re-derived here; LoRA applied in
peft's order and dtypes (`_linear`).

KV cache layouts (`kv_cache.py` owns the tensors): per-slot, one tensor `(num_layers, 2, num_slots,
num_kv_heads, max_len, head_dim)`, so a slot's keys for one layer are a contiguous `(num_kv_heads,
max_len, head_dim)` block and moving a sequence between slots is one indexing op (`decode_logits`,
SDPA); or prefix-shared, each prompt's KV once plus each slot's response KV (`decode_logits_prefix_shared`,
attention from `decode_attention.py`). `prefill` writes either. Decode attention folds the query heads that share
a KV head into the query-length axis (`(B, kv_heads, group, head_dim)`), which turns GQA decode into plain
attention with a per-slot length mask and no repeated keys.

Decode is split into per-layer pure functions (`DecodeFunctions`: attention inputs, attention output
+ MLP, final logits) so that `compiled_decode_functions()` can hand them to `torch.compile` one layer
at a time: every layer has the same shapes, so one compilation serves all of them (seconds, not the
minutes a whole unrolled model takes) and the RMSNorm / RoPE / q-k-norm / SiLU-mul / residual chains
become a few fused kernels. The KV write and attention stay outside the compiled region (in-place writes
into a graph input are where compilers are least predictable): SDPA after an `index_put`, or the Triton
prefix-shared kernel, which stores the new K/V itself. The caller's CUDA graph takes the whole step,
compiled kernels included.

`extend` (a multi-turn resume: new tokens onto a slot's per-slot cache) is split the same way, into two compiled
pieces per layer around its KV write and read, with rows, length and key length dynamic; `extend_hidden`, all of it but
the LM head, is what `engine/resume.py` captures in a CUDA graph for small waves (padded to a few buckets); larger
ones run uncaptured. `extend_reference` is its slow, obviously right form.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from hybridrl.rollout.engine.weights import Lora, LayerWeights, ModelWeights, unpacked, unwrap


def rope_table(model, max_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (see `signed_sin`), each (max_len, head_dim), from the model's own rotary
    module (so every RoPE variant and its attention scaling come from transformers itself)."""
    rotary = unwrap(model).model.rotary_emb
    positions = torch.arange(max_len, device=device)[None]
    probe = torch.empty(0, device=device, dtype=dtype)
    cos, sin = rotary(probe, positions)
    return cos[0].contiguous(), signed_sin(sin[0]).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same arithmetic as HF's LlamaRMSNorm (normalize in float32, cast back, then scale), fewer kernels: F.rms_norm
    normalizes a 16-bit x in float32 itself and rounds once, so an uncompiled step (the light rollout's) does without
    the two casts around it."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, so that rotate_half(x) * sin == x.roll(half) * signed_sin."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # HF: x * cos + cat(-x2, x1) * sin; the roll form is the same products in two kernels fewer.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            lora: Lora | None = None) -> torch.Tensor:
    """F.linear, plus the LoRA update in peft's order and dtypes when the projection has an adapter."""
    out = F.linear(x, weight, bias)
    if lora is None:
        return out
    a, b, scale = lora
    return (out + F.linear(F.linear(x.to(a.dtype), a), b) * scale).to(out.dtype)


def _qkv(w: ModelWeights, lw: LayerWeights, h: torch.Tensor, cos, sin):
    """Projections + q/k norm + RoPE. h: (..., hidden) -> q (..., H, D), k/v (..., Hkv, D)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    if lw.qkv_weight is not None and lw.q_norm is None:
        # q and k are adjacent heads of one product: one RoPE over both (four kernels fewer uncompiled; the roll of
        # the whole contiguous product, v's heads included, spares torch.roll a copy of a sliced view).
        qkv = F.linear(h, lw.qkv_weight, lw.qkv_bias).unflatten(-1, (-1, w.head_dim))  # (..., H + 2 Hkv, D)
        heads = w.num_heads + w.num_kv_heads
        qk = qkv[..., :heads, :] * cos + qkv.roll(w.head_dim // 2, dims=-1)[..., :heads, :] * sin  # = _apply_rope
        return qk[..., : w.num_heads, :], qk[..., w.num_heads:, :], qkv[..., heads:, :]
    if lw.qkv_weight is not None:
        q_size, kv_size = w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
        q, k, v = F.linear(h, lw.qkv_weight, lw.qkv_bias).split((q_size, kv_size, kv_size), dim=-1)
    else:
        q = _linear(h, lw.q_weight, lw.q_bias, lw.q_lora)
        k = _linear(h, lw.k_weight, lw.k_bias, lw.k_lora)
        v = _linear(h, lw.v_weight, lw.v_bias, lw.v_lora)
    q = q.unflatten(-1, (w.num_heads, w.head_dim))
    k, v = k.unflatten(-1, (w.num_kv_heads, w.head_dim)), v.unflatten(-1, (w.num_kv_heads, w.head_dim))
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, w.rms_eps)
        k = rms_norm(k, lw.k_norm, w.rms_eps)
    return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v


def _mlp(lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
    # supports() admits only silu MLPs, so F.silu is the model's own act_fn (and compiles without a guard on it).
    if lw.gate_up_weight is not None:
        gate, up = F.linear(h, lw.gate_up_weight).chunk(2, dim=-1)
    else:
        gate, up = _linear(h, lw.gate_weight, lora=lw.gate_lora), _linear(h, lw.up_weight, lora=lw.up_lora)
    return _linear(F.silu(gate) * up, lw.down_weight, lora=lw.down_lora)


def prefill(
    w: ModelWeights,
    kv_cache: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    source_rows: torch.Tensor,
    dest_slots: torch.Tensor,
    layer: Callable | None = None,
    store: Callable | None = None,
) -> torch.Tensor:
    """Run right-padded prompts once and copy their keys/values into every slot that shares them.

    input_ids (P, L) right-padded; lengths (P,); source_rows/dest_slots (Q,): slot dest_slots[j]
    receives the KV of prompt row source_rows[j] (the n samples of a prompt share one row). With the
    prefix-shared layout `kv_cache` is the prompt cache and dest_slots are prompt entries (one per
    prompt, none for a prompt whose entry is already filled: then only its logits are wanted).
    Returns float32 logits at each prompt's last token, (P, V). `layer`: `prefill_layer` or its compiled
    form (`DecodeFunctions.prefill_layer`); eager when None. `store(layer_index, k, v)`, k/v (P, Hkv, L, D), writes
    the KV instead (the cache layout's own write, `kv_cache.py`); then kv_cache and the index arguments are unused.
    """
    layer = layer or prefill_layer
    num_prompts, length = input_ids.shape
    if w.sliding_window is not None and length > w.sliding_window:
        raise ValueError(f"prompt of {length} tokens exceeds the model's sliding window {w.sliding_window}.")
    h = F.embedding(input_ids, w.embed)  # (P, L, hidden)
    cos, sin = cos_table[:length], sin_table[:length]
    for layer_index, lw in enumerate(w.layers):
        h, k, v = layer(w, unpacked(lw), h, cos, sin)
        if store is not None:
            store(layer_index, k, v)
            continue
        kv_cache[layer_index, 0, dest_slots, :, :length] = k[source_rows]
        kv_cache[layer_index, 1, dest_slots, :, :length] = v[source_rows]
    last = h[torch.arange(num_prompts, device=h.device), lengths - 1]  # (P, hidden)
    return F.linear(rms_norm(last, w.final_norm, w.rms_eps), w.lm_head).float()


def prefill_layer(w: ModelWeights, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """One decoder layer over right-padded prompts: h (P, L, hidden) -> (h, k, v), k/v (P, Hkv, L, D) for the
    cache. Right padding: a real token only attends to earlier real tokens, so is_causal is enough."""
    num_prompts, length, _ = h.shape
    q, k, v = _qkv(w, lw, rms_norm(h, lw.input_norm, w.rms_eps), cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (P, heads, L, D)
    # enable_gqa: keys and values are not repeated per query head, which saves the layout kernels that a repeat
    # would launch around the attention.
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    attn = attn.transpose(1, 2).reshape(num_prompts, length, w.num_heads * w.head_dim)
    h = h + _linear(attn, lw.o_weight, lw.o_bias, lw.o_lora)
    return h + _mlp(lw, rms_norm(h, lw.post_norm, w.rms_eps)), k, v


def extend_reference(w: ModelWeights, kv_cache: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                     input_ids: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor,
                     kv_end: int) -> torch.Tensor:
    """`extend`'s slow, obviously right form, which tests hold the fast one to: per layer, write the new K/V into
    the slots by advanced indexing, read each slot's keys back, repeat them for every query head and attend with a
    float32 softmax under an explicit (P, L, kv_end) mask. Same arguments and result as `extend`."""
    num_rows, length = input_ids.shape
    positions = (starts[:, None] + torch.arange(length, device=input_ids.device)).clamp_(max=kv_cache.shape[4] - 1)
    visible = torch.arange(kv_end, device=input_ids.device) <= positions[:, :, None]  # (P, L, kv_end)
    group = w.num_heads // w.num_kv_heads
    h = F.embedding(input_ids, w.embed)  # (P, L, hidden)
    cos, sin = cos_table[positions], sin_table[positions]  # (P, L, D)
    for layer_index, lw in enumerate(w.layers):
        lw = unpacked(lw)
        q, k, v = _qkv(w, lw, rms_norm(h, lw.input_norm, w.rms_eps), cos, sin)  # (P, L, heads, D)
        # Advanced indices on dims 0 and 2 of (slots, Hkv, max_len, D) put (P, L) first: (P, L, Hkv, D).
        kv_cache[layer_index, 0][slots[:, None], :, positions] = k
        kv_cache[layer_index, 1][slots[:, None], :, positions] = v
        keys = kv_cache[layer_index, 0, slots, :, :kv_end].repeat_interleave(group, dim=1)  # (P, H, K, D)
        values = kv_cache[layer_index, 1, slots, :, :kv_end].repeat_interleave(group, dim=1)
        scores = torch.matmul(q.transpose(1, 2), keys.transpose(-1, -2)).float() * w.head_dim**-0.5  # (P, H, L, K)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        attn = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # (P, H, L, D)
        attn = attn.transpose(1, 2).reshape(num_rows, length, w.num_heads * w.head_dim)
        h = h + _linear(attn, lw.o_weight, lw.o_bias, lw.o_lora)
        h = h + _mlp(lw, rms_norm(h, lw.post_norm, w.rms_eps))
    last = h[torch.arange(num_rows, device=h.device), lengths - 1]  # (P, hidden)
    return F.linear(rms_norm(last, w.final_norm, w.rms_eps), w.lm_head).float()


def extend_inputs(w: ModelWeights, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`extend`, before the KV write: input RMSNorm, q/k/v, q/k norm, RoPE. h (P, L, hidden), cos/sin (P, L, D) ->
    q (P, L, H, D) and kv (2, P, L, Hkv, D), keys and values stacked so that the cache write is one store."""
    q, k, v = _qkv(w, lw, rms_norm(h, lw.input_norm, w.rms_eps), cos, sin)  # (P, L, heads, D)
    return q, torch.stack((k, v))


def extend_attention_and_mlp(w: ModelWeights, lw: LayerWeights, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                             positions: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """`extend`, after the KV write: attention over the slot's keys (`_masked_gqa_attention`), o projection,
    residual, post-attention RMSNorm, MLP, residual. h (P, L, hidden), q (P, L, H, D) from `extend_inputs`, kv
    (2, P, Hkv, K, D) the rows' slots read back after the write, positions (P, L) -> h. With `slots` (P,) (the
    Triton kernel on the per-slot cache, `reads_slots_in_place`), kv is the layer's whole cache (2, S, Hkv, max_len,
    D) and the kernel reads each row's slot in place."""
    rows, length, _ = h.shape
    if slots is None:
        attn = EXTEND_ATTENTIONS[extend_attention](q, kv[0], kv[1], positions)
    else:
        attn = _triton_gqa_attention(q, kv[0], kv[1], positions, slots)
    h = h + _linear(attn.reshape(rows, length, w.num_heads * w.head_dim), lw.o_weight, lw.o_bias, lw.o_lora)
    return h + _mlp(lw, rms_norm(h, lw.post_norm, w.rms_eps))


def _masked_gqa_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          positions: torch.Tensor) -> torch.Tensor:
    """`extend`'s attention as two batched matmuls and a float32 softmax: q (P, L, H, D), keys/values (P, Hkv, K, D),
    positions (P, L) of the queries; key j is visible to a query at position p when j <= p -> (P, L, H, D). The
    obviously right form the others are tested against. (SDPA with a mask and grouped heads, `enable_gqa`, picked a
    CUDA backend that paid tens of milliseconds of setup for every new (rows, key length); `_sdpa_folded_attention`
    folds the heads instead.) The query heads sharing a KV head are folded into the query axis (as decode does), so
    keys are not repeated. The mask is made from the positions here rather than passed in,
    so that compiled, the upcast, scale, mask and softmax are one pass over the scores, which the matmul writes once
    in the model dtype."""
    rows, length, num_heads, head_dim = q.shape
    num_kv_heads, key_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    folded = q.view(rows, length, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # (P, Hkv, group, L, D)
    scores = torch.matmul(folded.reshape(rows, num_kv_heads, group * length, head_dim), keys.transpose(-1, -2))
    scores = scores.float().view(rows, num_kv_heads, group, length, key_len) * head_dim**-0.5
    visible = torch.arange(key_len, device=q.device) <= positions[:, None, None, :, None]  # (P, 1, 1, L, K)
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(values.dtype).view(rows, num_kv_heads, group * length, key_len)
    out = torch.matmul(weights, values).view(rows, num_kv_heads, group, length, head_dim)
    return out.permute(0, 3, 1, 2, 4).reshape(rows, length, num_heads, head_dim)


def _sdpa_folded_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
    """`_masked_gqa_attention` through SDPA with an additive mask (on CUDA the memory-efficient kernel, which takes
    one; flash takes none): the query heads of a KV head folded into the query axis (query-major, so the mask is each
    query's row repeated `group` times), so no grouped-query support is needed and keys are not repeated. The mask
    (P, 1, L * group, K) is written once per layer instead of the scores' several passes."""
    rows, length, num_heads, head_dim = q.shape
    num_kv_heads, key_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    folded = q.view(rows, length, num_kv_heads, group, head_dim).transpose(1, 2)  # (P, Hkv, L, group, D)
    folded = folded.reshape(rows, num_kv_heads, length * group, head_dim)
    query_positions = positions.repeat_interleave(group, dim=1)  # (P, L * group)
    visible = torch.arange(key_len, device=q.device) <= query_positions[:, None, :, None]  # (P, 1, L * group, K)
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)  # (P, Hkv, L * group, D)
    return out.view(rows, num_kv_heads, length, group, head_dim).transpose(1, 2).reshape(rows, length, num_heads,
                                                                                           head_dim)


def _triton_gqa_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                          slots: torch.Tensor | None = None) -> torch.Tensor:
    """`_masked_gqa_attention` in one Triton kernel with an online softmax (`kernels/extend_attention.py`): the scores
    stay in registers, and each row reads its keys only up to its furthest query (with `slots`, from its slot of the
    cache in place)."""
    from hybridrl.rollout.kernels.extend_attention import extend_attention  # Triton: an optional dependency

    return extend_attention(q, keys, values, positions, slots)


_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def _auto_gqa_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on CUDA where Triton is installed, else SDPA (CPU, or a CUDA install without Triton). On an
    H200 the kernel's waves take ~16 ms less GPU time per episode than SDPA's, and it won both alternating end-to-end
    runs (docs/benchmarks.md, "Multi-turn rollout"). Decided while tracing (the device is static there)."""
    return EXTEND_ATTENTIONS["triton" if q.is_cuda and _TRITON_INSTALLED else "sdpa"](q, keys, values, positions)


def reads_slots_in_place(device: torch.device) -> bool:
    """Whether `extend` on the per-slot cache hands its attention the layer's whole cache and the rows' slots instead
    of a gathered copy of those slots (a copy of every row's keys and values up to the key bucket, per layer): the
    Triton kernel (`extend_attention` "triton", or "auto" on CUDA with Triton) reads each row's slot in place."""
    return extend_attention == "triton" or (extend_attention == "auto" and device.type == "cuda" and _TRITON_INSTALLED)


EXTEND_ATTENTIONS: dict[str, Callable] = {"auto": _auto_gqa_attention, "sdpa": _sdpa_folded_attention,
                                          "matmul": _masked_gqa_attention, "triton": _triton_gqa_attention}
"""The attentions `extend` can run, each q (P, L, H, D), keys/values (P, Hkv, K, D), positions (P, L) -> (P, L, H, D).
`auto` (the default) is `triton` on CUDA with Triton installed, else `sdpa`; `sdpa` is the fallback; the matmul form
is the obviously right one the others are tested against."""
extend_attention = "auto"
"""Which of `EXTEND_ATTENTIONS` `extend` runs: a module setting so that one benchmark process can time them side by side
(`benchmarks/multiturn.py --extend-attention`); a compiled `extend` recompiles when it changes."""


def attention_inputs(w: ModelWeights, lw: LayerWeights, h: torch.Tensor, pending: tuple[torch.Tensor, ...],
                     cos: torch.Tensor, sin: torch.Tensor, project: Callable = F.linear):
    """Decode: the previous layer's residuals (`pending`: its attention output and MLP output, added in that
    order; empty before the first layer), input RMSNorm, q/k/v projections, q/k norm, RoPE. h (B, hidden),
    cos/sin (B, D) -> h with the residuals added; q (B, Hkv, group, D) with the query heads of one KV head
    folded together; kv (B, 2, Hkv, D), keys and values stacked so the cache write is one store (q and kv
    are views of one buffer, so compiled, the RoPEs and the stack are one kernel, and the residual adds fuse
    into the norm: no kernel of their own). cos = sin = None (fused q/k/v, no q/k norm): q and kv are the raw
    projection, without bias or RoPE, for an attention that applies both (`decode_attention.rotate_projections`).
    `project(x, weight)`: that fused projection's matmul (`small_batch.py` passes its kernel for narrow batches)."""
    h = _with_residuals(h, pending)
    batch = h.shape[0]
    if cos is None:  # RoPE and the q/k/v bias are left to the attention kernel: q and kv are views of one matmul
        qkv = project(rms_norm(h, lw.input_norm, w.rms_eps), lw.qkv_weight).view(batch, -1, w.head_dim)
    else:
        q, k, v = _qkv(w, lw, rms_norm(h, lw.input_norm, w.rms_eps), cos, sin)
        # One buffer (B, H + 2 Hkv, D) for q and the new K/V: compiled, both RoPEs and the stack are one kernel.
        qkv = torch.cat((q, k, v), dim=-2)
    return h, qkv[:, : w.num_heads].view(batch, w.num_kv_heads, -1, w.head_dim), \
        qkv[:, w.num_heads:].view(batch, 2, w.num_kv_heads, w.head_dim)


def attention_output_and_mlp(w: ModelWeights, lw: LayerWeights, h: torch.Tensor, attn: torch.Tensor,
                             project: Callable | None = None):
    """Decode: o projection, post-attention RMSNorm of h + o, MLP. attn (B, Hkv, group, D) -> the residuals
    (o, MLP output), which the next piece adds to h (see `attention_inputs`). h + o is not returned: a
    matmul + add whose sum leaves the compiled graph becomes cuBLAS addmm, whose beta-add needs h copied
    into its output first (a device-to-device copy per layer); used only by the norm, the add fuses there.
    `project(x, weight, silu_mul=False, partial=False)` (`small_batch.py`'s kernel for narrow batches) replaces
    F.linear where the projection is plain: o without bias or adapter, stacked gate/up (SiLU-mul applied inside), down
    without adapter; o and down as split-K partial sums where it splits them (`partial`), added up inside the fused
    norm that reads them (`_with_residuals`), so no reduction kernel of their own."""
    attn = attn.reshape(h.shape[0], -1)
    plain_o = project is not None and lw.o_bias is None and lw.o_lora is None
    o = project(attn, lw.o_weight, partial=True) if plain_o else _linear(attn, lw.o_weight, lw.o_bias, lw.o_lora)
    o = o.sum(0).to(h.dtype) if o.dim() == 3 else o
    normed = rms_norm(h + o, lw.post_norm, w.rms_eps)
    if project is None or lw.gate_up_weight is None or lw.down_lora is not None:
        return o, _mlp(lw, normed)
    return o, project(project(normed, lw.gate_up_weight, True), lw.down_weight, partial=True)


def _with_residuals(h: torch.Tensor, pending: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """h plus the residuals not yet added; one of three dims is split-K partial sums (S, B, N) float32, added up and
    rounded to h's dtype as the product's own output would have been."""
    for residual in pending:
        h = h + (residual.sum(0).to(h.dtype) if residual.dim() == 3 else residual)
    return h


def final_logits(w: ModelWeights, h: torch.Tensor, pending: tuple[torch.Tensor, ...],
                 project: Callable = F.linear) -> torch.Tensor:
    h = _with_residuals(h, pending)
    return project(rms_norm(h, w.final_norm, w.rms_eps), w.lm_head)


@dataclass(frozen=True)
class DecodeFunctions:
    """The per-layer pieces of a decode step, and the prefill's layer; eager (`EAGER_DECODE`) or compiled
    (`compiled_decode_functions`)."""

    attention_inputs: Callable
    attention_output_and_mlp: Callable
    final_logits: Callable
    prefill_layer: Callable = prefill_layer
    extend_inputs: Callable = extend_inputs
    extend_attention_and_mlp: Callable = extend_attention_and_mlp
    small_batch: DecodeFunctions | None = None
    """The decode pieces for batches of at most `small_batch_rows` (`small_batch.py`; the runner sets them on CUDA)."""
    small_batch_rows: int = 0


EAGER_DECODE = DecodeFunctions(attention_inputs, attention_output_and_mlp, final_logits, prefill_layer)


def dynamic_batch(fn: Callable, activation_arg: int, batch_dim: Callable = lambda tensor: 0) -> Callable:
    """`fn` with the batch dimension (`batch_dim(tensor)`, 0 by default) of every tensor argument from `activation_arg`
    on marked dynamic."""
    def call(*args):
        for extra in args[activation_arg:]:
            for tensor in extra if isinstance(extra, tuple) else (extra,):
                if isinstance(tensor, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(tensor, batch_dim(tensor))
        return fn(*args)
    return call


def compiled_decode_functions() -> DecodeFunctions:
    """`torch.compile`d decode pieces. The batch dimension is marked dynamic on the first call, so one
    compilation covers every batch bucket; weights are arguments, never constants, so in-place
    updates are seen. Compilation happens on the first call of each piece (the caller's warm-up)."""
    # Dynamo caches compilations per code object (8 by default); every engine variant (model shape, LoRA,
    # fused copies, bias) adds one, and a process that builds many engines (a benchmark, a test suite)
    # would otherwise fail with "recompile limit exceeded" under fullgraph=True.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = [torch.compile(fn, fullgraph=True) for fn in (attention_inputs, attention_output_and_mlp, final_logits,
                                                             prefill_layer, extend_inputs, extend_attention_and_mlp)]

    def dynamic_dims(fn, *dims_per_tensor: tuple[int, ...]):
        """The prefill's prompt count and length vary from chunk to chunk, and a resume's rows, length and key
        length from wave to wave: those dimensions of the tensors after (w, lw) are dynamic, one compilation."""
        def call(w, lw, *tensors):
            for tensor, dims in zip(tensors, dims_per_tensor):
                for dim in dims if tensor is not None else ():
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
            return fn(w, lw, *tensors)
        return call

    return DecodeFunctions(dynamic_batch(compiled[0], 2), dynamic_batch(compiled[1], 2), dynamic_batch(compiled[2], 1),
                           dynamic_dims(compiled[3], (0, 1), (0,), (0,)),
                           # h (P, L, hidden), cos and sin (P, L, D)
                           dynamic_dims(compiled[4], (0, 1), (0, 1), (0, 1)),
                           # h (P, L, hidden), q (P, L, H, D), kv (2, P, Hkv, K, D), positions (P, L), slots (P,)
                           dynamic_dims(compiled[5], (0, 1), (0, 1), (1, 3), (0, 1), (0,)))


def extend(w: ModelWeights, kv_cache: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
           input_ids: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor,
           kv_end: int, functions: DecodeFunctions = EAGER_DECODE, access: Callable | None = None) -> torch.Tensor:
    """Continue slots of the per-slot cache (the multi-turn resume: only new tokens are computed). Row p feeds
    `input_ids[p, :lengths[p]]` (P, L right-padded) at positions starts[p].., writes their KV into slot slots[p]
    there, and attends to every earlier position the slot holds and causally among its new ids; `kv_end` >= every
    starts + lengths (a bucket: keys past a row's own positions are masked). Padding is written past the row's own
    end (clamped into the slot), where nothing is visible until a later step overwrites it; a resume always
    leaves room for one more token (`EpisodeRun.add_step`), so no padding lands on a row's last real position.
    Returns float32 logits at each row's last new id, (P, V). `extend_reference` is the slow form tests compare with.

    Per layer: the compiled `extend_inputs` and `extend_attention_and_mlp` (`functions`, eager by default) around
    two indexing ops, the write of the new K/V into a flat view of the layer's cache (one `index_put`, index made
    once per call) and one gather of the rows' slots up to kv_end for keys and values together. Why the eager form
    was slow (0.5B shape, 512 rows x 33 ids, kv_end ~600, per layer): the scores are 512 x 14 x 33 x 600 = 142M
    elements, and the matmul's bf16 output went through upcast, scale, mask, softmax and downcast as five
    kernels, ~5.7 GB of traffic, ~137 GB over 24 layers (~33 ms at 4.2 TB/s before any inefficiency), beside the
    projections' and MLP's ~12 TFLOP (~16 ms at peak). Compiled, those five are one pass (read the bf16 scores,
    write bf16 weights: ~1.1 GB per layer) and norm/RoPE/fold, SiLU-mul and residuals fuse; the gather of the slots'
    K/V is ~0.3 GB per layer, which the Triton kernel (the CUDA default) does without: it reads each row's slot of the
    cache in place (`reads_slots_in_place`).

    `access(positions, lengths)` -> (write(layer, kv), read(layer)) replaces those two indexing ops for another
    cache layout (the paged one: `PagedKVCache.extend_access`; `kv_cache` is then unused)."""
    last = extend_hidden(w, kv_cache, cos_table, sin_table, input_ids, lengths, starts, slots, kv_end, functions,
                         access)
    return functions.final_logits(w, last, ()).float()


def extend_hidden(w: ModelWeights, kv_cache: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                  input_ids: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor,
                  kv_end: int, functions: DecodeFunctions = EAGER_DECODE,
                  access: Callable | None = None) -> torch.Tensor:
    """`extend` up to the last layer: the hidden state (P, hidden) at each row's last new id, before the final norm
    and the LM head. Static shapes and no host synchronisation, so a CUDA graph can take it whole (`engine/resume.py`
    captures it for small waves; the logits of the real rows are then computed outside the graph)."""
    num_rows, length = input_ids.shape
    if w.sliding_window is not None and kv_end > w.sliding_window:
        raise ValueError(f"an episode of {kv_end} tokens exceeds the model's sliding window {w.sliding_window}.")
    # Padding positions stay inside the per-slot cache; the RoPE table covers every position of the call.
    max_len = kv_cache.shape[4] if access is None else cos_table.shape[0]
    positions = (starts[:, None] + torch.arange(length, device=input_ids.device)).clamp_(max=max_len - 1)  # (P, L)
    in_place = access is None and reads_slots_in_place(input_ids.device)
    write, read = (access or functools.partial(_per_slot_access, kv_cache, slots, kv_end, in_place))(positions,
                                                                                                     lengths)
    h = F.embedding(input_ids, w.embed)  # (P, L, hidden)
    cos, sin = cos_table[positions], sin_table[positions]  # (P, L, D)
    for layer_index, lw in enumerate(w.layers):
        lw = unpacked(lw)
        q, kv = functions.extend_inputs(w, lw, h, cos, sin)
        write(layer_index, kv)
        h = functions.extend_attention_and_mlp(w, lw, h, q, read(layer_index), positions, slots if in_place else None)
    return h[torch.arange(num_rows, device=h.device), lengths - 1]  # (P, hidden)


def _per_slot_access(kv_cache: torch.Tensor, slots: torch.Tensor, kv_end: int, in_place: bool,
                     positions: torch.Tensor, lengths: torch.Tensor):
    """`extend`'s KV write and read on the per-slot cache (layers, 2, slots, Hkv, max_len, D): one `index_put` into a
    flat view of the layer's cache (index made once per call), one gather of the rows' slots up to kv_end (`in_place`:
    the layer's cache as it is, for an attention that reads the rows' slots there)."""
    num_kv_heads, max_len, head_dim = kv_cache.shape[3], kv_cache.shape[4], kv_cache.shape[5]
    heads = torch.arange(num_kv_heads, device=slots.device)
    # Where token (p, l) of KV head j goes in a layer's cache seen as (2, slots * Hkv * max_len, D): (P, L, Hkv).
    destination = (slots[:, None, None] * num_kv_heads + heads) * max_len + positions[:, :, None]

    def write(layer_index: int, kv: torch.Tensor) -> None:
        kv_cache[layer_index].view(2, -1, head_dim)[:, destination] = kv

    def read(layer_index: int) -> torch.Tensor:
        return kv_cache[layer_index] if in_place else kv_cache[layer_index, :, slots, :, :kv_end]
    return write, read


def _decode_layers(w: ModelWeights, tokens: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                   functions: DecodeFunctions, attend: Callable) -> torch.Tensor:
    """The decode layer stack with the KV write + attention passed in (it is what the cache layouts differ
    in): attend(layer_index, q (B, Hkv, group, D), kv (B, 2, Hkv, D)) -> (B, Hkv, group, D). cos = sin =
    None: `attend` gets raw projections and applies RoPE itself (see `attention_inputs`)."""
    if functions.small_batch is not None and tokens.shape[0] <= functions.small_batch_rows:
        functions = functions.small_batch
    h, pending = F.embedding(tokens, w.embed), ()  # (B, hidden); residuals not yet added to h
    for layer_index, lw in enumerate(w.layers):
        lw = unpacked(lw)
        h, q, kv = functions.attention_inputs(w, lw, h, pending, cos, sin)
        pending = functions.attention_output_and_mlp(w, lw, h, attend(layer_index, q, kv))
    return functions.final_logits(w, h, pending)


def decode_logits(
    w: ModelWeights,
    kv_cache: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    kv_len: int,
    functions: DecodeFunctions = EAGER_DECODE,
) -> torch.Tensor:
    """One decode step for slots 0..B-1: feed `tokens` (B,) at `positions` (B,), write their KV, return
    logits (B, V) in the model dtype. Attention reads keys [0, kv_len) only, so every position must be
    < kv_len. Shapes are static and nothing syncs with the host (graph-safe)."""
    batch = tokens.shape[0]
    slots = torch.arange(batch, device=tokens.device)
    key_positions = torch.arange(kv_len, device=tokens.device)
    visible = key_positions[None, :] <= positions[:, None]  # (B, kv_len)
    if w.sliding_window is not None:
        visible &= key_positions[None, :] > positions[:, None] - w.sliding_window
    # One additive mask for all layers (a bool mask would be converted again inside every SDPA call).
    mask = torch.zeros(batch, 1, 1, kv_len, dtype=w.embed.dtype, device=tokens.device)
    mask.masked_fill_(~visible[:, None, None, :], float("-inf"))

    def attend(layer_index: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        # Advanced indices on dims 1 and 3 of (2, slots, Hkv, max_len, D) put the batch first: (B, 2, Hkv, D).
        kv_cache[layer_index][:, slots, :, positions] = kv
        keys, values = kv_cache[layer_index, 0, :batch, :, :kv_len], kv_cache[layer_index, 1, :batch, :, :kv_len]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # (B, Hkv, group, D)

    return _decode_layers(w, tokens, cos_table[positions], sin_table[positions], functions, attend)


def decode_logits_prefix_shared(
    w: ModelWeights,
    prompt_cache: torch.Tensor,
    response_cache: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    tokens: torch.Tensor,
    prompt_entry: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    attention: Callable,
    functions: DecodeFunctions = EAGER_DECODE,
) -> torch.Tensor:
    """One decode step over the prefix-shared layout (see `decode_attention.py`) for slots 0..B-1.

    prompt_cache (layers, 2, entries, Hkv, prompt_max_len, D) holds each live prompt once;
    response_cache (layers, 2, slots, Hkv, response_max_len, D) each slot's response. tokens,
    prompt_entry, prompt_len, response_len: (B,). The token fed now is response token
    response_len - 1: its position is prompt_len + response_len - 1 and its KV is written at
    response index response_len - 1 by the attention itself (`new_kv=`), then visible. `attention` is
    `triton_decode_attention` or `reference_decode_attention`. The paged layout runs here too: both caches are the
    block pool, `prompt_entry` is the block table (B, columns) and `attention` a paged one (`paged_attention.py`).
    When every layer has fused q/k/v and no q/k norm
    (`rotates_projections`), the attention gets the raw projections and applies bias and RoPE itself: one kernel
    fewer per layer. No host sync and no length-dependent shape (graph-safe).
    """
    positions = prompt_len + response_len - 1  # (B,)
    scale = w.head_dim ** -0.5  # SDPA's default, which the per-slot path uses
    cos, sin = cos_table[positions], sin_table[positions]
    rotate_inside = rotates_projections(w)

    def attend(layer_index: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        prompt_k, prompt_v = prompt_cache[layer_index, 0], prompt_cache[layer_index, 1]
        response_k, response_v = response_cache[layer_index, 0], response_cache[layer_index, 1]
        if rotate_inside:
            return attention(q, prompt_k, prompt_v, response_k, response_v, prompt_entry, prompt_len, response_len,
                             scale, new_kv=kv, rope=(cos, sin), qkv_bias=w.layers[layer_index].qkv_bias)
        return attention(q, prompt_k, prompt_v, response_k, response_v, prompt_entry, prompt_len, response_len,
                         scale, new_kv=kv)

    if rotate_inside:
        return _decode_layers(w, tokens, None, None, functions, attend)
    return _decode_layers(w, tokens, cos, sin, functions, attend)


def rotates_projections(w: ModelWeights) -> bool:
    """Whether a prefix-shared decode step leaves bias and RoPE to the attention: every layer's q/k/v is one matmul
    (`fuse_qkv`) with no q/k norm between projection and RoPE (Qwen3 has one)."""
    return all(lw.qkv_weight is not None and lw.q_norm is None for lw in w.layers)
