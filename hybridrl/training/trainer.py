"""The RL loop: one controller whose `step()` reads like the algorithm.

rollout -> score -> old/reference log-probs and values -> advantages -> update, then log and checkpoint
in `train()`. Everything model-specific lives in `components.py` (building models, backends,
optimizers), the update epochs in `update.py`, the math in `algorithms.py`, and how a checkpoint is
written in `checkpoint/store.py`: the trainer only says what its state is (`state_dict`).
"""

from __future__ import annotations

import gc
import resource
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from hybridrl import algorithms
from hybridrl.checkpoint import store as checkpoint
from hybridrl.checkpoint.run_lock import lock_owner, output_dir_lock
from hybridrl.checkpoint.stop_signals import stop_on_signals
from hybridrl.config.loading import load_config
from hybridrl.config.schema import Config
from hybridrl.data.datasets import PromptDataset
from hybridrl.envs.base import EnvironmentCodeError
from hybridrl.metrics.sinks import MetricsLogger, print_unless_closed
from hybridrl.metrics.summary import run_summary
from hybridrl.models.loading import HFModel, save_hf_model
from hybridrl.parallel import fsdp, process_group, sharding, watchdog
from hybridrl.rewards import RewardError
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.kernel_choices import resolve_attention
from hybridrl.rollout.timeline import phase_seconds
from hybridrl.training import adamw_kernel
from hybridrl.training.async_pipeline import AsyncPipeline
from hybridrl.training.attention_choice import step_attention
from hybridrl.training.batch import RolloutBatch, build_rollout_batch, decode_responses
from hybridrl.training.components import Components, build_components
from hybridrl.training.divergence import DivergenceGuard, Limits
from hybridrl.training.dynamic_sampling import informative_batch
from hybridrl.training.evaluation import EVAL_BATCH, answer_column, exact_agreement, pass_at_k, pass_at_k_key
from hybridrl.training.greedy_baseline import attach_greedy_baseline
from hybridrl.training.logprobs import response_logprobs
from hybridrl.training.phase_switch import rollout_phase
from hybridrl.training.rollout_process import ROLLOUT_WORKERS
from hybridrl.training.shared_prompt import PromptLayout
from hybridrl.training.update import shard_by_prompt, update_actor, update_critic


class PhaseTimer:
    """Wall time per phase (device-synchronised), reported as `timing/<phase>_s`, and on CUDA each phase's
    peak allocated memory (`perf/peak_memory_<phase>_gib`): which phase sets the step's peak is what
    decides the next memory saving (KV cache size, micro-batch size, optimizer offload)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        watchdog.heartbeat()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with torch.profiler.record_function(f"phase:{phase}"):  # named ranges in a profile; no cost without one
            yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.peak_bytes[phase] = max(self.peak_bytes.get(phase, 0), peak)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


@dataclass
class RolloutTimings:
    """Where a rollout's time went, besides the phase's own wall time (`timing/rollout_s`)."""

    weight_sync_s: float
    """The train <-> generate switch, both directions, with FSDP's weight gather (`perf/weight_sync_s`)."""
    engine_phases: dict[str, float]
    """The built-in engine's split of its call (`rollout/timeline.phase_seconds`); empty for other backends."""
    episodes: dict[str, float] = field(default_factory=dict)
    """Multi-turn episodes: turns, tool calls, errors, latency, the engine's prefill and idle time (`rollout/...`)."""
    paged: dict[str, float] = field(default_factory=dict)
    """The paged KV cache's preemptions and the kept tokens they prefilled again (`rollout/preemptions`,
    `rollout/refilled_tokens`); empty for the other layouts and backends."""

    def metrics(self) -> dict[str, float]:
        """`perf/weight_sync_s` and the engine's split as `timing/rollout_<phase>_s` (this process's share of the
        batch: before the first decode step, decoding, after it)."""
        return {"perf/weight_sync_s": self.weight_sync_s,
                **{f"timing/rollout_{name}_s": seconds for name, seconds in self.engine_phases.items()},
                **self.episodes, **self.paged}


