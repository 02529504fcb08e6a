"""Typed run configuration: one dataclass per concern, each field documented once.

A YAML file, dotted `key=value` overrides on the command line and keyword arguments in Python are
three spellings of one thing: each becomes a nested dict that `build_config` turns into a `Config`.
Every mistake a user can make here (unknown key, wrong type, value out of range, batch sizes that do
not divide) is reported by `ConfigError` with the dotted key, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import yaml


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the key and the fix."""


class MissingExtra(ImportError):
    """An optional package a chosen setting needs is not installed; the message names what to install."""


@dataclass
class ModelConfig:
    path: str = "tiny:llama"
    """Hugging Face model name or local directory; `tiny:<family>` builds a small random model from a
    built-in config (families: llama, qwen2, qwen3) with no download."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype; `auto` is bfloat16 on GPU and float32 on CPU."""
    attn_implementation: str = "auto"
    """`auto` picks flash_attention_2 when installed, else sdpa; any transformers value is accepted."""
    trust_remote_code: bool = False
    """Allow model code shipped with the checkpoint to run (only for models you trust)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    compile: bool = False
    """torch.compile each decoder layer for the training and log-prob passes (fuses norms, rotary and
    activations; the rollout engine is unaffected). The first step pays the compile time (tens of seconds)."""
    reference_offload: bool = False
    """Keep the frozen reference model (algorithm.kl_coef > 0, full-parameter runs) in pinned CPU memory and
    copy it to the GPU only for its log-prob pass each step: its weights (2 bytes per parameter in bf16)
    leave the GPU outside that pass, for one host-to-device copy per step. One process only for now."""
    tokenizer_path: str | None = None
    """Tokenizer location when it differs from `path`."""
    lora_rank: int = 0
    """LoRA rank through peft (`pip install 'hybridrl[peft]'`); 0 trains all parameters. With LoRA the
    reference model is the actor with its adapter disabled, so no second copy of the weights exists."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator: the adapter's update is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch; keep 0 in RL so old and new log-probs come from the same function."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names that get adapters (e.g. [q_proj, v_proj]); `all-linear` is every linear layer but the LM head."""
    load_in_4bit: bool = False
    """QLoRA: load the base's linear layers (all but the LM head) as frozen 4-bit NF4 weights through bitsandbytes
    (`pip install 'hybridrl[qlora]'`) and train only the LoRA adapter, so the base takes about a quarter of its
    bf16 memory. Needs model.lora_rank > 0. Refused with trainer.num_gpus > 1 (FSDP2 sharding loses bitsandbytes'
    quantization state) and with algorithm.name=ppo without critic.path (the critic would be a trainable copy of
    the 4-bit base). On GPU the built-in engine generates from the 4-bit base (see
    rollout.engine.dequantize_4bit); on CPU rollouts run on the hf backend."""


@dataclass
class DataConfig:
    train_path: str = ""
    """Prompts for training: .jsonl, .csv, .parquet, or a saved Hugging Face `datasets` directory."""
    eval_path: str | None = None
    """Held-out prompts, evaluated every `trainer.eval_every` steps."""
    prompt_key: str = "prompt"
    """Column holding the prompt text; every other column is passed to reward functions."""
    response_key: str = "response"
    """Column holding the target text (SFT only)."""
    max_prompt_length: int = 512
    """Prompts longer than this many tokens are dropped, and the count is reported."""
    prompt_template: str | None = None
    """Format string applied to the prompt, e.g. "Question: {prompt}\\nAnswer:"; overrides the chat template."""
    use_chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by `trainer.seed`)."""
    max_eval_samples: int | None = None
    """Evaluate on at most this many held-out prompts."""
    answer_key: str | None = "answer"
    """Column holding each prompt's reference answer: `eval/accuracy` is the share of held-out prompts whose
    stripped completion equals it (RL and SFT). Data without this column logs reward means only."""


