"""Builds what a run needs from its config: device, models, optimizers, rollout backend, rewards, data.

Kept apart from the trainer so the loop holds no construction code, and so that every user error
(an invisible device, a missing data file, a bad reward spec) surfaces here, before training starts.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from hybridrl.config.schema import Config, ConfigError
from hybridrl.data.datasets import PromptDataset, read_records
from hybridrl.judge import JudgeReward
from hybridrl.models.loading import (
    HFModel,
    HostOffloadedWeights,
    ValueModel,
    compile_layers,
    disable_dropout,
    enable_activation_checkpointing,
    load_hf_model,
    make_reference,
)
from hybridrl.models.lora import AdapterDisabled, apply_lora
from hybridrl.models.qlora import quantize_4bit
from hybridrl.parallel import fsdp, process_group
from hybridrl.parallel.placement import resolve_placement
from hybridrl.rewards import RewardComposer, WeightedReward, load_reward_function
from hybridrl.rollout.base import RolloutBackend
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.kernel_choices import auto_compiles, light_rollout
from hybridrl.rollout.hf import HFBackend
from hybridrl.training.episodes import EPISODE_COLUMNS, EpisodeRollout, build_environment, build_episode_rollout
from hybridrl.training.graphed_pass import GraphedPass, build_graphed_pass
from hybridrl.training.optim import build_optimizer, build_scheduler
from hybridrl.training.shared_prompt import attention_problem, uses_flex_attention

logger = logging.getLogger(__name__)


@dataclass
class Components:
    device: torch.device
    actor: nn.Module
    tokenizer: Any
    pad_token_id: int
    reference: nn.Module | None
    critic: ValueModel | None
    actor_optimizer: torch.optim.Optimizer
    actor_scheduler: Any
    critic_optimizer: torch.optim.Optimizer | None
    critic_scheduler: Any
    rollout: RolloutBackend
    setup: process_group.DistributedSetup
    rewards: RewardComposer
    dataset: PromptDataset
    eval_dataset: PromptDataset | None
    reference_offload: HostOffloadedWeights | None = None  # `model.reference_offload`: weights on the host
    episodes: EpisodeRollout | None = None  # `env`: multi-turn episodes (`episodes.py`); None: one turn
    actor_graphs: GraphedPass | None = None  # `actor.cuda_graphs`: the update's pass as CUDA graphs; None: eager


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda if visible else cpu; a CUDA device that is not visible is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={env!r})" if env is not None else ""
        if visible == 0:
            raise ConfigError(f"trainer.device={name!r} but no CUDA device is visible{where}; "
                              "use trainer.device=cpu or auto.")
        if device.index is not None and device.index >= visible:
            raise ConfigError(f"trainer.device={name!r} but only {visible} CUDA device(s) are visible{where}; "
                              f"use an index below {visible}.")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_rewards(config: Config, reward_fn: str | Callable | list | None, device: torch.device) -> RewardComposer:
    r = config.reward
    if reward_fn is None:
        configured = r.functions or r.reward_model or r.judge_model
        if not configured and config.env.tools:
            raise ConfigError("env.tools runs the built-in tool environment, which gives no reward; set "
                              "reward.functions to score the episodes (e.g. [{fn: numeric_match}]).")
        if not configured and config.env.environment:
            return RewardComposer([WeightedReward("env_reward", load_reward_function("env_reward"), 1.0)])
        if not configured:
            raise ConfigError("no reward is configured; set reward.functions (e.g. [{fn: exact_match}]), "
                              "reward.reward_model or reward.judge_model, or pass reward_fn= in Python.")
        judge = [WeightedReward("judge", JudgeReward.from_config(r, device, config.trainer.seed), r.judge_weight)] \
            if r.judge_model else []  # built here: rewards.py sits below the rollout backends the judge uses
        return RewardComposer.from_config(r, device=device, extra=judge)
    items = reward_fn if isinstance(reward_fn, list) else [reward_fn]
    rewards = []
    for item in items:
        fn = load_reward_function(item) if isinstance(item, str) else item
        rewards.append(WeightedReward(getattr(fn, "__name__", str(item)), fn, 1.0))
    return RewardComposer(rewards)


def build_rollout(config: Config, actor: nn.Module, tokenizer: Any, device: torch.device) -> RolloutBackend:
    """`auto` takes the built-in engine where it supports the model, with one line saying why not."""
    backend = config.rollout.backend
    if backend in ("auto", "builtin"):
        supported, reason = BuiltinBackend.supports(actor)
        if supported and (backend == "builtin" or device.type == "cuda"):
            engine = config.rollout.engine
            # short prompts and responses: kernels that need no building in the first rollout (`light_rollout`)
            light = engine.attention == engine.sampler == engine.compile == "auto" and engine.kv_cache != "paged" \
                and light_rollout(config.rollout.max_new_tokens, config.data.max_prompt_length, device)
            # episodes grow by observations, which the per-slot KV layout allows (engine/multiturn.py)
            attention = "sdpa" if (config.env.enabled or light) and engine.attention == "auto" else engine.attention
            kv_cache = "contiguous" if config.env.enabled and engine.kv_cache == "auto" else engine.kv_cache
            return BuiltinBackend(actor, tokenizer=tokenizer, kv_cache_memory=config.rollout.kv_cache_memory,
                                  attention=attention, fuse_qkv=engine.fuse_qkv,
                                  fuse_gate_up=engine.fuse_gate_up, sampler="torch" if light else engine.sampler,
                                  dequantize_4bit=engine.dequantize_4bit, kv_cache=kv_cache,
                                  kv_block_size=engine.kv_block_size,
                                  compile=(auto_compiles(config.rollout.max_new_tokens, device)
                                           if engine.compile == "auto" else engine.compile))
        if backend == "builtin":
            logger.warning("rollout.backend=builtin falls back to hf: %s", reason)
    if backend == "vllm":
        from hybridrl.rollout.vllm import VLLMBackend
        return VLLMBackend(actor, tokenizer=tokenizer)
    return HFBackend(actor, tokenizer)


def check_reward_columns(rewards: RewardComposer, config: Config, dataset: PromptDataset | None,
                         eval_dataset: PromptDataset | None) -> None:
    """Every column the rewards read is in the training and held-out data, checked before any model loads (the
    files are read here once more: reading is cheap next to finding the gap at step 1). Multi-turn episodes add
    their trajectory columns (`episodes.EPISODE_COLUMNS`)."""
    extra = list(EPISODE_COLUMNS) if config.env.enabled else []
    sources = [(d, d.name) for d in (dataset, eval_dataset) if d is not None]
    sources += [(path, f"data file '{path}'") for path, given in ((config.data.train_path, dataset),
                                                                   (config.data.eval_path, eval_dataset))
                if path and given is None]
    for source, name in sources:
        if isinstance(source, PromptDataset):
            columns = list(dict.fromkeys(key for item in source.items for key in item["columns"]))
        else:
            columns = list(dict.fromkeys(key for row in read_records(source) for key in row
                                         if key != config.data.prompt_key))
        rewards.check_columns(columns + extra, name)


def build_components(config: Config, actor: HFModel | None = None, reward_fn: Any = None,
                     dataset: PromptDataset | None = None, eval_dataset: PromptDataset | None = None) -> Components:
    device = resolve_device(config.trainer.device)
    placement = resolve_placement(config.trainer.device_mesh, config.trainer.num_gpus, device.type)
    setup = process_group.init_from_env(device, placement.actor, hang_timeout_s=config.trainer.hang_timeout_s,
                                      shard_size=config.trainer.fsdp_shard_size)
    device = setup.device
    seed_everything(config.trainer.seed)
    rewards = build_rewards(config, reward_fn, placement.device("reward", setup.local_rank))  # cheap errors first
    check_reward_columns(rewards, config, dataset, eval_dataset)
    environment = build_environment(config)  # a bad environment or tool spec fails before the model loads
    m = config.model
    if actor is None:
        actor = load_hf_model(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                              trust_remote_code=m.trust_remote_code, device=device,
                              tokenizer_path=m.tokenizer_path, seed=config.trainer.seed, load_in_4bit=m.load_in_4bit)
    model, tokenizer = actor
    if config.actor.share_prompt_tokens and (problem := attention_problem(model, device)):
        raise ConfigError(problem)
    if config.actor.share_prompt_tokens and device.type == "cuda" and not uses_flex_attention(model):
        logger.warning("actor.share_prompt_tokens with %s attention builds a dense mask and computes every block of "
                       "the long shared rows; model.attn_implementation=flex_attention skips them (docs/training.md)",
                       getattr(model.config, "_attn_implementation", "?"))
    if device.type == "cuda" and config.rollout.num_samples_per_prompt >= 4 and not config.actor.share_prompt_tokens:
        logger.info("tip: actor.share_prompt_tokens=true with model.attn_implementation=flex_attention trains each "
                    "prompt once for its %d samples (docs/training.md)",
                    config.rollout.num_samples_per_prompt)
    if device.type == "cuda" and setup.world_size > 1 and config.actor.optimizer_offload:
        shards = config.trainer.fsdp_shard_size or setup.world_size
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info("tip: actor.optimizer_offload=false would keep this GPU's share of the AdamW moments on it "
                    "(%.1f GiB); with several GPUs the offloaded update is slower and varies more (docs/multi_gpu.md)",
                    8 * trainable / shards / 2**30)
    model.to(device)
    if m.load_in_4bit:  # a model passed in Python (or the benchmark's) is quantized here; a loaded one already is
        quantize_4bit(model)
    if dataset is None:
        if not config.data.train_path:
            raise ConfigError("data.train_path is empty; point it at a .jsonl/.csv/.parquet file of prompts.")
        dataset = PromptDataset.from_config(config.data, tokenizer, config.data.train_path, seed=config.trainer.seed)
    if eval_dataset is None and config.data.eval_path:
        eval_dataset = PromptDataset.from_config(config.data, tokenizer, config.data.eval_path, seed=config.trainer.seed)
    disable_dropout(model)
    if m.lora_rank:
        model = apply_lora(model, m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_target_modules)
    if m.gradient_checkpointing:
        enable_activation_checkpointing(model)  # non-reentrant in transformers 5: LoRA needs no input grads
        # transformers recomputes a layer only in train mode, and `from_pretrained` returns a model in eval mode: left
        # so, a loaded model would keep every activation. (A model built from a config, as in the tests, was always in
        # train mode; dropout is off, `disable_dropout` above.)
        model.train()
    model.config.use_cache = False
    reference = None
    if config.algorithm.kl_coef > 0:  # LoRA: the base is the adapter-disabled actor, no second copy
        reference = AdapterDisabled(model) if m.lora_rank else make_reference(model)
    a, total = config.actor, config.trainer.total_steps
    critic = None
    if config.algorithm.name == "ppo":  # copies are made before sharding
        critic_base = model if not config.critic.path else load_hf_model(config.critic.path, dtype=m.dtype, device=device).model
        critic = ValueModel(make_reference(critic_base).requires_grad_(True))
        disable_dropout(critic.backbone)  # a critic.path model has its own config; values stay one function too
        if m.gradient_checkpointing:  # the copy comes in eval mode, a critic.path model without it: as for the actor
            enable_activation_checkpointing(critic.backbone)
            critic.train()
        critic = fsdp.parallelize(critic.to(device), setup)
    if reference is not None and not m.lora_rank:
        reference = fsdp.parallelize(reference, setup)
    model = fsdp.parallelize(model, setup)
    if m.compile:
        compiled = sum(compile_layers(module) for module in (model, reference, critic)
                       if module is not None and not isinstance(module, AdapterDisabled))
        logger.info("model.compile: %d decoder layers compile during the first step (tens of seconds on a GPU)", compiled)
    actor_optimizer = build_optimizer(model.parameters(), a.lr, a.weight_decay, state_dtype=a.optimizer_state_dtype,
                                      offload=a.optimizer_offload_fraction if a.optimizer_offload else False,
                                      eight_bit=a.optimizer_8bit, seed=config.trainer.seed,
                                      master_weights=a.master_weights == "float32")
    critic_optimizer = critic_scheduler = None
    if critic is not None:
        critic_optimizer = build_optimizer(critic.parameters(), config.critic.lr, seed=config.trainer.seed + 1,
                                           master_weights=a.master_weights == "float32")
        critic_scheduler = build_scheduler(critic_optimizer, config.critic.lr_schedule, config.critic.warmup_steps, total)
    reference_offload = None
    if m.reference_offload and reference is not None:
        if m.lora_rank:
            logger.warning("model.reference_offload has no effect with LoRA: the reference is the actor with its "
                           "adapter disabled, not a second copy.")
        else:
            reference_offload = HostOffloadedWeights(reference, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rollout = build_rollout(config, model, tokenizer, device)
    return Components(
        device=device, actor=model, tokenizer=tokenizer, pad_token_id=pad_id, reference=reference, critic=critic,
        actor_optimizer=actor_optimizer, actor_scheduler=build_scheduler(actor_optimizer, a.lr_schedule, a.warmup_steps, total),
        critic_optimizer=critic_optimizer, critic_scheduler=critic_scheduler,
        rollout=rollout, setup=setup, rewards=rewards, dataset=dataset, eval_dataset=eval_dataset,
        reference_offload=reference_offload,
        episodes=build_episode_rollout(config, environment, tokenizer, rollout, pad_id, setup),
        actor_graphs=build_graphed_pass(config, model, device, setup.world_size))
