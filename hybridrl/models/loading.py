"""Loading policy, critic and reference models; built-in tiny models that need no download.

`load_hf_model` is the one entry point for Hugging Face checkpoints and for the built-in tiny
configurations (`tiny:llama`, `tiny:qwen2`, `tiny:qwen3`), which pair a small random model with a
character-level tokenizer so the whole pipeline runs on a laptop CPU with no model hub. A `+chat` suffix
(`tiny:llama+chat`) gives the tokenizer `CHAR_CHAT_TEMPLATE`, a one-character-per-role chat template with a
tool role, for multi-turn episodes.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError
from torch import nn

from hybridrl.models import qlora

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """A model or tokenizer that cannot be loaded as asked; the message says what to do."""


@dataclass
class HFModel:
    """A causal language model and its tokenizer. Unpacks as `model, tokenizer = load_hf_model(...)`."""

    model: nn.Module
    tokenizer: Any

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.tokenizer))


CHAR_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ 'A' + message['content'] + '<eos>' }}"
    "{%- elif message['role'] == 'tool' -%}{{ 'R' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'Q' + message['content'] + '\\n' }}"
    "{%- else -%}{{ 'S' + message['content'] + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}A{%- endif -%}")
"""The character tokenizer's chat template (`tiny:<family>+chat`): one letter opens each turn (S system, Q user,
A assistant, R tool result) and the assistant's turn ends with <eos>, its stop token. Short because every
character is a token of a tiny model; prefix-stable and verbatim, as `envs/rendering.py` requires. Tool schemas
are not shown (a tiny model learns its one tool from SFT data, not from a schema)."""


def build_char_tokenizer(extra_chars: str = "", chat_template: str | None = None) -> Any:
    """A character-level tokenizer over printable ASCII with <pad>, <eos>, <unk>: small, exact, offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for char in [chr(i) for i in range(32, 127)] + ["\n"] + list(extra_chars):
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_config(family: str, vocab_size: int, **overrides: Any) -> Any:
    """Small configs of the Llama family, for tests and the CPU demo."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    families = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if family not in families:
        raise ModelError(f"unknown tiny model family {family!r}; choose from {', '.join(families)} (e.g. tiny:llama).")
    extra = {"head_dim": 32} if family == "qwen3" else {}
    return families[family](**{**common, **extra, **overrides})


def build_tiny_model(family: str = "llama", seed: int = 0, **overrides: Any) -> HFModel:
    """A seeded random tiny model with the character tokenizer (with `CHAR_CHAT_TEMPLATE` for `<family>+chat`)."""
    from transformers import AutoModelForCausalLM

    family, _, variant = family.partition("+")
    if variant not in ("", "chat"):
        raise ModelError(f"unknown tiny model variant {variant!r}; the only one is +chat (e.g. tiny:llama+chat).")
    tokenizer = build_char_tokenizer(chat_template=CHAR_CHAT_TEMPLATE if variant else None)
    config = tiny_config(family, vocab_size=len(tokenizer), **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return HFModel(model, tokenizer)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelError(f"model.dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}.")
    return DTYPES[dtype]


def best_attention() -> str:
    """flash_attention_2 where the package is installed (and a GPU is there), else PyTorch SDPA."""
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_hf_model(path_or_name: str, dtype: str | torch.dtype = "auto", attn_implementation: str = "auto",
                  trust_remote_code: bool = False, model_class: Any = None, device: str | torch.device = "cpu",
                  tokenizer_path: str | None = None, seed: int = 0, load_in_4bit: bool = False) -> HFModel:
    """Load a causal LM and its tokenizer (or build a `tiny:<family>` one), on `device` in `dtype`;
    `load_in_4bit` gives its linear layers but the head frozen NF4 weights (`hybridrl/models/qlora.py`)."""
    torch_dtype = resolve_dtype(dtype, device)
    if path_or_name.startswith("tiny:"):
        loaded = build_tiny_model(path_or_name.split(":", 1)[1], seed=seed)
        loaded.model.to(device=device, dtype=torch_dtype)
        if load_in_4bit:
            qlora.quantize_4bit(loaded.model, torch_dtype)
        return loaded
    from transformers import AutoModelForCausalLM, AutoTokenizer

    attention = best_attention() if attn_implementation == "auto" else attn_implementation
    model_class = model_class or AutoModelForCausalLM
    # A hub id is "name" or "namespace/name"; more than one slash can only be a local path.
    looks_local = path_or_name.startswith((".", "/", "~")) or path_or_name.count("/") > 1 or Path(path_or_name).exists()
    if looks_local and not Path(path_or_name).expanduser().is_dir():
        raise ModelError(f"model path {path_or_name!r} does not exist; check model.path "
                         "(run `hybridrl sft` first if it is the demo's SFT model).")
    # 4-bit: transformers quantizes while loading, on the target device (a device_map is how it is told).
    quantized = dict(quantization_config=qlora.bnb_config(torch_dtype), device_map={"": torch.device(device)}) \
        if load_in_4bit else {}
    try:
        model = model_class.from_pretrained(path_or_name, dtype=torch_dtype, attn_implementation=attention,
                                            trust_remote_code=trust_remote_code, **quantized)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or path_or_name, trust_remote_code=trust_remote_code)
    except OSError as error:
        raise ModelError(f"could not load model {path_or_name!r}: {error}. Give a local directory with "
                         "config.json and weights, or a hub name reachable from this machine.") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # decoder-only models often ship without a pad token
    return HFModel(model.to(device), tokenizer)


def save_hf_model(model: nn.Module, tokenizer: Any, path: str | Path, state_dict: dict | None = None) -> None:
    """Write a Hugging Face directory (safetensors, config, tokenizer) that `from_pretrained` loads.

    Written to a temporary directory beside `path` and renamed into place, so a failed save (a full disk)
    leaves no config files without weights, and an existing `path` is replaced only by a complete one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".tmp-{path.name}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        model.save_pretrained(temporary, safe_serialization=True,
                              **({"state_dict": state_dict} if state_dict is not None else {}))
        tokenizer.save_pretrained(temporary)
    except (OSError, SafetensorError) as error:
        shutil.rmtree(temporary, ignore_errors=True)
        tensors = (state_dict if state_dict is not None else model.state_dict()).values()
        raise ModelError(write_failure(path, error, sum(t.numel() * t.element_size() for t in tensors))) from None
    if path.exists():
        old = path.parent / f".old-{path.name}-{os.getpid()}"
        os.rename(path, old)
        os.rename(temporary, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(temporary, path)


def write_failure(path: Path, error: BaseException | str, needed_bytes: int) -> str:
    """One sentence for a write that failed (a full disk, a read-only or vanished filesystem): the path, the
    error, the space the write needs and the space free there."""
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    return (f"writing {path} failed ({error}): it needs about {needed_bytes / 2**30:.2f} GiB and "
            f"{free / 2**30:.2f} GiB are free there; free some space (or point trainer.output_dir elsewhere) and "
            "run again")


class ValueModel(nn.Module):
    """Critic: the policy's transformer backbone with a scalar value head instead of the LM head."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.backbone = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else causal_lm.base_model
        hidden = causal_lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)  # start from V = 0: no spurious advantage signal at step 0
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(device=next(self.backbone.parameters()).device,
                           dtype=next(self.backbone.parameters()).dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids).last_hidden_state  # (B, L, H)
        return self.value_head(hidden).squeeze(-1).float()  # (B, L)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """`model.gradient_checkpointing` on a HF model: transformers 5.2x renamed `gradient_checkpointing_enable` to
    `activation_checkpointing_enable` (the old name warns on every run); earlier 5.x have only the old one."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def disable_dropout(model: nn.Module) -> None:
    """Dropout off in a policy, whatever mode it is in: PPO's ratio, the old log-probs and the rollout's behaviour
    log-probs all compare evaluations of one function, and a random mask per forward would make an on-policy ratio
    differ from 1 (the actor runs in train mode for activation checkpointing). Sets every `nn.Dropout`'s p and every
    attention module's `attention_dropout` (how Hugging Face attention reads it) to 0. Call it before LoRA is
    applied, so an adapter's own `lora_dropout`, which the user sets, is left as asked."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def make_reference(model: nn.Module) -> nn.Module:
    """A frozen copy of the policy for the KL term (LoRA runs use the adapter-disabled base instead)."""
    reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    return reference


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face model: modules whose class is named in `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    # FSDP2 swaps a sharded module's class for a subclass named FSDP<Name>, so match the whole MRO
    return [module for module in model.modules() if any(cls.__name__ in names for cls in type(module).__mro__)]


def decoder_hidden_states(model: nn.Module, input_ids, attention_mask, position_ids, **attention_options) -> torch.Tensor:
    """Last hidden states of a causal LM's decoder: (B, L, H). `attention_options` (e.g. FlexAttention's
    `kernel_options`) reach the attention function through transformers' keyword arguments."""
    return model.get_decoder()(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False, **attention_options).last_hidden_state