class RLTrainer:
    """PPO/GRPO-family trainer. Build from a `Config` (or YAML path) plus keyword overrides.

    `actor`, `reward_fn`, `dataset` and `eval_dataset` may be given as objects instead of through the
    config (the Python API); anything left out is built from the config.
    """

    def __init__(self, config: Config | str | None = None, *, actor: HFModel | None = None,
                 reward_fn: str | Callable | list | None = None, dataset: PromptDataset | None = None,
                 eval_dataset: PromptDataset | None = None, **overrides: Any):
        if not isinstance(config, Config):
            config = load_config(config, **overrides)
        elif overrides:
            config = load_config(None, **{**config.to_dict(), **overrides})
        self.config = config
        self.parts: Components = build_components(config, actor=actor, reward_fn=reward_fn, dataset=dataset,
                                                  eval_dataset=eval_dataset)
        self.device = self.parts.device
        self.attention = step_attention(config, self.device)  # cuDNN's SDPA kernels or the precompiled ones
        self.step_count = 0
        self.stopped_by: str | None = None
        """What stopped the last `train()` early (a signal's name), or None when it ran to its last step."""
        self.froze_warm_up_objects = False  # see `freeze_warm_up_objects`, done after this process's first step
        self.generation_round = 0  # a step's extra rollouts (`algorithm.dynamic_sampling`) sample with their own seeds
        self.output_dir = Path(config.trainer.output_dir)
        sinks = config.logging.sinks if self.parts.setup.is_main else []  # rank 0 logs
        self.logger = MetricsLogger(self.output_dir, sinks, config.trainer.total_steps,
                                    config.logging.log_every, config.logging.num_samples_to_print, config.to_dict(),
                                    warn=self.parts.setup.is_main)
        self.sampler = self.parts.dataset.sampler(config.trainer.prompts_per_step)
        staleness, worker = config.trainer.max_staleness, ROLLOUT_WORKERS[config.trainer.rollout_worker]
        self.pipeline = AsyncPipeline(self, staleness, worker) if staleness else None
        """`trainer.max_staleness` > 0: rollout runs ahead in a worker (`async_pipeline.py`); None: synchronous."""

    # ------------------------------------------------------------------------------------------
    # The loop

    def train(self) -> list[dict[str, float]]:
        """Run until `trainer.total_steps` (or a stop signal), evaluating every `eval_every` steps; returns the
        metric history. The output directory is locked for the run (`checkpoint/run_lock.py`)."""
        with output_dir_lock(self.output_dir, enabled=lock_owner(self.parts.setup.rank)), \
                self.parts.episodes or nullcontext():  # multi-turn: stops the tool workers when the run ends
            start = time.time()
            if self.parts.setup.is_main:
                print_unless_closed(self.describe())
            self.resume()
            try:
                self.stopped_by = self.run_steps()
            finally:  # the rollout worker ends with the run (`AsyncPipeline.close`)
                if self.pipeline is not None:
                    self.pipeline.close()
            saved = not self.stopped_by and self.config.trainer.save_model
            if self.stopped_by:
                print_unless_closed(f"stopped by {self.stopped_by} after step {self.step_count}; checkpoint saved in "
                                    f"{self.output_dir / 'checkpoints'}; rerun with trainer.resume=auto to continue")
            elif saved:
                self.save_model()
            self.logger.close()
            if self.parts.setup.is_main:
                print_unless_closed(run_summary(self.logger.history, time.time() - start, self.output_dir,
                                                self.output_dir / "model" if saved else None, self.config.algorithm.name))
        process_group.shutdown(self.parts.setup)
        return self.logger.history

    def run_steps(self) -> str | None:
        """step -> evaluate (when due) -> log -> checkpoint (when due), until the last step or a SIGINT/SIGTERM,
        after which the step finishes and is saved; returns what stopped it early, or None."""
        cfg = self.config.trainer
        with stop_on_signals() as stop:
            if self.step_count == 0 and self.due(cfg.eval_every) and self.parts.eval_dataset is not None:
                self.logger.log(0, self.evaluate())
            guard = DivergenceGuard(self.parts.actor, self.parts.setup, Limits(
                cfg.divergence_max_grad_norm, cfg.divergence_entropy_ratio, cfg.divergence_entropy_margin,
                cfg.divergence_max_weight_growth), enabled=cfg.divergence_check)
            stopping = False
            while self.step_count < cfg.total_steps and not stopping:
                metrics = self.step_saving_on_user_error()
                if self.due(cfg.eval_every) and self.parts.eval_dataset is not None:
                    metrics.update(self.evaluate())
                self.logger.log(self.step_count, metrics)
                guard.check(self.logger.history)  # before the checkpoint: a diverged step is never saved
                stopping = self.any_rank_stopping(bool(stop))
                if stopping or self.due(cfg.save_every):
                    self.save_checkpoint()
        return (stop.signal_name or "a signal to another process") if stopping else None

    def step_saving_on_user_error(self) -> dict[str, float]:
        """`step()`; when the user's reward code fails in it, first save the steps that finished (the failed step
        is rolled back: its count, data position and RNG state), so fixing the code and rerunning resumes there.
        Rewards are scored before the update, so the weights and optimizer are still the last step's."""
        start = (self.step_count, self.sampler.state_dict(), checkpoint.rng_state())
        try:
            return self.step()
        except (RewardError, EnvironmentCodeError) as error:  # user code: reward functions, environments
            self.step_count, sampler, rng = start
            self.sampler.load_state_dict(sampler)
            checkpoint.set_rng_state(*rng)
            if self.step_count == 0:
                raise
            saved = self.save_checkpoint()
            raise type(error)(f"{error} The {self.step_count} finished step(s) are saved in {saved}: fix the code and "
                              "run the same command again to resume from there.") from error

    def any_rank_stopping(self, stop: bool) -> bool:
        """Whether any process was asked to stop: the ranks may get their signals in different steps, and all
        must stop after the same one (they save its checkpoint together). One process: `stop` itself."""
        if not self.parts.setup.is_distributed:
            return stop
        flag = torch.tensor(float(stop), device=self.device)
        return bool(process_group.all_reduce(flag, self.parts.setup, op="max").item())

    def step(self) -> dict[str, float]:
        """One rollout-and-update step: rollout -> score -> log-probs -> advantages -> update; its metrics."""
        if self.step_count == 0 and adamw_kernel.available(self.device):
            adamw_kernel.prefetch_cache_key()  # for the first update's kernel lookup, while the rollout runs
        with self.attention():
            return self.step_phases()

    def step_phases(self) -> dict[str, float]:
        timer = PhaseTimer(self.device)
        self.step_count += 1
        if self.pipeline is not None:
            return self.pipeline_step(timer)
        prompts = self.parts.dataset.batch(next(self.sampler))
        with timer("rollout"):
            batch, rollout_timings = self.rollout(prompts)
        with timer("reward"):
            reward_metrics = self.score(batch, prompts)
        batch, rollout_timings, reward_metrics = informative_batch(self, timer, batch, rollout_timings, reward_metrics)
        reward_metrics.update(attach_greedy_baseline(self, timer, batch, prompts))  # ReMax only
        update_metrics = self.train_on(batch, timer)  # log-probs -> advantages -> update
        return {**rollout_metrics(batch), **reward_metrics, **update_metrics, **perf_metrics(batch, timer, self.device),
                **rollout_timings.metrics()}

    def pipeline_step(self, timer: PhaseTimer) -> dict[str, float]:
        """`step()` with trainer.max_staleness > 0: the batch was generated and scored ahead by the rollout worker
        (`async_pipeline.py`) with weights at most that many updates old; after the update the worker gets the new
        ones. The phases after the reward are the synchronous step's."""
        with timer("rollout"):  # the wait for the worker's batch
            batch, reward_metrics, pipeline_metrics = self.pipeline.take(self.step_count, self.device)
        update_metrics = self.train_on(batch, timer)
        pipeline_metrics.update(self.pipeline.push(self.step_count))
        return {**rollout_metrics(batch), **reward_metrics, **update_metrics, **perf_metrics(batch, timer, self.device),
                **pipeline_metrics}

    def train_on(self, batch: RolloutBatch, timer: PhaseTimer) -> dict[str, float]:
        """The phases after the reward, the same in both steps: old/reference log-probs and values -> advantages ->
        update, on a scored batch; the update's metrics."""
        with timer("logprobs"):
            self.compute_logprobs(batch)
        with timer("advantages"):
            self.compute_advantages(batch)
        with timer("update"):
            update_metrics = self.update(batch)
        self.freeze_after_first_step()
        return update_metrics

    def due(self, every: int) -> bool:
        """Whether something done every `every` steps (0: never) is due after this step; the last step counts."""
        return bool(every) and (self.step_count % every == 0 or self.step_count == self.config.trainer.total_steps)

    def freeze_after_first_step(self) -> None:
        if not self.froze_warm_up_objects:
            freeze_warm_up_objects()
            self.froze_warm_up_objects = True

    def describe(self) -> str:
        """One line on what this run is about to do: algorithm, model, devices, rollout, batch, output."""
        c, parts = self.config, self.parts
        trainable = sum(p.numel() for p in parts.actor.parameters() if p.requires_grad)
        dtype = str(next(parts.actor.parameters()).dtype).removeprefix("torch.")
        rollout = type(parts.rollout).__name__.removesuffix("Backend").lower()
        if rollout == "builtin":
            rollout += f" engine, {resolve_attention(parts.rollout.attention, self.device)} decode attention"
        if parts.episodes is not None:
            rollout += f", episodes of up to {parts.episodes.budget.max_turns} turns with {parts.episodes.name}"
        processes = f" x {parts.setup.world_size} processes" if parts.setup.is_distributed else ""
        engine_options = getattr(parts.rollout, "options", None)  # the built-in engine's `EngineOptions`
        engine_compiles = (rollout.startswith("builtin") and self.device.type == "cuda"
                           and getattr(engine_options, "compile", None) is not False)
        compiling = [what for what, on in (("the rollout engine", engine_compiles), ("the model's layers", c.model.compile))
                     if on]
        note = (f"; the first step compiles {' and '.join(compiling)} (a minute or so; later steps reuse it)"
                if compiling else "")
        # an actor passed in Python names its own source; config.model.path is then only the default
        model = getattr(getattr(parts.actor, "config", None), "_name_or_path", "") or c.model.path
        return (f"hybridrl: {c.algorithm.name} with {model} ({trainable / 1e6:.2f}M trainable parameters, {dtype}) "
                f"on {self.device.type}{processes}; rollout: {rollout}; {c.trainer.prompts_per_step} prompts x "
                f"{c.rollout.num_samples_per_prompt} samples per step, {c.trainer.total_steps} steps; "
                f"output in {self.output_dir}{note}")

    # ------------------------------------------------------------------------------------------
    # State: what a checkpoint holds

    def state_dict(self) -> dict[str, Any]:
        """The run's state (`checkpoint.Checkpointable`). `models`: role -> (model, optimizer), the live objects,
        whose tensors the checkpoint gathers (FSDP shards included) and fills back in place; the other entries
        are plain JSON: step, data position, schedulers, metric history, and the config (for export)."""
        parts = self.parts
        models = {"actor": (parts.actor, parts.actor_optimizer)}
        schedulers = {"actor": parts.actor_scheduler.state_dict()}
        if parts.critic is not None:
            models["critic"] = (parts.critic, parts.critic_optimizer)
            schedulers["critic"] = parts.critic_scheduler.state_dict()
        state = {"step": self.step_count, "sampler": self.sampler.state_dict(), "schedulers": schedulers,
                 "history": self.logger.history, "config": self.config.to_dict(), "models": models}
        if self.pipeline is not None:  # the batches generated ahead, and the data position after them
            state["pipeline"] = self.pipeline.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the JSON entries of `state_dict()` (its `models` are filled in place by the checkpoint, and the
        saved config is a record, not applied: this run's config stands)."""
        schedulers = (("actor", self.parts.actor_scheduler), ("critic", self.parts.critic_scheduler))
        for role, scheduler in schedulers:
            if scheduler is not None and role in state["schedulers"]:
                scheduler.load_state_dict(state["schedulers"][role])
        self.sampler.load_state_dict(state["sampler"])
        self.step_count = state["step"]
        self.logger.rewind(state["step"], state["history"])
        if self.pipeline is not None and "pipeline" in state:
            self.pipeline.load_state_dict(state["pipeline"])

    def save_checkpoint(self) -> Path:
        cfg = self.config.trainer
        return checkpoint.save_checkpoint(self, self.output_dir / "checkpoints", self.parts.setup, cfg.keep_last_n,
                                          tokenizer=self.parts.tokenizer)

    def resume(self) -> None:
        """Apply `trainer.resume` (auto|off|PATH): restore the newest usable checkpoint and report the time."""
        setup = self.parts.setup
        directory = checkpoint.resume_directory(self.config.trainer.resume, self.output_dir / "checkpoints", setup)
        if directory is None:
            if self.step_count == 0:
                self.logger.rewind(0, [])  # a fresh run: metrics files describe this run only
            return
        seconds = checkpoint.load_checkpoint(self, directory, setup)
        if setup.is_main:
            print_unless_closed(f"resumed from {directory} at step {self.step_count} in {seconds:.2f} s")
        self.logger.add_once({"perf/resume_s": seconds})

    def save_model(self) -> None:
        """The trained actor as a Hugging Face directory in `output_dir/model` (gathered from every process)."""
        state = fsdp.full_state_dict(self.parts.actor, self.parts.setup)
        if self.parts.setup.is_main:
            save_hf_model(self.parts.actor, self.parts.tokenizer, self.output_dir / "model", state_dict=state)
            print_unless_closed(f"saved the trained model to {self.output_dir / 'model'} (a Hugging Face directory)")

    # ------------------------------------------------------------------------------------------
    # Phases

    def sampling_params(self, evaluation: bool = False, step: int | None = None,
                        generation_round: int | None = None) -> SamplingParams:
        """How this step's rollout samples: the only place the sampling settings are read from the config (the
        batch carries them on to the log-prob passes and the update). `step`: the step whose batch it samples
        (default: this one; the asynchronous rollout worker samples ahead); `generation_round`: the step's round
        of dynamic sampling (default: the trainer's own)."""
        r = self.config.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.eval_temperature if evaluation else r.temperature,
            top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
            n=self.config.eval.num_samples if evaluation else r.num_samples_per_prompt,
            stop_strings=list(r.stop_strings), ignore_eos=r.ignore_eos and not evaluation,
            seed=self.config.trainer.seed * 100_003 + (self.step_count if step is None else step)
            + 1_000_003 * (self.generation_round if generation_round is None else generation_round))

    @torch.no_grad()
    def rollout(self, prompts: dict[str, Any], evaluation: bool = False) -> tuple[RolloutBatch, RolloutTimings]:
        """Generate responses to `prompts` with the actor's current weights (evaluation: one sample each, at
        `rollout.eval_temperature`); the batch (on the device, with its texts and sampling settings) and where
        the time went."""
        params = self.sampling_params(evaluation)
        switch: dict[str, float] = {}
        with rollout_phase(self.parts.actor, self.parts.actor_optimizer, self.device,
                           self.config.actor.offload_during_rollout, switch), \
                fsdp.gather_for_rollout(self.parts.actor) as sync:
            if self.parts.episodes is not None:  # multi-turn: the batch is the episodes' ids (`episodes.py`)
                batch, episode_stats = self.parts.episodes.generate(self.parts.rollout, prompts, params)
            else:
                generations = sharding.generate_sharded(  # each process decodes the texts of its own share
                    self.parts.rollout, prompts["prompt_ids"], params, self.parts.setup,
                    decode=lambda share: decode_responses(self.parts.tokenizer, share))
            self.parts.rollout.release_memory()
        engine_stats = getattr(self.parts.rollout, "last_stats", None) or {}
        timings = RolloutTimings(weight_sync_s=switch["weight_sync"] + sync.seconds,
                                 engine_phases=phase_seconds(engine_stats.get("timeline_ms", {})),
                                 paged={f"rollout/{key}": float(engine_stats[key]) for key in ("preemptions",
                                        "refilled_tokens") if engine_stats.get("kv_cache") == "paged"})
        if self.parts.episodes is not None:
            timings.episodes = episode_stats
            return batch.to(self.device), timings
        batch = build_rollout_batch(prompts["prompt_ids"], generations, self.parts.pad_token_id, params.max_new_tokens,
                                    sampling=params)
        batch.texts = [generation.text for generation in generations]
        return batch.to(self.device), timings

    def score(self, batch: RolloutBatch, prompts: dict[str, Any],
              add_samples: Callable[[list[str], list[str], list[float]], None] | None = None,
              whole_batch: bool = False) -> dict[str, float]:
        """The batch's rewards into `batch.scores`; the reward metrics. Its samples go to the console and
        samples.jsonl with the next logged step, or to `add_samples` (the asynchronous worker scores ahead: its
        samples travel with the batch to the step that trains on it). `whole_batch`: scored in this process alone,
        even with several (the asynchronous pipeline scores in a thread of rank 0)."""
        rows = batch.prompt_index.tolist()
        columns = {key: [values[i] for i in rows] for key, values in prompts["columns"].items()}
        columns.update(batch.columns or {})  # episodes: messages, tool_calls, env_reward (`episodes.py`)
        prompt_texts = [prompts["raw_prompts"][i] for i in rows]
        group = batch.sampling.n
        total, per_function = (self.parts.rewards.score(prompt_texts, batch.texts, columns) if whole_batch else
                               self._score(prompt_texts, batch.texts, columns, group))
        batch.scores = total.to(self.device)
        (add_samples or self.logger.add_samples)(prompt_texts, batch.texts, total.tolist())
        metrics = {"reward/mean": total.mean(), "reward/std": total.std() if len(total) > 1 else 0.0}
        if group > 1 and len(total) % group == 0:  # groups that teach nothing (all samples scored alike)
            metrics["reward/uniform_group_fraction"] = algorithms.uniform_groups(total, group).float().mean()
        metrics.update({f"reward/{name}": sum(v) / len(v) for name, v in per_function.items()})
        metrics.update(self.parts.rewards.last_metrics())  # this process's share, e.g. the judge's parse failures
        return metrics

    def _score(self, prompts: list[str], texts: list[str], columns: dict[str, list], group_size: int):
        """The rewards of the whole batch: with several processes each scores a share (`reward.shard_scoring`)."""
        if not self.config.reward.shard_scoring:
            return self.parts.rewards.score(prompts, texts, columns)
        return sharding.score_sharded(self.parts.rewards.score, prompts, texts, columns, group_size,
                                         self.parts.setup)

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch) -> None:
        """Old-policy and reference log-probs, and critic values, before any update of this step.

        Each model runs over this rank's rows in turn, with its weights gathered once (FSDP) and freed
        before the next model, so at most one model is whole on a GPU at a time."""
        temperature = batch.sampling.temperature  # the one that sampled these tokens
        actor, reference, critic = self.parts.actor, self.parts.reference, self.parts.critic

        # Rows of one prompt are adjacent (prompt-major rollouts), so micro-batches mostly hold whole prompts.
        layout = PromptLayout.of(batch.attention_mask, batch.input_ids.shape[1] - batch.response_length,
                                 batch.prompt_index.tolist()) if self.config.actor.share_prompt_tokens else None

        def logprobs_of(model):
            return lambda part, rows: response_logprobs(
                model, part.input_ids, part.attention_mask, part.position_ids, part.response_length, temperature,
                prompt_layout=layout.select(rows.tolist()) if layout else None)[0]

        passes = {  # batch field -> (model, what it computes per micro-batch)
            "old_logp": None if self.reuses_update_logprobs(len(batch)) else (actor, logprobs_of(actor)),
            "ref_logp": None if reference is None else (reference, logprobs_of(reference)),
            "old_values": None if critic is None else (critic, lambda part, rows: critic(
                part.input_ids, part.attention_mask, part.position_ids)[:, -part.response_length - 1:-1]),
        }
        setup = self.parts.setup
        rows = (shard_by_prompt(batch, torch.arange(len(batch)), setup, equal_rows=True) if layout else
                sharding.shard_rows(torch.arange(len(batch)), batch.attention_mask.sum(1), setup))
        gather_once = not self.config.trainer.fsdp_reshard_every_micro_batch
        for field, job in passes.items():
            setattr(batch, field, None)  # None for old_logp means: the update provides it
            if job is None:
                continue
            model, compute = job
            offloaded = self.parts.reference_offload if field == "ref_logp" else None
            with fsdp.gathered_for_micro_batches(model, gather_once), \
                    (offloaded.on_device() if offloaded is not None else nullcontext()):
                outputs = [compute(batch.select(index), index) for index in rows.split(self.config.actor.micro_batch_size)]
            setattr(batch, field, sharding.gather_rows(torch.cat(outputs), rows, len(batch), setup))

    def reuses_update_logprobs(self, batch_size: int) -> bool:
        """True when the old-policy pass is skipped (`actor.reuse_logprobs_on_policy`): one optimizer step
        per rollout, and nothing needs the old log-probs before the update."""
        act, a = self.config.actor, self.config.algorithm
        one_step = act.ppo_epochs == 1 and (act.mini_batch_size == 0 or act.mini_batch_size >= batch_size)
        needed_early = a.kl_in_reward and self.parts.reference is not None
        return act.reuse_logprobs_on_policy and one_step and not needed_early

    def compute_advantages(self, batch: RolloutBatch) -> None:
        a = self.config.algorithm
        mask = batch.response_mask
        token_rewards = algorithms.outcome_to_token_rewards(batch.scores, mask)
        if a.kl_in_reward and batch.ref_logp is not None:
            kl = algorithms.kl_penalty(batch.old_logp, batch.ref_logp, a.kl_estimator)
            token_rewards = token_rewards - a.kl_coef * kl * mask
        batch.advantages, batch.returns = algorithms.ADVANTAGE_ESTIMATORS[a.name](
            scores=batch.scores, token_rewards=token_rewards, values=batch.old_values, mask=mask,
            group_size=batch.sampling.n, gamma=a.gamma, lam=a.lam, normalize_std=a.normalize_std,
            baseline_scores=batch.baseline_scores)
        batch.loss_mask = algorithms.policy_loss_mask(mask, batch.truncated, batch.scores, batch.sampling.n,
                                                      a.mask_truncated, a.drop_uniform_groups)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        metrics: dict[str, float] = {}
        generator = torch.Generator().manual_seed(self.config.trainer.seed * 7919 + self.step_count)
        if self.parts.critic is not None:
            metrics.update(update_critic(self.parts, self.config, batch, generator))
        if self.step_count > self.config.critic.critic_warmup_steps or self.parts.critic is None:
            metrics.update(update_actor(self.parts, self.config, batch, generator, self.step_count))
        return metrics

    # ------------------------------------------------------------------------------------------
    # Evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """`eval.num_samples` responses (at eval_temperature, greedy by default) to each held-out prompt: each
        reward's mean, and `eval/accuracy`, exact agreement with `data.answer_key` where the data has that column,
        with `eval/pass@k` when k > 1 (`training/evaluation.py`)."""
        dataset = self.parts.eval_dataset
        limit = self.config.data.max_eval_samples or len(dataset)
        indices = list(range(min(limit, len(dataset))))
        scores, per_fn_sums, agree, agree_prompt = [], {}, [], []
        for start in range(0, len(indices), EVAL_BATCH):
            prompts = dataset.batch(indices[start:start + EVAL_BATCH])
            batch, _ = self.rollout(prompts, evaluation=True)
            rows = batch.prompt_index.tolist()  # k rows per prompt with eval.num_samples = k
            columns = {key: [values[i] for i in rows] for key, values in prompts["columns"].items()}
            columns.update(batch.columns or {})
            total, per_function = self._score([prompts["raw_prompts"][i] for i in rows], batch.texts, columns,
                                              batch.sampling.n)
            scores += total.tolist()
            for name, values in per_function.items():
                per_fn_sums[name] = per_fn_sums.get(name, 0.0) + sum(values)
            answers = answer_column(columns, self.config.data.answer_key)
            if answers is not None:
                agree += exact_agreement(batch.texts, answers)
                agree_prompt += [start + row for row in rows]
        metrics = {"eval/reward_mean": sum(scores) / len(scores)}
        if len(agree) == len(scores):  # every batch had reference answers
            metrics["eval/accuracy"] = sum(agree) / len(agree)
            if self.config.eval.num_samples > 1:
                metrics[pass_at_k_key(self.config.eval.num_samples)] = pass_at_k(agree, agree_prompt)
        metrics.update({f"eval/reward/{name}": total / len(scores) for name, total in per_fn_sums.items()})
        return metrics


def freeze_warm_up_objects() -> None:
    """Collect once, then move every surviving Python object to the permanent generation (`gc.freeze`).

    A full (generation 2) garbage collection walks every tracked object, and after the first step those
    include all that `torch.compile` and graph capture made: such a walk stops its rank in the middle of a step,
    and with several processes the others wait for it at the next collective. Frozen objects are never walked
    again, so later full collections see only what later steps allocate. (A frozen object that
    later becomes part of unreachable cycles is not reclaimed: at most what the first step left alive.)

    Only the young generations are collected first (what was allocated since the last automatic collection): a
    full collection would walk every object the imports made, a large share of a short run's first step, to find
    a few dozen small dead objects (no tensors, in a CPU run of the demo), which stay frozen instead."""
    gc.collect(1)
    gc.freeze()


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
    """Response lengths, truncation, and the sampler-vs-trainer log-prob mismatch."""
    mask = batch.response_mask
    lengths = mask.sum(1)
    metrics = {"rollout/response_length_mean": lengths.mean(), "rollout/response_length_max": lengths.max(),
               "rollout/truncation_rate": batch.truncated.float().mean()}
    if batch.old_logp is not None:
        diff = (batch.old_logp - batch.sampler_logp).abs() * mask
        metrics["rollout/logprob_diff_mean"] = diff.sum() / mask.sum()
        metrics["rollout/logprob_diff_max"] = diff.max()
        metrics["rollout/logprob_kl"] = algorithms.masked_mean(
            algorithms.kl_penalty(batch.sampler_logp, batch.old_logp, "k3"), mask)
    return metrics


def perf_metrics(batch: RolloutBatch, timer: PhaseTimer, device: torch.device) -> dict[str, float]:
    generated = batch.response_mask.sum().item()
    total_tokens = batch.attention_mask.sum().item()
    step_s = sum(timer.seconds.values())
    metrics = {f"timing/{phase}_s": seconds for phase, seconds in timer.seconds.items()}
    metrics.update({"timing/step_s": step_s, "perf/tokens_per_s": generated / step_s,
                    "perf/rollout_tokens_per_s": generated / max(timer.seconds["rollout"], 1e-9),
                    "perf/update_tokens_per_s": total_tokens / max(timer.seconds["update"], 1e-9)})
    if device.type == "cuda":  # this step's peak, over its phases
        metrics.update({f"perf/peak_memory_{phase}_gib": peak / 2**30 for phase, peak in timer.peak_bytes.items()})
        metrics["perf/peak_memory_gib"] = max(timer.peak_bytes.values(), default=0) / 2**30
        # What the step leaves allocated: flat in a healthy run, so a rise from step to step is a leak.
        metrics["perf/memory_held_gib"] = torch.cuda.memory_allocated(device) / 2**30
    else:  # peak resident memory of the process (Linux reports KiB)
        metrics["perf/peak_memory_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return metrics