@dataclass
class EngineConfig:
    """Advanced: kernel choices of the built-in engine (`rollout.backend=builtin`, or `auto` where it runs). The
    defaults pick by device and model; change one to work around a problem on your hardware, or to compare."""

    attention: Literal["auto", "triton", "sdpa"] = "auto"
    """Decode attention. `triton`: each prompt's KV is stored once and shared by its samples, read by a Triton
    kernel (on CPU by its PyTorch reference); `sdpa`: a KV copy per sequence and PyTorch SDPA, which fits fewer
    sequences in the same memory; `auto`: triton on CUDA when triton is installed, else sdpa (and sdpa, with the
    PyTorch sampler, for light rollouts: short prompts and responses, `kernel_choices.light_rollout`)."""
    fuse_qkv: bool = True
    """Copy each layer's q/k/v weights into one matrix while generating: one matmul instead of three, and with
    `triton` attention (and no q/k norm) the kernel adds bias and RoPE itself. Costs the q/k/v weights again during
    the rollout; set false when that memory is short. LoRA'd projections stay apart."""
    fuse_gate_up: bool | Literal["auto"] = "auto"
    """Likewise stack each layer's MLP gate and up weights into one matrix while generating (one matmul instead of
    two). Costs those weights again during the rollout; `auto` stacks them on CUDA when the copy is at most 5% of
    the GPU's memory. LoRA'd projections stay separate."""
    sampler: Literal["auto", "torch"] = "auto"
    """`auto`: plain temperature sampling (no top-k/top-p/min-p) runs as two Triton kernels on CUDA with triton,
    anything else in the (compiled) PyTorch sampler; `torch`: always the PyTorch sampler."""
    dequantize_4bit: bool | Literal["auto"] = "auto"
    """With a 4-bit base (`model.load_in_4bit`): make a full-precision copy of the base's projection weights for each
    rollout, so decode steps run as for a bf16 base (CUDA graphs included) instead of dequantizing every layer at
    every step. Costs that copy during the rollout; `auto` copies as many layers as fit in half of the free GPU
    memory, the others are dequantized as they run; false keeps the rollout's memory at the 4-bit size."""
    kv_cache: Literal["auto", "paged", "contiguous"] = "auto"
    """KV cache layout. `paged`: fixed-size blocks that sequences take as they grow and give back as they finish
    (prompt blocks shared by the samples; sequences are admitted by free blocks, and the youngest are preempted when
    blocks run out: they keep their tokens, and their context is prefilled again when re-admitted), so uneven
    response lengths fit many more sequences in `rollout.kv_cache_memory`; `contiguous`: room for the longest
    response in every slot; `auto`: contiguous (see docs/rollout.md)."""
    kv_block_size: int = 64
    """Tokens per block of the paged KV cache."""
    compile: bool | Literal["auto"] = "auto"
    """`torch.compile` the decode step's per-layer pieces, the prefill's layer and the sampler (CUDA graphs are
    captured either way). Compiling costs seconds once per process, in the first rollout, and saves a little on
    every decode step after; `auto` compiles on CUDA for responses of at least 64 tokens
    (`kernel_choices.auto_compiles`: short responses take too few decode steps to repay it)."""


@dataclass
class RolloutConfig:
    backend: Literal["auto", "hf", "builtin", "vllm"] = "auto"
    """Generation engine; `auto` is the built-in engine where it supports the model, else `hf`."""
    num_samples_per_prompt: int = 8
    """Responses sampled for each prompt (the group size of GRPO/RLOO)."""
    max_new_tokens: int = 256
    """Longest response; longer ones are cut and count as truncated."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one."""
    stop_strings: list[str] = field(default_factory=list)
    """Generation stops after any of these strings (the end-of-sequence token always stops)."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens for every response (benchmarks); explicit stop strings still stop."""
    eval_temperature: float = 0.0
    """Sampling temperature for evaluation; 0 is greedy."""
    kv_cache_memory: float = 0.3
    """Built-in engine: KV cache size as a fraction of free device memory (or GiB if > 1)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Advanced: the built-in engine's kernel choices (`rollout.engine.attention` and so on)."""

    moved_keys: ClassVar[dict[str, str]] = {key: f"engine.{key}" for key in
                                            ("attention", "fuse_qkv", "fuse_gate_up", "dequantize_4bit")}
    """Keys that moved into `rollout.engine`: a config that still sets one is told the new key."""


@dataclass
class RewardSpec:
    fn: str = ""
    """A built-in reward name (exact_match, numeric_match, format, length_penalty; for multi-turn episodes
    env_reward, the environment's own reward, and called_tool, whether the episode called a tool) or
    `file.py:function`."""
    weight: float = 1.0
    """Weight of this reward in the total."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the function."""