def compile_layers(model: nn.Module) -> int:
    """torch.compile each decoder layer in place (`model.compile`); returns how many were compiled.

    Per layer rather than the whole model: the graphs are small and identical, FSDP2's per-layer hooks
    stay outside them, and the LM head (chunked in `logprobs.py`) and the rollout engine are untouched.
    """
    missing = compile_prerequisite_missing(next(model.parameters()).device)
    if missing:
        raise ModelError(f"model.compile needs {missing}; install it or set model.compile=false.")
    layers = decoder_layers(model)
    if not layers:
        raise ModelError(f"model.compile found no decoder layers in {type(model).__name__} (no class named in "
                         "`_no_split_modules`); set model.compile=false for this model.")
    for layer in layers:
        layer.compile()
    return len(layers)


def compile_prerequisite_missing(device: torch.device) -> str | None:
    """What torch.compile's default backend (inductor) lacks on `device`, checked before the first step
    (it would otherwise fail deep inside the first forward): triton on CUDA, a C++ compiler on CPU."""
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") else "triton on CUDA (pip install triton)"
    if device.type == "cpu" and not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        return "a C++ compiler on CPU (g++ or clang++)"
    return None


class HostOffloadedWeights:
    """A frozen model whose parameters live in CPU memory (pinned when a GPU is the target) and visit
    `device` only inside `on_device()` (`model.reference_offload`).

    Frozen means nothing is copied back: leaving the block just points each parameter at its host copy
    again and the device copies are freed. Buffers (rotary tables, small) stay where they are."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device
        pin = device.type == "cuda"
        self.host = {param: param.detach().to("cpu", copy=True) for param in model.parameters()}
        if pin:
            self.host = {param: host.pin_memory() for param, host in self.host.items()}
        for param, host in self.host.items():
            param.data = host

    @contextmanager
    def on_device(self) -> Iterator[None]:
        for param, host in self.host.items():
            param.data = host.to(self.device, non_blocking=True, copy=True)
        try:
            yield
        finally:
            for param, host in self.host.items():
                param.data = host
