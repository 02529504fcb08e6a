"""The weights the built-in engine reads: references to a Hugging Face Llama-family model's own tensors.

The engine never copies weights: `resolve_weights` collects references to the tensors of
`model.model.layers[i]...` (the very tensors the optimizer updates) into `ModelWeights`, which the forward
functions (`llama_forward.py`) read; call it again every `generate`, so modules the trainer replaced and adapters it
switched on or off are seen. The only copies are the opt-in ones made here, every call (in place where an earlier
call's copy fits, so that kept CUDA graphs read them: `kept_runs.py`): q/k/v or gate/up stacked into one matrix
(`fuse_qkv`, `fuse_gate_up`: one matmul instead of several in a step that is bound by its kernel count) and
full-precision copies of a 4-bit base's layers (`dequantize_layers`).

`supports` says, in one line, whether the engine can run a model: Llama 2/3, Qwen2/2.5 (q/k/v bias), Qwen3 (per-head
q/k RMSNorm), Mistral; RoPE types whose frequencies do not depend on the sequence length; silu MLPs; float weights
or bitsandbytes 4-bit projections.

LoRA (peft): a projection wrapped by a peft `LoraLayer` is read as its base weight plus a reference
`(A, B, scaling)` to the default adapter, which `llama_forward._linear` applies the way peft's forward does, so the
engine follows the trainer's adapter updates in place and never merges or copies. Dropout is the identity here
(inference); a merged adapter is already in the base weight and a disabled one is skipped. One active adapter,
plain LoRA (rslora's scaling is just a number) on the q/k/v/o/gate/up/down projections is supported; anything else
(several adapters, DoRA and other variants, LoRA bias, adapters on embeddings / lm_head, modules_to_save) makes
`supports` say no.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE types whose frequencies do not depend on the current sequence length (dynamic NTK and
# longrope rescale as the sequence grows, which a precomputed table cannot reproduce).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
Lora = tuple[torch.Tensor, torch.Tensor, float]


@dataclass
class LayerWeights:
    """References (not copies) to one decoder layer's tensors; biases and q/k norms may be None."""

    input_norm: torch.Tensor
    q_weight: torch.Tensor
    q_bias: torch.Tensor | None
    k_weight: torch.Tensor
    k_bias: torch.Tensor | None
    v_weight: torch.Tensor
    v_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_weight: torch.Tensor
    up_weight: torch.Tensor
    down_weight: torch.Tensor
    # LoRA adapter of each projection, (A (r, in), B (out, r), scaling), or None without an active adapter.
    q_lora: Lora | None = None
    k_lora: Lora | None = None
    v_lora: Lora | None = None
    o_lora: Lora | None = None
    gate_lora: Lora | None = None
    up_lora: Lora | None = None
    down_lora: Lora | None = None
    # `fuse_qkv`: q/k/v weights (and biases) concatenated into one matrix, a copy made per `generate`.
    qkv_weight: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    # `fuse_gate_up`: gate and up weights stacked into one (2 * intermediate, hidden) matrix, likewise a copy.
    gate_up_weight: torch.Tensor | None = None


@dataclass
class ModelWeights:
    """Everything the forward functions read, plus the static shapes they need."""

    embed: torch.Tensor  # (V, hidden)
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # (V, hidden); the same tensor as `embed` when embeddings are tied
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    sliding_window: int | None


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def _sliding_window(config) -> int | None:
    if config.model_type == "mistral":
        return getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types:
        return getattr(config, "sliding_window", None)
    return None