@dataclass
class RewardConfig:
    functions: list[RewardSpec] = field(default_factory=list)
    """Reward functions, summed with their weights; each is logged as `reward/<name>`."""
    reward_model: str | None = None
    """Hugging Face sequence-classification model scoring decoded text (its own tokenizer)."""
    reward_model_weight: float = 1.0
    """Weight of the reward model's score in the total."""
    judge_model: str | None = None
    """Hugging Face causal LM (a path or hub name, or `tiny:<family>`) asked to judge each response: a generative
    judge reward (`hybridrl/judge.py`), logged as `reward/judge`, on the reward device (the actor's by default)."""
    judge_template: str = ("Question: {prompt}\nReference answer: {reference}\nResponse: {response}\n"
                           "Is the response correct? Answer Yes or No.\nAnswer:")
    """The judge's prompt: must hold {response}; may hold {prompt} and {reference} (the column judge_reference_key)."""
    judge_parse: Literal["number", "scale", "yes_no"] = "yes_no"
    """How the judge's answer becomes a score: `number` the final number of its greedy text; `scale` the last integer
    1..10 of its text as (s - 1) / 9; `yes_no` P(yes) / (P(yes) + P(no)) from its next-token log-probs (no text)."""
    judge_parse_failure_score: float = 0.0
    """The score of a judge text that holds no number (or no 1..10); such texts are counted in
    `reward/judge_parse_failures`."""
    judge_weight: float = 1.0
    """Weight of the judge's score in the total."""
    judge_max_new_tokens: int = 32
    """Tokens the judge may write in the number and scale modes."""
    judge_reference_key: str = "answer"
    """The data column filled in for {reference}."""
    judge_answer_words: list[str] = field(default_factory=lambda: ["Yes", "No"])
    """yes_no: the yes word then the no word; each word's probability after the template is that of its first token,
    with and without a leading space."""
    judge_use_chat_template: bool = False
    """Render the filled template as a user turn of the judge's chat template (for instruct judges)."""
    judge_offload: bool = False
    """Keep the judge's weights in host memory between reward calls and copy them to the device for each call: frees
    the judge's size of device memory during rollout and update (for a GPU too small for both models), at one
    host-to-device copy of the judge per step."""
    shard_scoring: bool = True
    """Several processes: each scores whole prompt groups of its share and the scores are gathered;
    false scores the whole batch on every process (for rewards that need the whole batch at once)."""


@dataclass
class EnvConfig:
    """Multi-turn, tool-using episodes (docs/environments.md). Off unless `environment` or `tools` is set; when off,
    a rollout is one prompt -> one completion as before."""

    environment: str = ""
    """Your environment as `path/to/file.py:Name` (a class or function made once per episode from a data row);
    "" for none. Give either this or `tools`, not both."""
    tools: list[str] = field(default_factory=list)
    """Tools of the built-in tool environment, each `path/to/file.py:function`; `python` is the built-in sandboxed
    Python tool (`hybridrl.envs.sandbox.python`). The chat template shows the model their schemas."""
    tool_call_start: str = "<tool_call>"
    """The tag that opens a tool call's JSON in the assistant's text (Qwen2.5/Hermes templates use this one)."""
    tool_call_end: str = "</tool_call>"
    """The tag that closes it; a turn also ends when it is written (a stop string of each assistant turn)."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may run; past it its worker process is killed and the observation says so."""
    num_tool_workers: int = 4
    """Worker processes that run tool calls at once (shared by all episodes of a rollout)."""
    max_turns: int = 4
    """Assistant turns per episode at most (rollout.max_new_tokens is the limit of each turn)."""
    max_episode_tokens: int = 4096
    """All tokens of an episode at most: prompt, assistant turns and observations."""
    max_observation_tokens: int = 512
    """Tokens one observation may add; longer ones are cut and end with a truncation marker."""
    system_prompt: str = ""
    """Built-in tool environment: a system message before each row's prompt ("" for none; a row with a
    `messages` column uses its own messages)."""

    @property
    def enabled(self) -> bool:
        """Whether rollouts are multi-turn episodes."""
        return bool(self.environment or self.tools)


