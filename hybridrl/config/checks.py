"""Config validation: ranges and cross-field consistency, all in one place.

`build_config` calls `validate` on every config it builds, so each mistake is reported with its dotted key
and how to fix it, before any model is loaded.
"""

from __future__ import annotations

import string

import torch

from hybridrl.config.schema import Config, ConfigError


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


JUDGE_PLACEHOLDERS = ("prompt", "response", "reference")


def judge_template_problem(template: str) -> str | None:
    """One sentence saying what is wrong with a judge prompt template, or None when it is usable: it must hold
    `{response}` and no placeholder but {prompt}, {response}, {reference} (literal braces are written {{ }})."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        return f"the judge template has unbalanced braces ({error}); write a literal brace as {{{{ or }}}}."
    unknown = sorted({name for name in fields if name not in JUDGE_PLACEHOLDERS})
    if unknown:
        return (f"the judge template has unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}; "
                "use only {prompt}, {response} and {reference} (a literal brace is written {{ or }}).")
    if "response" not in fields:
        return "the judge template has no {response} placeholder, so the judge would never see the response; add it."
    return None


def validate(config: Config) -> None:
    r, a, act, t = config.rollout, config.algorithm, config.actor, config.trainer
    _require(r.num_samples_per_prompt >= 1, "rollout.num_samples_per_prompt must be at least 1.")
    _require(r.max_new_tokens >= 1, "rollout.max_new_tokens must be at least 1.")
    _require(r.temperature >= 0, "rollout.temperature must be >= 0 (0 is greedy).")
    _require(r.eval_temperature >= 0, "rollout.eval_temperature must be >= 0 (0 is greedy).")
    _require(config.eval.num_samples >= 1, "eval.num_samples must be at least 1.")
    _require(config.eval.num_samples == 1 or r.eval_temperature > 0,
             f"eval.num_samples={config.eval.num_samples} samples each held-out prompt several times, but "
             "rollout.eval_temperature=0 (greedy) makes every sample the same; set rollout.eval_temperature "
             "(e.g. 0.7) or eval.num_samples=1.")
    _require(0 < r.top_p <= 1, "rollout.top_p must be in (0, 1].")
    _require(r.top_k >= 0, "rollout.top_k must be >= 0 (0 disables).")
    _require(0 <= r.min_p < 1, "rollout.min_p must be in [0, 1).")
    _require(r.kv_cache_memory > 0, "rollout.kv_cache_memory must be > 0.")
    _require(r.engine.attention in ("auto", "triton", "sdpa"),
             f"rollout.engine.attention must be auto, triton or sdpa; got {r.engine.attention!r}.")
    _require(r.engine.kv_cache in ("auto", "paged", "contiguous"),
             f"rollout.engine.kv_cache must be auto, paged or contiguous; got {r.engine.kv_cache!r}.")
    _require(r.engine.kv_block_size >= 1, "rollout.engine.kv_block_size must be at least 1 (tokens per block).")
    _require(config.data.max_prompt_length >= 1, "data.max_prompt_length must be at least 1.")
    _require(0 <= a.clip_ratio_low < 1, "algorithm.clip_ratio_low must be in [0, 1).")
    _require(a.clip_ratio_high >= 0, "algorithm.clip_ratio_high must be >= 0.")
    _require(a.dual_clip is None or a.dual_clip > 1, "algorithm.dual_clip must be > 1 (e.g. 3.0) or null.")
    _require(not (a.mask_truncated and r.ignore_eos),
             "algorithm.mask_truncated leaves responses cut at rollout.max_new_tokens out of the loss, and "
             "rollout.ignore_eos=true cuts every one of them; turn one of the two off.")
    _require(not a.drop_uniform_groups or r.num_samples_per_prompt > 1,
             "algorithm.drop_uniform_groups compares the samples of a prompt, so it needs "
             "rollout.num_samples_per_prompt > 1.")
    _require(not a.dynamic_sampling or r.num_samples_per_prompt > 1,
             "algorithm.dynamic_sampling compares the samples of a prompt, so it needs "
             "rollout.num_samples_per_prompt > 1.")
    _require(a.name != "remax" or (r.eval_temperature == 0 and not a.dynamic_sampling and t.max_staleness == 0),
             "algorithm.name=remax takes its baseline from a greedy rollout of the step's own prompts: it needs "
             "rollout.eval_temperature=0, algorithm.dynamic_sampling=false and trainer.max_staleness=0.")
    _require(a.dynamic_sampling_max_rounds >= 1,
             "algorithm.dynamic_sampling_max_rounds must be at least 1 (generation rounds per step, the first included).")
    _require(a.rollout_correction_cap is None or a.rollout_correction_cap >= 1,
             "algorithm.rollout_correction_cap must be >= 1 (e.g. 2.0) or null.")
    _require(a.rollout_sequence_mask_threshold is None or a.rollout_sequence_mask_threshold > 1,
             "algorithm.rollout_sequence_mask_threshold must be > 1 (e.g. 2.0) or null.")
    _require(a.policy_loss in ("ppo", "cispo", "gmpo", "sapo"),
             f"algorithm.policy_loss must be ppo, cispo, gmpo or sapo; got {a.policy_loss!r}.")
    _require(a.sapo_temperature_positive > 0 and a.sapo_temperature_negative > 0,
             "algorithm.sapo_temperature_positive and algorithm.sapo_temperature_negative must be > 0.")
    _require(a.ratio_level == "token" or a.policy_loss == "ppo",
             f"algorithm.ratio_level=sequence (GSPO) works with algorithm.policy_loss=ppo only, not "
             f"{a.policy_loss!r}; set ratio_level=token.")
    _require(a.dual_clip is None or a.policy_loss == "ppo",
             f"algorithm.dual_clip applies to algorithm.policy_loss=ppo only, not {a.policy_loss!r}; set it to null.")
    _require(0 <= a.gamma <= 1, "algorithm.gamma must be in [0, 1].")
    _require(0 <= a.lam <= 1, "algorithm.lam must be in [0, 1].")
    _require(a.kl_coef >= 0, "algorithm.kl_coef must be >= 0.")
    _require(a.value_clip > 0, "algorithm.value_clip must be > 0.")
    if a.name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        _require(r.num_samples_per_prompt >= 2,
                 f"algorithm.name={a.name!r} compares samples of the same prompt, so "
                 "rollout.num_samples_per_prompt must be at least 2.")
    for section, opt in (("actor", act), ("critic", config.critic)):
        _require(opt.lr > 0, f"{section}.lr must be > 0.")
        _require(opt.warmup_steps >= 0, f"{section}.warmup_steps must be >= 0.")
        _require(opt.max_grad_norm >= 0, f"{section}.max_grad_norm must be >= 0 (0 disables clipping).")
    _require(act.ppo_epochs >= 1, "actor.ppo_epochs must be at least 1.")
    _require(act.micro_batch_size >= 1, "actor.micro_batch_size must be at least 1.")
    _require(act.max_tokens_per_micro_batch >= 0, "actor.max_tokens_per_micro_batch must be >= 0 (0 disables).")
    _require(not (act.share_prompt_tokens and "flash" in config.model.attn_implementation),
             f"actor.share_prompt_tokens needs an attention that takes a mask, and model.attn_implementation="
             f"{config.model.attn_implementation!r} takes none; use flex_attention (or sdpa).")
    _require(0 < act.optimizer_offload_fraction <= 1, "actor.optimizer_offload_fraction must be in (0, 1] "
             "(the share of the AdamW state kept in CPU memory; actor.optimizer_offload=false keeps none there).")
    _require(act.optimizer_offload or act.optimizer_offload_fraction == 1,
             "actor.optimizer_offload_fraction applies only with actor.optimizer_offload=true; set that too.")
    _require(not (act.optimizer_8bit and act.optimizer_offload),
             "actor.optimizer_8bit and actor.optimizer_offload cannot both be true; choose one way to save memory.")
    _require(act.master_weights in ("none", "float32"),
             f"actor.master_weights must be none or float32; got {act.master_weights!r}.")
    _require(act.master_weights == "none" or (act.optimizer_state_dtype == "float32" and not act.optimizer_8bit),
             "actor.master_weights=float32 keeps float32 AdamW state beside the master copy, so it needs "
             "actor.optimizer_state_dtype=float32 and actor.optimizer_8bit=false; change those or set master_weights=none.")
    _require(config.model.lora_rank >= 0, "model.lora_rank must be >= 0 (0 trains all parameters).")
    _require(not (config.model.reference_offload and config.trainer.num_gpus > 1),
             "model.reference_offload works with one process only for now (a sharded reference is already split "
             "across GPUs); set model.reference_offload=false or trainer.num_gpus=1.")
    _require(config.model.lora_rank == 0 or config.model.lora_alpha > 0, "model.lora_alpha must be > 0.")
    validate_4bit(config)
    validate_env(config)
    _require(t.total_steps >= 1, "trainer.total_steps must be at least 1.")
    _require(t.prompts_per_step >= 1, "trainer.prompts_per_step must be at least 1.")
    _require(t.eval_every >= 0, "trainer.eval_every must be >= 0.")
    _require(t.save_every >= 0, "trainer.save_every must be >= 0 (0 saves only on SIGINT/SIGTERM).")
    _require(t.keep_last_n >= 0, "trainer.keep_last_n must be >= 0 (0 keeps every checkpoint).")
    _require(bool(t.resume), "trainer.resume must be auto, off, or the path of a checkpoint.")
    _require(t.device == "auto" or t.device == "cpu" or t.device.startswith("cuda"),
             f"trainer.device must be auto, cpu, cuda or cuda:N; got {t.device!r}.")
    batch = config.rollout_batch_size
    mini = act.mini_batch_size or batch
    _require(t.num_gpus >= 1, "trainer.num_gpus must be at least 1.")
    _require(t.fsdp_shard_size >= 0 and (t.fsdp_shard_size == 0 or t.num_gpus % t.fsdp_shard_size == 0),
             f"trainer.fsdp_shard_size={t.fsdp_shard_size} must be 0 (shard over all GPUs), 1 (replicate) or a divisor "
             f"of trainer.num_gpus={t.num_gpus}.")
    _require(t.hang_timeout_s > 0, "trainer.hang_timeout_s must be > 0.")
    _require(t.max_staleness >= 0, "trainer.max_staleness must be >= 0 (0: synchronous; k: rollout runs up to k "
             "updates behind the trainer).")
    _require(t.max_staleness == 0 or t.num_gpus == 1 or t.rollout_worker == "process",
             f"trainer.max_staleness > 0 with trainer.num_gpus={t.num_gpus} needs the rollout worker in a process of "
             "its own beside the training processes; set trainer.rollout_worker=process (or trainer.num_gpus=1).")
    _require(t.max_staleness == 0 or t.num_gpus == 1 or not config.model.lora_rank,
             "trainer.max_staleness > 0 with several training processes gives the rollout process a plain copy of "
             "the model, which is not built for LoRA adapters; set model.lora_rank=0, trainer.num_gpus=1 or "
             "trainer.max_staleness=0.")
    _require(t.max_staleness == 0 or t.num_gpus == 1 or not a.dynamic_sampling,
             "algorithm.dynamic_sampling with trainer.max_staleness > 0 is built for one training process; set "
             "trainer.num_gpus=1, algorithm.dynamic_sampling=false or trainer.max_staleness=0.")
    validate_rollout_device(config)
    validate_partial_rollout(config)
    _require(mini % t.num_gpus == 0,
             f"trainer.num_gpus={t.num_gpus} must divide actor.mini_batch_size={mini} (each process takes an equal "
             "share of every mini-batch); change actor.mini_batch_size or trainer.prompts_per_step.")
    _require(batch % mini == 0,
             f"actor.mini_batch_size={mini} must divide the rollout batch of {batch} sequences "
             f"(trainer.prompts_per_step={t.prompts_per_step} x rollout.num_samples_per_prompt="
             f"{r.num_samples_per_prompt}).")
    _require(mini % act.micro_batch_size == 0 or act.micro_batch_size >= mini,
             f"actor.micro_batch_size={act.micro_batch_size} must divide actor.mini_batch_size={mini}.")
    for i, spec in enumerate(config.reward.functions):
        _require(bool(spec.fn), f"reward.functions[{i}].fn is empty; name a built-in reward or file.py:function.")
    if config.reward.judge_model:
        _require((problem := judge_template_problem(config.reward.judge_template)) is None,
                 f"reward.judge_template: {problem}")
        _require(config.reward.judge_max_new_tokens >= 1, "reward.judge_max_new_tokens must be at least 1.")
        _require(len(config.reward.judge_answer_words) == 2 and all(config.reward.judge_answer_words),
                 "reward.judge_answer_words must be two non-empty words, the yes answer then the no answer "
                 "(e.g. [Yes, No]).")
    for sink in config.logging.sinks:
        _require(sink in ("console", "jsonl", "tensorboard", "wandb"),
                 f"logging.sinks has unknown sink {sink!r}; choose from console, jsonl, tensorboard, wandb.")
    s = config.sft
    _require(s.num_epochs >= 1 and s.batch_size >= 1, "sft.num_epochs and sft.batch_size must be at least 1.")
    _require(s.lr > 0, "sft.lr must be > 0.")


def validate_rollout_device(config: Config) -> None:
    """Where the asynchronous rollout worker runs: `trainer.device_mesh.rollout` (its indices are checked with the
    other roles', `parallel/placement.py`) or `trainer.rollout_device` (a device name, `cpu` included), which this
    process must see."""
    t = config.trainer
    in_mesh = "rollout" in (t.device_mesh or {})
    _require(not (in_mesh and t.rollout_device),
             f"trainer.rollout_device={t.rollout_device!r} and trainer.device_mesh.rollout both place the rollout "
             "worker; keep trainer.device_mesh.rollout and set trainer.rollout_device=\"\".")
    _require(not in_mesh or t.max_staleness > 0,
             "trainer.device_mesh.rollout gives generation a device of its own, which only the asynchronous pipeline "
             "does (the synchronous loop generates with the actor's weights in place); set trainer.max_staleness > 0 "
             "(e.g. 1) or remove trainer.device_mesh.rollout.")
    device = t.rollout_device
    if not device:
        return
    _require(t.max_staleness > 0,
             f"trainer.rollout_device={device!r} places the rollout worker, which runs only with trainer.max_staleness "
             f"> 0 (got {t.max_staleness}); set trainer.max_staleness=1 or trainer.rollout_device=\"\".")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    visible = torch.cuda.device_count()
    _require(parsed is not None and (parsed.type == "cpu" or (parsed.type == "cuda" and (parsed.index or 0) < visible)),
             f"trainer.rollout_device={device!r} is not a device this process can see ({visible} CUDA device(s) "
             f"visible, CUDA_VISIBLE_DEVICES renumbers them); use cpu or cuda:N with N below {visible}, or \"\" "
             "for the trainer's device.")


def validate_partial_rollout(config: Config) -> None:
    """`trainer.partial_rollout`: built for the thread worker's single-turn, one-round batches."""
    t = config.trainer
    if t.partial_rollout == "off":
        return
    key = f"trainer.partial_rollout={t.partial_rollout}"
    _require(t.max_staleness > 0, f"{key} takes newer weights over in the middle of a batch, which only happens with "
             "trainer.max_staleness > 0; set trainer.max_staleness=1 or trainer.partial_rollout=off.")
    problems = {"trainer.rollout_worker=process": t.rollout_worker == "process",
                "env: episodes": config.env.enabled, "algorithm.dynamic_sampling": config.algorithm.dynamic_sampling,
                "rollout.stop_strings (a stop string may span two segments)": bool(config.rollout.stop_strings)}
    for what, present in problems.items():
        _require(not present, f"{key} is built for the thread worker's single-turn batches, not with {what}; set "
                 "trainer.partial_rollout=off or leave that setting out.")


def validate_4bit(config: Config) -> None:
    """`model.load_in_4bit`: only the adapter can train, and on one process."""
    m = config.model
    if not m.load_in_4bit:
        return
    _require(m.lora_rank > 0, "model.load_in_4bit=true freezes the base in 4-bit, so it needs an adapter to train: "
                              "set model.lora_rank > 0 (e.g. 16), or model.load_in_4bit=false.")
    _require(config.trainer.num_gpus == 1, "model.load_in_4bit works with one process only (FSDP2 sharding loses "
                                           "bitsandbytes' 4-bit quantization state); set trainer.num_gpus=1.")
    _require(not (config.algorithm.name == "ppo" and not config.critic.path),
             "model.load_in_4bit with algorithm.name=ppo needs critic.path (a full-precision model for the critic): "
             "the critic is otherwise a trainable copy of the actor, whose 4-bit weights cannot train.")


def validate_env(config: Config) -> None:
    """`env`: multi-turn episodes, on when `env.environment` or `env.tools` is set."""
    e = config.env
    _require(not (e.environment and e.tools),
             f"env.environment={e.environment!r} and env.tools={e.tools!r} are both set; give your own environment or "
             "the built-in tool environment's tools, not both.")
    _require(not e.environment or ":" in e.environment,
             f"env.environment={e.environment!r} must be path/to/file.py:Name (the class or function that makes one "
             "environment from a data row).")
    for i, spec in enumerate(e.tools):
        _require(isinstance(spec, str) and (spec == "python" or ":" in spec),
                 f"env.tools[{i}]={spec!r} must be path/to/file.py:function or python (the built-in sandboxed tool).")
    _require(bool(e.tool_call_start) and bool(e.tool_call_end) and e.tool_call_start != e.tool_call_end,
             f"env.tool_call_start={e.tool_call_start!r} and env.tool_call_end={e.tool_call_end!r} must be two "
             "different, non-empty tags.")
    _require(e.tool_timeout_s > 0, "env.tool_timeout_s must be > 0 (seconds one tool call may run).")
    _require(e.num_tool_workers >= 1, "env.num_tool_workers must be at least 1.")
    _require(e.max_turns >= 1, "env.max_turns must be at least 1.")
    _require(e.max_observation_tokens >= 1, "env.max_observation_tokens must be at least 1.")
    _require(e.max_episode_tokens >= 2, "env.max_episode_tokens must be at least 2.")
    if not e.enabled:
        return
    _require(config.rollout.backend != "vllm",
             "rollout.backend=vllm cannot generate multi-turn episodes (env.environment or env.tools is set); use "
             "rollout.backend=builtin, hf or auto.")
    _require(config.trainer.max_staleness == 0 or config.trainer.num_gpus == 1,
             "trainer.max_staleness > 0 with several training processes runs single-turn rollouts only for now (the "
             "rollout process would make every rank's episodes as one process); use trainer.num_gpus=1 or "
             "trainer.max_staleness=0 with env.environment or env.tools.")
    _require(config.rollout.engine.attention != "triton",
             "rollout.engine.attention=triton keeps one response per KV slot and cannot continue an episode with "
             "observations; use rollout.engine.attention=auto or sdpa with env.environment or env.tools.")