def unwrap(model):
    """The *ForCausalLM inside a peft model (whose own `.model` is the tuner, not the decoder stack)."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def _lora(module) -> Lora | None:
    """The active default adapter of a peft LoRA layer as (A, B, scaling); None for a plain Linear or
    when the adapter is disabled or merged into the base weight (then the base weight alone is right)."""
    if not hasattr(module, "base_layer") or module.disable_adapters or module.merged:
        return None
    active = [n for n in module.active_adapters if n in module.lora_A]  # supports() checked: at most one
    if not active:
        return None
    return module.lora_A[active[0]].weight, module.lora_B[active[0]].weight, float(module.scaling[active[0]])


def _peft_problem(model, inner) -> str | None:
    """Why the peft adapters of `model` (unwrapped) cannot be applied by the engine, or None."""
    projections = {layer.get_submodule(path) for layer in inner.layers for path in PROJECTIONS.values()}
    for name, module in model.named_modules():
        tuner = hasattr(module, "base_layer") or hasattr(module, "modules_to_save")
        if not tuner or (module in projections and hasattr(module, "lora_A")):
            continue
        if module not in projections or hasattr(module, "modules_to_save"):
            return (f"peft wraps {name} ({type(module).__name__}); "
                    "only LoRA on the q/k/v/o/gate/up/down projections is applied")
        return f"peft layer {name} is {type(module).__name__}, not LoRA"
    for module in projections:
        if not hasattr(module, "lora_A") or (module.disable_adapters and not module.merged):
            continue
        if module.disable_adapters:
            return "a LoRA adapter is merged into the weights while adapters are disabled"
        active = [n for n in module.active_adapters if n in module.lora_A]
        if len(active) > 1:
            return f"several LoRA adapters are active ({active}); the engine applies one"
        if active and active[0] in getattr(module, "lora_variant", {}):
            return f"LoRA variant {type(module.lora_variant[active[0]]).__name__} (e.g. DoRA) is not supported"
        if active and module.lora_B[active[0]].bias is not None:
            return "LoRA with lora_bias is not supported"
    return None


MATRICES = ("q_weight", "k_weight", "v_weight", "o_weight", "gate_weight", "up_weight", "down_weight")


def is_packed_4bit(weight: torch.Tensor) -> bool:
    """A bitsandbytes 4-bit weight (QLoRA's frozen base): packed uint8 data plus its quantization state."""
    return weight.dtype == torch.uint8 and getattr(weight, "quant_state", None) is not None


def unpacked(lw: LayerWeights) -> LayerWeights:
    """`lw` with its 4-bit weights dequantized (bitsandbytes) for this one use, or `lw` itself when none
    is packed. Called per layer inside the forward, so only one layer's full-precision weights exist at
    a time: generation costs a dequantization per layer and step instead of a second copy of the model
    (unless `resolve_weights(dequantize_layers=...)` made that copy for the whole `generate`)."""
    packed = {name: getattr(lw, name) for name in MATRICES if is_packed_4bit(getattr(lw, name))}
    if not packed:
        return lw
    from bitsandbytes.functional import dequantize_4bit

    return replace(lw, **{name: dequantize_4bit(weight.data, weight.quant_state) for name, weight in packed.items()})


def supports(model) -> tuple[bool, str]:
    """Whether the built-in engine can run `model`; the reason is one line for the trainer's log."""
    peft_wrapped = hasattr(model, "peft_config")
    if peft_wrapped:
        types = {str(getattr(c, "peft_type", "")) for c in model.peft_config.values()}
        if not all("LORA" in t for t in types):
            return False, f"peft adapters of type {sorted(types)} are not LoRA; the engine applies LoRA only"
        model = unwrap(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return False, f"model_type {model_type!r} is not in the built-in engine's family {SUPPORTED_MODEL_TYPES}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return False, f"{type(model).__name__} is not a *ForCausalLM with .model.layers and .lm_head"
    rope_type = _rope_type(config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        return False, f"RoPE type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return False, f"hidden_act {config.hidden_act!r} is not silu"
    if not hasattr(inner, "rotary_emb"):
        return False, "model has no shared rotary embedding module (model.model.rotary_emb)"
    problem = _peft_problem(model, inner) if peft_wrapped else None
    if problem is not None:
        return False, problem
    weights = [model.lm_head.weight] + [_base(layer.get_submodule(path)).weight for layer in inner.layers[:1]
                                        for path in PROJECTIONS.values()]
    for index, weight in enumerate(weights):  # bitsandbytes 4-bit projections are dequantized per layer
        if index > 0 and is_packed_4bit(weight):
            continue
        if not weight.is_floating_point() or weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False, f"weights of dtype {weight.dtype} (quantized?) are not supported"
    return True, "ok"


def _base(module):
    """The plain layer under a peft wrapper (or the module itself)."""
    return getattr(module, "base_layer", module)


def _bias(linear) -> torch.Tensor | None:
    return linear.bias if getattr(linear, "bias", None) is not None else None


def stacked(parts: tuple[torch.Tensor, ...], into: torch.Tensor | None) -> torch.Tensor:
    """`parts` concatenated along dim 0: into `into` in place when it is a buffer of that shape, dtype and device
    (the one an earlier call made, which kept CUDA graphs read), else into a new tensor."""
    shape = (sum(part.shape[0] for part in parts), *parts[0].shape[1:])
    if into is not None and tuple(into.shape) == shape and into.dtype == parts[0].dtype \
            and into.device == parts[0].device:
        return torch.cat(parts, out=into)
    return torch.cat(parts)


def fused_qkv(lw: LayerWeights, into: LayerWeights | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """q/k/v weights stacked into one (q + 2 kv, hidden) matrix and their biases (zeros where a projection
    has none), or None when any of them carries a LoRA adapter or is 4-bit (the engine then keeps three matmuls).
    `into`: a layer whose stacked buffers are rewritten in place where their shapes still fit (`stacked`)."""
    if lw.q_lora or lw.k_lora or lw.v_lora or any(map(is_packed_4bit, (lw.q_weight, lw.k_weight, lw.v_weight))):
        return None
    weight = stacked((lw.q_weight, lw.k_weight, lw.v_weight), into and into.qkv_weight)
    biases = (lw.q_bias, lw.k_bias, lw.v_bias)
    if all(b is None for b in biases):
        return weight, None
    return weight, stacked(tuple(b if b is not None else w.new_zeros(w.shape[0])
                                 for b, w in zip(biases, (lw.q_weight, lw.k_weight, lw.v_weight))),
                           into and into.qkv_bias)


def fused_gate_up(lw: LayerWeights, into: LayerWeights | None = None) -> torch.Tensor | None:
    """gate and up weights stacked into one (2 * intermediate, hidden) matrix, or None with a LoRA adapter
    or 4-bit weights on either; `into` as for `fused_qkv`."""
    if lw.gate_lora or lw.up_lora or is_packed_4bit(lw.gate_weight) or is_packed_4bit(lw.up_weight):
        return None
    return stacked((lw.gate_weight, lw.up_weight), into and into.gate_up_weight)


def resolve_weights(model, fuse_qkv: bool = False, fuse_gate_up: bool = False,
                    dequantize_layers: int = 0, into: ModelWeights | None = None) -> ModelWeights:
    """Collect references to the model's tensors; call again whenever modules may have been replaced.

    `fuse_qkv` adds, per layer, a copy of q/k/v stacked into one matrix, so a decode step runs one
    projection matmul instead of three (the k and v ones are tiny and launch-bound); `fuse_gate_up`
    likewise for the MLP's gate and up. A decode step is bound by kernel launches and the gaps between
    them, so one kernel fewer per layer is time saved. The copies are made here, so they reflect the
    weights as they are now: resolve again after every optimizer step. `dequantize_layers` replaces the bitsandbytes
    4-bit weights of that many layers (from the first) by full-precision copies made here (kept while the result
    is), so the decode step runs them as for a full-precision base instead of dequantizing them at every step.
    `into`: weights an earlier call resolved, whose stacked copies are rewritten in place (the same tensors, today's
    values) where the shapes still fit, so that CUDA graphs captured on them stay valid (`kept_runs.py`)."""
    ok, reason = supports(model)
    if not ok:
        raise ValueError(f"the built-in rollout engine cannot run this model: {reason}; use rollout.backend=hf.")
    adapted = hasattr(model, "peft_config")  # without peft no projection has an adapter: skip looking (host time)
    model = unwrap(model)
    config, inner = model.config, model.model
    layers = []
    for index, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        layers.append(LayerWeights(
            input_norm=layer.input_layernorm.weight,
            q_weight=attn.q_proj.weight, q_bias=_bias(attn.q_proj),
            k_weight=attn.k_proj.weight, k_bias=_bias(attn.k_proj),
            v_weight=attn.v_proj.weight, v_bias=_bias(attn.v_proj),
            o_weight=attn.o_proj.weight, o_bias=_bias(attn.o_proj),
            q_norm=q_norm.weight if q_norm is not None else None,
            k_norm=k_norm.weight if k_norm is not None else None,
            post_norm=layer.post_attention_layernorm.weight,
            gate_weight=mlp.gate_proj.weight, up_weight=mlp.up_proj.weight, down_weight=mlp.down_proj.weight,
            **{f"{short}_lora": _lora(layer.get_submodule(path)) for short, path in PROJECTIONS.items() if adapted},
        ))
        if index < dequantize_layers:
            layers[-1] = unpacked(layers[-1])
        earlier = into.layers[index] if into is not None and index < len(into.layers) else None
        fused = fused_qkv(layers[-1], earlier) if fuse_qkv else None
        if fused is not None:
            layers[-1].qkv_weight, layers[-1].qkv_bias = fused
        if fuse_gate_up:
            layers[-1].gate_up_weight = fused_gate_up(layers[-1], earlier)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelWeights(
        embed=inner.embed_tokens.weight, layers=layers, final_norm=inner.norm.weight,
        lm_head=model.lm_head.weight, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=head_dim, rms_eps=config.rms_norm_eps,
        sliding_window=_sliding_window(config),
    )