@dataclass
class AlgorithmConfig:
    name: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo", "remax"] = "grpo"
    """Advantage estimator; `ppo` uses GAE with a critic; `remax` subtracts the score of the prompt's greedy response
    (one more greedy rollout per step, logged as `reward/greedy_baseline_mean`; any group size, 1 included)."""
    normalize_std: bool = True
    """GRPO: divide group-centred scores by the group's standard deviation."""
    gamma: float = 1.0
    """Discount factor (GAE, REINFORCE++)."""
    lam: float = 0.95
    """GAE lambda."""
    clip_ratio_low: float = 0.2
    """PPO clip below 1 (ratio >= 1 - clip_ratio_low)."""
    clip_ratio_high: float = 0.2
    """PPO clip above 1; larger than the low clip is DAPO's clip-higher."""
    dual_clip: float | None = None
    """Dual-clip PPO lower bound factor (e.g. 3.0) for negative advantages; null disables."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (PPO/GRPO) or per sequence (GSPO: exp of the mean token log-ratio; use
    clip ratios around 3e-4 / 4e-4 with it)."""
    mask_truncated: bool = False
    """Leave responses cut at rollout.max_new_tokens out of the policy loss (DAPO's overlong filtering)."""
    drop_uniform_groups: bool = False
    """Leave groups whose samples all scored alike out of the policy loss and its token count (DAPO's
    dynamic-sampling filter, without re-sampling: the step learns from the informative groups only)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: after scoring, drop the prompt groups whose samples all scored alike and roll out
    and score fresh prompts (trainer.prompts_per_step at a time) until the step has trainer.prompts_per_step
    informative groups or dynamic_sampling_max_rounds rounds have run; the batch then has no all-equal group.
    Costs up to that many rollouts per step; logged as `rollout/dynamic_sampling_*` (groups discarded and kept,
    rounds run, whether the batch was filled). `reward/*` stays the first round's (the policy's unfiltered reward)."""
    dynamic_sampling_max_rounds: int = 3
    """With dynamic_sampling: generation rounds per step at most, the first included (so at most
    max_rounds - 1 extra rollouts); a step that does not fill up trains on the informative groups it found."""
    rollout_correction_cap: float | None = None
    """Weight each token's policy loss by min(pi_old / pi_sampler, cap): truncated importance sampling for
    the gap between the sampler's and the trainer's log-probs (TRL's vllm_importance_sampling_cap, verl's
    tis_imp_ratio_cap; 2.0 is usual); null disables."""
    rollout_sequence_mask_threshold: float | None = None
    """Leave out of the policy loss whole sequences whose geometric-mean ratio pi_old / pi_sampler over their
    tokens is outside [1 / threshold, threshold]: sequence-level masked importance sampling (MIS) for a
    rollout engine whose log-probs drift from the trainer's (low-precision or quantized sampling, long
    responses). Where rollout_correction_cap reweights tokens, this drops samples of what is effectively
    another policy; the two combine. Logged as `actor/rollout_correction_masked` (fraction of sequences).
    Values near 2.0 are usual; null disables."""
    policy_loss: Literal["ppo", "cispo", "gmpo", "sapo"] = "ppo"
    """The policy surrogate (`algorithms.POLICY_LOSSES`): `ppo` clips the ratio per token (PPO/GRPO/DAPO, and
    GSPO with ratio_level=sequence); `cispo` clips a detached importance weight on log pi so no token loses
    its gradient (MiniMax-M1; try when clipping drops the rare tokens a reasoning chain turns on); `gmpo`
    uses the geometric mean of a sequence's token ratios, clipped in log space (stabler with wider clip
    ratios, e.g. 0.33 / 0.49); `sapo` replaces the clip by a smooth gate (sapo_temperature_*). The clip
    ratios set the bounds of ppo, cispo and gmpo; sapo ignores them."""
    sapo_temperature_positive: float = 1.0
    """SAPO: gate temperature for tokens with positive advantage; larger damps off-policy updates sooner."""
    sapo_temperature_negative: float = 1.05
    """SAPO: gate temperature for tokens with zero or negative advantage; kept above the positive one, as the
    paper does, because negative updates spread probability over many tokens and destabilise sooner."""
    loss_aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become one number (see `algorithms.aggregate_loss` for each mode)."""
    kl_coef: float = 0.0
    """Weight of the KL divergence to the reference model; 0 skips the reference forward pass."""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    """KL estimator: Schulman's k1/k2/k3, or abs (|log-ratio|)."""
    kl_in_reward: bool = False
    """Subtract the KL from the token rewards (classic RLHF) instead of adding it to the loss."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    value_clip: float = 0.2
    """Clipping range of the value loss."""


@dataclass
class ActorConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm; 0 disables."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batch_size: int = 0
    """Sequences per optimizer step; 0 means the whole rollout batch (one step per rollout)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    reuse_logprobs_on_policy: bool = True
    """With one optimizer step per rollout (ppo_epochs=1 and one mini-batch) the old policy is the current
    one, so the old log-probs are the update's own log-probs, detached, and the separate no-grad forward
    pass over the batch is skipped (the ratio is exactly 1, as in verl's on-policy mode). Not applied when
    algorithm.kl_in_reward needs them before the update. False always runs the extra pass."""
    max_tokens_per_micro_batch: int = 0
    """Token budget per forward/backward: each mini-batch is regrouped into micro-batches of at most this many
    real (unpadded) tokens and packed without padding; 0 uses micro_batch_size sequences instead."""
    share_prompt_tokens: bool = False
    """The responses to one prompt go through the log-prob and update passes with that prompt once (one row:
    the prompt, then each response, masked so that no response sees another): (P + nR) tokens instead of
    n(P + R), the same values and gradients. Micro-batches keep a prompt's responses together (a prompt whose
    responses exceed max_tokens_per_micro_batch together gets a micro-batch of its own). Needs an
    attention that takes a mask: model.attn_implementation=flex_attention on GPU (block mask); sdpa/eager
    get a dense mask, which computes every block. Mini-batches are then drawn as whole prompts, and with
    several ranks each prompt's rows go to one rank. Worth turning on for GRPO-style groups (several samples per
    prompt) on GPU with flex_attention; the longer the prompts, the more it saves."""
    optimizer_state_dtype: Literal["float32", "param"] = "float32"
    """AdamW moments for bf16/fp16 parameters: float32 (no float32 copy of the weights; the update is applied
    with stochastic rounding so small steps are not rounded away) or `param` (torch AdamW, state in the
    parameters' dtype). float32 parameters always get float32 state."""
    master_weights: Literal["none", "float32"] = "none"
    """How bf16/fp16 weights are trained (actor, critic and SFT alike; float32 weights are their own master).
    `none` (lean): the weights stay bf16, the float32 AdamW update is written back with stochastic rounding
    (unbiased; small updates are not rounded away): 2 (weights) + 2 (gradients) + 8 (float32 moments) = 12 bytes
    per parameter. `float32`: conventional mixed precision, a float32 master copy of the weights in the
    optimizer state on the device, updated in float32, and the bf16 weights that the model computes with set to
    it rounded to nearest after each step: 4 bytes per parameter more (16 in all; a 0.5B model 2 GiB more,
    7B 28 GiB more), checkpointed with the moments. Gradients stay bf16 in both. Needs
    optimizer_state_dtype=float32 and optimizer_8bit=false."""
    optimizer_offload: bool = False
    """Keep AdamW state in CPU memory and stream it to the device one parameter at a time in each step:
    8 bytes per parameter off the GPU for a host-device round trip of the state every step. Turn it on when the
    moments do not fit; with several GPUs each streams its shard at once and the update slows more than on one,
    so prefer false where the memory allows (optimizer_offload_fraction offloads only part)."""
    optimizer_offload_fraction: float = 1.0
    """With optimizer_offload: the share of the AdamW state (by parameter elements, in parameter order) kept in
    CPU memory; the rest stays on the GPU: 8 bytes per parameter kept there, fewer PCIe bytes every step."""
    optimizer_8bit: bool = False
    """8-bit AdamW state through bitsandbytes (`pip install bitsandbytes`, CUDA only)."""
    offload_during_rollout: bool = False
    """Hybrid engine: move optimizer state to CPU memory while generating (room for a larger KV cache),
    and back before the update; the switch time is logged as `perf/weight_sync_s`."""
    cuda_graphs: bool | Literal["auto"] = "auto"
    """Replay the update's training pass (forward, loss and backward of a micro-batch) as a CUDA graph
    (`training/graphed_pass.py`): each micro-batch is padded to a bucket shape (rows to the micro-batch size,
    columns up to a few bucket widths), the first update of a shape runs eagerly, the second captures it.
    Saves the host's kernel launches where they, not the GPU, set the update's time (short sequences). Costs:
    the gradients (2 bytes per bf16 parameter) and the captured pass's activations stay allocated between
    updates. `auto`: on CUDA for micro-batches small enough to be host-bound and gradients small beside the
    device's memory (`graphed_pass.AUTO_MAX_PARAMETER_TOKENS`, `AUTO_MAX_GRADIENT_SHARE`); off, with the reason
    logged, where the pass cannot be captured
    (CPU, several GPUs, LoRA, gradient checkpointing, model.compile, packing by tokens, shared prompts,
    attention other than sdpa/eager)."""


@dataclass
class CriticConfig:
    lr: float = 1e-5
    """Peak learning rate of the critic."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm; 0 disables."""
    critic_warmup_steps: int = 0
    """Steps at the start during which only the critic is trained."""
    path: str | None = None
    """Backbone for the critic; defaults to the actor's `model.path`."""


@dataclass
class TrainerConfig:
    total_steps: int = 100
    """Rollout-and-update steps."""
    prompts_per_step: int = 32
    """Prompts per rollout; the batch has prompts_per_step * num_samples_per_prompt sequences."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    device: str = "auto"
    """`auto` (cuda if visible, else cpu), `cpu`, `cuda` or `cuda:N`."""
    cudnn_attention: bool | Literal["auto"] = "auto"
    """Let PyTorch's SDPA use cuDNN's attention kernels in the steps (rollout and update). cuDNN builds them at
    run time, per process and shape (and, on a machine whose CUDA cache lacks them, the driver compiles their
    PTX too): seconds of a run's first step. `auto`: off for light runs (short prompts and responses:
    `kernel_choices.light_rollout`), where the precompiled flash / memory-efficient kernels serve and attention
    is a sliver of the step; PyTorch's default order otherwise (`training/attention_choice.py`)."""
    output_dir: str = "runs/default"
    """Where metrics, samples and models are written."""
    eval_every: int = 0
    """Evaluate on the held-out set every N steps (and before the first and after the last); 0 disables.
    Logs `eval/reward_mean`, `eval/reward/<fn>` and, where the data has `data.answer_key`,
    `eval/accuracy` (exact agreement with that reference answer)."""
    save_model: bool = True
    """Save the final actor as a Hugging Face directory in `output_dir/model`."""
    save_every: int = 0
    """Save a resumable checkpoint in `output_dir/checkpoints` every N steps and after the last; 0 saves only
    when the run is stopped by SIGINT/SIGTERM."""
    keep_last_n: int = 3
    """Checkpoints kept; older ones are deleted after a new one is complete. 0 keeps all."""
    resume: str = "auto"
    """`auto` continues from the newest intact checkpoint in `output_dir/checkpoints` if there is one;
    `off` starts fresh; a path names a checkpoint (or a run directory) to continue from."""
    num_gpus: int = 1
    """Training processes, one per GPU (data parallel, FSDP2). Above 1, `hybridrl train` starts them itself
    (see `launcher`); with trainer.device=cpu it starts that many CPU processes (gloo), for testing."""
    launcher: Literal["torchrun", "ray"] = "torchrun"
    """How `hybridrl train` starts the processes: torchrun on this node, or one Ray actor per GPU on the
    Ray cluster that RAY_ADDRESS names (`pip install 'hybridrl[ray]'`)."""
    device_mesh: dict[str, Any] = field(default_factory=dict)
    """CUDA devices per role, e.g. {actor: [0], reward: [1]}; roles not listed share the actor's devices, and
    the actor defaults to devices 0..num_gpus-1. With max_staleness > 0, `rollout` gives the rollout worker a
    device of its own: {actor: [0], rollout: [1]} trains on GPU 0 while GPU 1 generates (one device; not one of
    the actor's, critic's or reference's). Checked by `placement.resolve_placement`."""
    fsdp_shard_size: int = 0
    """With several GPUs: how many share one copy of the weights and optimizer state. 0 shards over all of
    them (FSDP, least memory); 1 keeps a full copy on each (replicated, like DDP: no weight gathers before
    the rollout or in training, gradients all-reduced; each GPU needs the one-GPU memory); a divisor k
    of trainer.num_gpus shards within groups of k and replicates across groups (HSDP)."""
    fsdp_reshard_every_micro_batch: bool = False
    """With several GPUs (FSDP2): false keeps each phase's full weights gathered across its micro-batches and
    reduce-scatters gradients once per mini-batch (fast; one extra full copy of weights and gradients per GPU
    during the update); true gathers and reduce-scatters in every micro-batch (least memory, for models whose
    full weights do not fit twice on one GPU)."""
    hang_timeout_s: float = 900.0
    """A multi-process run stops, naming the rank, when one rank completes no trainer phase for this long."""
    max_staleness: int = 0
    """0: the synchronous loop (rollout, then update, on the same weights). k > 0: a rollout worker generates and
    scores the next batches while the trainer updates, each batch with weights exactly k updates older than the
    trainer's (`training/async_pipeline.py`); correct for it with algorithm.rollout_correction_cap and/or
    algorithm.rollout_sequence_mask_threshold. Logged as `rollout/staleness_*` and `perf/weight_push_s`."""
    rollout_worker: Literal["thread", "process"] = "thread"
    """With max_staleness > 0, where the rollout worker runs: a thread of the training process with a copy of the
    actor, or a process of its own (`training/rollout_process.py`) that gets each new version in bucketed
    broadcasts (gloo on CPU) and sends its batches back; both give the same metrics (the process runs `env:`
    episodes with environments of its own, and dynamic sampling's rounds as the trainer's side asks for them).
    Several training processes (trainer.num_gpus > 1) need the process, which makes each rank's share of the
    batch with that rank's seed and gets the weights gathered from their shards."""
    rollout_device: str = ""
    """With max_staleness > 0: the rollout worker's device by name (`cuda:1`, or `cpu`); `device_mesh.rollout` is
    the usual way to say it (set one of the two). The worker's copy of the actor and its rollout backend live
    there; each pushed version is copied across into the copy's own tensors, and its batches come back to the
    trainer's device. "" keeps the copy on the trainer's device."""
    partial_rollout: Literal["off", "continue", "requeue"] = "off"
    """With max_staleness > 0 and the thread worker: what a batch in flight does when the trainer publishes newer
    weights. `off`: finishes with the version it started with. `continue`: its sequences go on under the new weights
    (each token records its version, `rollout/staleness_token_mean`); `requeue`: its unfinished sequences are cut
    and generated again from their prompts. Either generates in 4 segments per response to take weights over
    between them (`training/partial_rollout.py`); runs are then not bitwise reproducible."""
    divergence_check: bool = True
    """Stop the run before its checkpoint when a step shows it blowing up (`training/divergence.py`): non-finite
    losses, gradient norms, entropy or weights, or one of the bounds below; nothing is saved over the last good step."""
    divergence_max_grad_norm: float = 1e5
    """Largest gradient norm (before clipping) of the actor or critic; 0: no bound."""
    divergence_entropy_ratio: float = 3.0
    """The run stops when the policy's entropy is more than this many times its first step's, and more than
    `divergence_entropy_margin` nats above it (a policy collapsed to noise); 0: no bound."""
    divergence_entropy_margin: float = 1.0
    """See `divergence_entropy_ratio`."""
    divergence_max_weight_growth: float = 100.0
    """Largest trainable weight, in multiples of the largest at the start of the run; 0: not checked (saves one
    reduction over the weights per step)."""


@dataclass
class LoggingConfig:
    sinks: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks: console, jsonl, tensorboard (`pip install 'hybridrl[tensorboard]'`), wandb
    (`pip install 'hybridrl[wandb]'`; WANDB_MODE=offline writes locally with no network)."""
    log_every: int = 1
    """Print a console line every N steps."""
    num_samples_to_print: int = 2
    """Sample prompts/completions/rewards printed with each console line; 0 disables."""


@dataclass
class SFTConfig:
    num_epochs: int = 1
    """Passes over the SFT data."""
    batch_size: int = 32
    """Examples per optimizer step."""
    lr: float = 1e-3
    """Peak learning rate (cosine decay after warm-up)."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    max_steps: int = 0
    """Stop after this many optimizer steps; 0 runs all epochs."""
    max_length: int = 512
    """Prompt + response tokens; longer examples are dropped and counted."""


@dataclass
class EvalConfig:
    num_samples: int = 1
    """Responses sampled for each held-out prompt (at `rollout.eval_temperature`, which must then be above 0).
    Above 1 the run also logs `eval/pass@k` (k = num_samples): the share of prompts with at least one of the k
    responses equal to the reference answer; `eval/accuracy` and the reward means are then over all k x prompts."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def rollout_batch_size(self) -> int:
        """Sequences generated per step."""
        return self.trainer.prompts_per_step * self.rollout.num_samples_per_prompt

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
