"""Rollout and training at the same time: a bounded-staleness pipeline (`trainer.max_staleness=k`).

With k = 0 the trainer's own synchronous loop runs and this module is not used. With k > 0:

- **Who generates.** A rollout worker (a thread of the trainer's process here, or a process of its own) owns a
  copy of the actor and its own rollout backend built on that copy. For each step b it draws the step's prompts
  from the data sampler and generates with the copy; the responses are scored with the trainer's reward code
  (`RLTrainer.score`) off the trainer's thread, so a slow reward or tool overlaps with the trainer's update
  instead of stopping it. The trainer meanwhile computes log-probs, advantages and the update of an earlier step.
- **Versions.** Version v is the policy after v optimizer updates. The batch of step b is always generated with
  version `max(0, b - 1 - k)`: exactly k versions behind the trainer that consumes it (k = 0 is on-policy), a
  fixed schedule rather than "whatever was newest", so a run is reproducible and resumes exactly. By default
  weights do not change under a running sequence, so every sequence has one version (`Trajectories.versions`,
  (B,)); with `trainer.partial_rollout` the thread worker takes newer published weights over between segments of
  a batch and records each token's version (`partial_rollout.py`; no longer bitwise reproducible).
- **The bound.** The worker waits for the version its next batch needs (pushed by the trainer after its update),
  so it runs at most k + 1 batches ahead; the trainer takes batches in step order and refuses one whose lag
  (its version - the batch's) is above k.
- **Weight push.** After update v the trainer publishes a copy of its weights when a later batch needs version v
  (`perf/weight_push_s`: the trainer's cost); the worker copies them into its model's own tensors before the
  batch that needs them (the built-in engine re-reads those tensors at every `generate`). With
  `trainer.device_mesh.rollout` (or `trainer.rollout_device`) the worker's copy lives on another device (rollout
  on GPU 1, training on GPU 0): the published copy is made there, across devices, so the worker's load is an
  on-device copy, and the finished batches come back to the trainer's device in `take`. Across processes the
  same push is a bucketed broadcast (`parallel/weight_push.py`: NCCL between two GPUs, else gloo through the CPU),
  published where the broadcast sends from; with several training processes every rank gathers the full weights
  from its FSDP shards for it, and rank 0 publishes them.
- **Off-policy correction.** The trainer's log-prob pass gives pi_old under its current weights; the batch keeps
  the behaviour log-probs the worker's sampler recorded (`sampler_logp`), so the existing corrections apply
  unchanged: truncated importance sampling (`algorithm.rollout_correction_cap`) and sequence-level masking
  (`algorithm.rollout_sequence_mask_threshold`), logged as `actor/rollout_correction_*`. Staleness is logged
  as `rollout/staleness_mean` and `rollout/staleness_max` (versions, per sequence), the trainer's wait for a
  batch as `timing/rollout_s`, the worker's own times as `timing/worker_generate_s` and `timing/worker_reward_s`.
- **Checkpoints.** After step s the batches of steps s+1..s+k were generated with weights older than the
  checkpoint's, so they are saved with it (JSON: token ids, behaviour log-probs, scores, versions, the prompts'
  data indices), together with the data sampler's position after the last of them. Resuming refills the queue
  and starts the worker at step s+k+1, which needs version s: the checkpoint's own weights. A resumed run
  therefore gives the metrics of an uninterrupted one.
- **Determinism.** The Hugging Face backend seeds torch's default generator, one per process, at every call, so
  all `generate` calls of pipelines (workers and the trainers' held-out evaluation) take turns under one lock per
  process (`GENERATE_LOCK`, `take_turns`). A worker ends with its run (`AsyncPipeline.close`, when `train()`
  returns or raises): a run stopped early would otherwise leave its worker generating the next batch, reseeding
  that generator in the middle of a later run's `generate` in the same process (a resumed run, a test), which
  then sampled other tokens. The worker's scoring and the trainer's held-out evaluation's take turns as well (per
  run): a reward model's or judge's engine serves one call at a time.
- **Rounds and episodes.** The thread worker builds the batch the trainer's own step would: with
  `algorithm.dynamic_sampling` it runs the refill rounds (`dynamic_sampling.keep_informative`, each round's seed as
  the trainer's), and with `env:` it generates multi-turn episodes through the run's `EpisodeRollout`.

Where the worker runs: here, a thread (`RolloutWorker`); `rollout_process.py` puts the same schedule in a process of
its own (`env:` episodes with its own environments; dynamic sampling's rounds as the trainer's side asks for them),
beside one or several training processes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import torch

from hybridrl.envs.base import EnvironmentCodeError
from hybridrl.parallel import placement, sharding
from hybridrl.parallel.process_group import DistributedSetup, broadcast_object
from hybridrl.parallel.weight_push import full_weights, unsharded_copy
from hybridrl.rewards import RewardError
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.graph_rng import CAPTURE_LOCK, draws_random_numbers
from hybridrl.training.batch import RolloutBatch, build_rollout_batch, decode_responses
from hybridrl.training.components import build_rollout
from hybridrl.training.dynamic_sampling import keep_informative
from hybridrl.training.partial_rollout import generate_in_segments, token_versions_tensor
from hybridrl.training.trajectories import Trajectories, staleness_metrics

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How often a waiting thread looks whether the other side has stopped."""
STOP_WAIT_S = 2.0
"""How long `close` waits for a stopping worker (its `generate` in flight, then its thread or process)."""
USER_CODE_ERRORS = (RewardError, EnvironmentCodeError)
"""Raised by the user's reward or environment code: the trainer saves the finished steps before it stops."""
GENERATE_LOCK = threading.RLock()
"""Held by each `generate` call of a pipeline's backends: torch's default generator is one per process."""


def needed_version(step: int, max_staleness: int) -> int:
    """The policy version that generates the batch of `step` (1-based): k versions behind its consumer."""
    return max(0, step - 1 - max_staleness)


class WorkerStopped(Exception):
    """Raised by a stopped worker's `generate` call instead of generating: the run it belonged to has ended."""


def take_turns(backend: Any, lock: threading.RLock, stopped: threading.Event | None = None) -> Any:
    """`backend`, its `generate` and `generate_episodes` calls now taking turns with other holders of `lock` (see the
    module's Determinism note; reentrant, as episodes call `generate`); set on the instance, so its type and
    everything else stay as they were. Once `stopped` is set, a call raises `WorkerStopped`: it is checked under the
    lock, so a stopper that sets it under the lock knows that no call runs or will start."""
    for name in ("generate", "generate_episodes"):
        if callable(getattr(backend, name, None)):
            setattr(backend, name, in_turn(getattr(backend, name), lock, stopped))
    return backend


def in_turn(method: Any, lock: threading.RLock, stopped: threading.Event | None) -> Any:
    """`method`, called under `lock`, refused once `stopped` is set (see `take_turns`)."""
    def call_in_turn(*args: Any, **kwargs: Any) -> Any:
        with lock:
            if stopped is not None and stopped.is_set():
                raise WorkerStopped("the rollout worker was stopped")
            return method(*args, **kwargs)

    return call_in_turn


class WeightMailbox:
    """Versions the trainer published and the worker has not loaded yet (at most k at a time)."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.published: dict[int, dict[str, torch.Tensor]] = {}
        self.closed = False

    def publish(self, version: int, weights: dict[str, torch.Tensor], device: torch.device) -> None:
        """A copy of `weights` (a model's state_dict) on `device` (the worker's): across GPUs the copies are queued
        without waiting (non_blocking) and waited for once, so the worker never reads a tensor still in flight."""
        state = {name: tensor.detach().to(device, non_blocking=True, copy=True) for name, tensor in weights.items()}
        for used in {tensor.device for tensor in weights.values()} | {device}:
            if used.type == "cuda":
                torch.cuda.synchronize(used)
        with self.condition:
            self.published[version] = state
            self.condition.notify_all()

    def take(self, version: int) -> dict[str, torch.Tensor] | None:
        """The weights of `version` (older ones are dropped), or None once closed."""
        with self.condition:
            while version not in self.published and not self.closed:
                self.condition.wait(POLL_S)
            if self.closed:
                return None
            for older in [v for v in self.published if v < version]:
                del self.published[older]
            return self.published.pop(version)

    def newest(self, after: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest published version above `after` (it and older ones leave the box), or None: without waiting."""
        with self.condition:
            newer = [version for version in self.published if version > after]
            if not newer:
                return None
            version = max(newer)
            for older in [v for v in self.published if v < version]:
                del self.published[older]
            return version, self.published.pop(version)

    def close(self) -> None:
        with self.condition:
            self.closed = True
            self.condition.notify_all()


class BatchQueue:
    """The scored batches a worker has ready, by step, and the error that stopped it; the trainer's side waits here."""

    label = "rollout worker"
    """How errors name the worker."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.ready: dict[int, Trajectories] = {}
        self.error: BaseException | None = None

    def alive(self) -> bool:
        raise NotImplementedError

    def deliver(self, step: int, item: Trajectories) -> None:
        with self.condition:
            self.ready[step] = item
            self.condition.notify_all()

    def fail(self, error: BaseException) -> None:
        """Hand `error` to the trainer, which raises it with the worker named; the first one stays (a rollout process
        that stopped on an error also breaks the weight push afterwards)."""
        with self.condition:
            self.error = self.error or error
            self.condition.notify_all()

    def wait_for(self, step: int, timeout_s: float) -> Trajectories:
        """The batch of `step` once it is ready; raises, naming the worker, if it failed or stopped."""
        deadline = time.monotonic() + timeout_s
        with self.condition:
            while step not in self.ready:
                if isinstance(self.error, USER_CODE_ERRORS):  # the trainer saves the finished steps, as synchronous
                    raise type(self.error)(f"{self.error} (raised in the {self.label} while producing the batch of "
                                           f"step {step})") from self.error
                if self.error is not None:
                    raise RuntimeError(f"the {self.label} failed while producing the batch of step {step}: "
                                       f"{type(self.error).__name__}: {self.error}") from self.error
                if not self.alive() or time.monotonic() > deadline:
                    state = "stopped" if not self.alive() else f"produced nothing for {timeout_s:.0f} s"
                    raise RuntimeError(f"the {self.label} {state} before the batch of step {step}; stopping the run "
                                       "(trainer.hang_timeout_s)")
                self.condition.wait(POLL_S)
            return self.ready.pop(step)

    def peek(self, step: int, timeout_s: float) -> Trajectories:
        """The batch of `step`, left in place (for a checkpoint)."""
        item = self.wait_for(step, timeout_s)
        with self.condition:
            self.ready[step] = item
        return item


def generate_batch(backend: Any, parts: Any, prompt_ids: list[list[int]], params: SamplingParams,
                   num_ranks: int = 1) -> RolloutBatch:
    """One step's responses as a batch on the CPU, with their texts: what `RLTrainer.rollout` builds on `num_ranks`
    training processes (each rank's share of the prompts with that rank's seed, `sharding.rank_share`)."""
    generations: list[Any] = []
    for rank in range(num_ranks):
        start, stop, share_params = sharding.rank_share(len(prompt_ids), params, rank, num_ranks)
        share = sharding.generate_sharded(backend, prompt_ids[start:stop], share_params, DistributedSetup(),
                                          decode=lambda part: decode_responses(parts.tokenizer, part)) \
            if stop > start else []
        for generation in share:
            generation.prompt_index += start
        generations += share
    return batch_of(backend, parts, prompt_ids, generations, params)


def batch_of(backend: Any, parts: Any, prompt_ids: list[list[int]], generations: list[Any],
             params: SamplingParams) -> RolloutBatch:
    """Generations (with their texts) as a batch on the CPU, after the backend has freed its cache."""
    backend.release_memory()
    batch = build_rollout_batch(prompt_ids, generations, parts.pad_token_id, params.max_new_tokens, sampling=params)
    batch.texts = [generation.text for generation in generations]
    return batch


def score_batch(trainer: Any, step: int, version: int, indices: list[int], sampler_state: dict[str, int],
                batch: RolloutBatch, generate_s: float) -> Trajectories:
    """The batch scored by the trainer's rewards (`RLTrainer.score`), as the trainer takes it."""
    start, samples, shown = time.perf_counter(), [], trainer.logger.num_samples_to_print
    with trainer.pipeline.score_lock:  # the rewards' call and its metrics, not held-out evaluation's in between
        reward_metrics = {key: float(value) for key, value in trainer.score(  # the whole batch in this process
            batch, trainer.parts.dataset.batch(indices), whole_batch=True,
            add_samples=lambda *columns: samples.extend(list(column[:shown]) for column in columns)).items()}
    batch.scores = batch.scores.cpu()
    return Trajectories(step=step, versions=torch.full((len(batch),), version), indices=indices, batch=batch,
                        reward_metrics=reward_metrics, sampler_state=sampler_state, generate_s=generate_s,
                        reward_s=time.perf_counter() - start, samples=samples)


def rollout_device(trainer: Any) -> torch.device:
    """Where the worker's copy of the actor lives: `trainer.device_mesh.rollout`, `trainer.rollout_device`, or the
    trainer's own device; a bare "cuda" gets the current GPU's index (the worker thread sets its current device
    from it)."""
    t = trainer.config.trainer
    return with_index(torch.device(placement.rollout_device(t.device_mesh) or t.rollout_device or trainer.parts.device))


def with_index(device: torch.device) -> torch.device:
    """`device`, a bare "cuda" given the current GPU's index (other devices as they are)."""
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def draws_beside_captures(trainer: Any, worker_class: Any) -> bool:
    """Whether the trainer's thread draws from the default CUDA generator of a GPU where a thread worker's engine
    captures graphs: then it trains holding `graph_rng.CAPTURE_LOCK`, so that no capture starts meanwhile."""
    device, parts = with_index(trainer.parts.device), trainer.parts
    return (issubclass(worker_class, RolloutWorker) and device.type == "cuda" and rollout_device(trainer) == device
            and any(draws_random_numbers(model) for model in (parts.actor, parts.critic) if model is not None))


def current_device(device: torch.device) -> Any:
    """A context making `device` the current CUDA device (nothing for the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def produce_rounds(trainer: Any, step: int, roll_out_and_score: Any) -> Trajectories:
    """The batch of `step`: a round of prompts rolled out and scored (`roll_out_and_score(step, round)`), and with
    `algorithm.dynamic_sampling` further rounds until it has enough informative groups, as the trainer's own step
    does. Both workers build their batches here."""
    rounds, config = [], trainer.config

    def next_round(round_index: int) -> RolloutBatch:
        rounds.append(roll_out_and_score(step, round_index))
        return rounds[-1].batch

    batch, counts = next_round(0), {}
    if config.algorithm.dynamic_sampling:
        batch, counts = keep_informative(batch, next_round, config.trainer.prompts_per_step,
                                         config.algorithm.dynamic_sampling_max_rounds, trainer.parts.pad_token_id)
    first = rounds[0]  # `reward/*` and the episodes' metrics: the first round's, as in the trainer's step
    whole = batch is first.batch  # one round, as made (partial rollouts: the version may change within it)
    version = int(rounds[-1].versions.max())  # several rounds: one version (no partial rollouts with them)
    return Trajectories(step=step, versions=first.versions if whole else torch.full((len(batch),), version),
                        token_versions=first.token_versions if whole else None,
                        indices=[index for item in rounds for index in item.indices], batch=batch,
                        reward_metrics=first.reward_metrics, sampler_state=rounds[-1].sampler_state,
                        generate_s=sum(item.generate_s for item in rounds),
                        reward_s=sum(item.reward_s for item in rounds),
                        rollout_metrics={**first.rollout_metrics, **counts},
                        samples=rounds[-1].samples)  # the last round's, as the trainer's step shows


class RolloutWorker(threading.Thread, BatchQueue):
    """Generates and scores the batches of steps `first_step`..`last_step` in order, in a thread of the trainer's
    process with a copy of the actor (see the module docstring)."""

    def __init__(self, trainer: Any, max_staleness: int, first_step: int, last_step: int, version: int,
                 lock: threading.Lock, mailbox: WeightMailbox, model: torch.nn.Module):
        threading.Thread.__init__(self, name="hybridrl-rollout-worker", daemon=True)
        BatchQueue.__init__(self)
        self.label = "rollout worker (thread 'hybridrl-rollout-worker')"
        self.trainer, self.max_staleness = trainer, max_staleness
        self.first_step, self.last_step, self.version = first_step, last_step, version
        self.mailbox, self.lock, self.stopped = mailbox, lock, threading.Event()
        self.partial = trainer.config.trainer.partial_rollout
        parts = trainer.parts
        self.device = rollout_device(trainer)
        self.weights_device = self.device
        """Where the trainer publishes the copies this worker loads: on its own device."""
        self.model = model.to(self.device)  # a copy of version `version`: the trainer's weights now
        with current_device(self.device):  # the engine sizes its KV cache and builds kernels on the current GPU
            self.backend = take_turns(build_rollout(trainer.config, self.model, parts.tokenizer, self.device), lock,
                                      self.stopped)

    def alive(self) -> bool:
        return self.is_alive()

    def run(self) -> None:
        try:
            if self.device.type == "cuda":  # per thread: Triton kernels and CUDA graphs launch on the current GPU
                torch.cuda.set_device(self.device)
            for step in range(self.first_step, self.last_step + 1):
                if self.stopped.is_set() or not self.load_version(needed_version(step, self.max_staleness)):
                    return
                self.deliver(step, self.produce(step))
        except WorkerStopped:
            return
        except BaseException as error:
            self.fail(error)

    def stop(self) -> None:
        """End the worker (its run has ended; the mailbox is closed first). Once this returns no `generate` of it
        runs or will start; its thread may still finish a reward call, for which this waits a little."""
        locked = self.lock.acquire(timeout=STOP_WAIT_S)
        self.stopped.set()
        if locked:
            self.lock.release()
        else:
            logger.warning("the rollout worker's generate call is still running %.0f s after its run ended",
                           STOP_WAIT_S)
        self.join(STOP_WAIT_S)

    def load_version(self, version: int) -> bool:
        """Load `version` from the mailbox; a version older than the one held (a run resumed with more steps
        than its checkpoint queued batches for) is served by the one held, which is only less stale."""
        if version <= self.version:
            return True
        state = self.mailbox.take(version)
        if state is None:
            return False
        self.model.load_state_dict(state)  # copies into the model's own tensors, which the engine reads
        self.version = version
        return True

    @torch.no_grad()
    def produce(self, step: int) -> Trajectories:
        return produce_rounds(self.trainer, step, self.roll_out_and_score)

    def roll_out_and_score(self, step: int, generation_round: int) -> Trajectories:
        """Fresh prompts from the data, their responses (or multi-turn episodes) and scores."""
        trainer = self.trainer
        indices = next(trainer.sampler)
        sampler_state = trainer.sampler.state_dict()
        prompts = trainer.parts.dataset.batch(indices)
        params = trainer.sampling_params(step=step, generation_round=generation_round)
        start = time.perf_counter()
        versions, episode_metrics = None, {}
        if trainer.parts.episodes is not None:  # multi-turn: the batch is the episodes' ids (`episodes.py`)
            batch, episode_metrics = trainer.parts.episodes.generate(self.backend, prompts, params)
            self.backend.release_memory()
        elif self.partial != "off" and self.max_staleness > 0:  # k = 0: no version can land during a batch
            batch, versions, episode_metrics = self.generate_partial(prompts["prompt_ids"], params)
        else:
            batch = generate_batch(self.backend, trainer.parts, prompts["prompt_ids"], params)
        item = score_batch(trainer, step, self.version, indices, sampler_state, batch, time.perf_counter() - start)
        item.rollout_metrics = episode_metrics
        if versions is not None:
            item.token_versions = token_versions_tensor(versions, batch.response_length)
            item.versions = torch.tensor([min(own, default=self.version) for own in versions])
        return item

    def generate_partial(self, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[Any, list, dict]:
        """The batch in segments, taking over newer weights between them (`partial_rollout.py`)."""
        generations, versions, counts = generate_in_segments(self.backend, prompt_ids, params, self.version,
                                                             self.take_newer, self.partial)
        for generation, text in zip(generations, decode_responses(self.trainer.parts.tokenizer, generations)):
            generation.text = text
        metrics = {"rollout/partial_takeovers": float(counts.takeovers),
                   "rollout/partial_requeued": float(counts.requeued)}
        return batch_of(self.backend, self.trainer.parts, prompt_ids, generations, params), versions, metrics

    def take_newer(self) -> int | None:
        """Load the newest version the trainer has published, if newer than the one held; between segments."""
        newest = self.mailbox.newest(self.version)
        if newest is None:
            return None
        self.version, state = newest
        self.model.load_state_dict(state)
        return self.version


class AsyncPipeline:
    """The trainer's side: `take` the step's batch, `push` weights after the update, and the checkpoint state.

    With several training processes the worker belongs to rank 0, which hands each batch (or the error that
    stopped the worker) to the other ranks (`share`); every rank takes part in gathering the weights the worker
    gets (`weight_push.unsharded_copy`, `full_weights`)."""

    def __init__(self, trainer: Any, max_staleness: int, worker_class: Any = None):
        self.trainer, self.max_staleness = trainer, max_staleness
        self.setup = trainer.parts.setup
        self.worker_class = worker_class or RolloutWorker
        """The thread worker, or `rollout_process.ProcessWorker` (the same interface)."""
        a = trainer.config.algorithm
        if max_staleness and a.rollout_correction_cap is None and a.rollout_sequence_mask_threshold is None \
                and self.setup.is_main:
            logger.warning("trainer.max_staleness=%d trains on batches up to %d updates old with no off-policy "
                           "correction; set algorithm.rollout_correction_cap=2.0 (docs/training.md)",
                           max_staleness, max_staleness)
        self.lock = GENERATE_LOCK
        take_turns(trainer.parts.rollout, self.lock)  # held-out evaluation takes turns with the worker
        # Scoring too: a reward model's or judge's engine serves one call at a time, and `RLTrainer.score` reads the
        # rewards' per-call metrics after its call. Per run, so a reward that hangs blocks only its own run.
        self.score_lock = threading.RLock()
        trainer.parts.rewards.score = in_turn(trainer.parts.rewards.score, self.score_lock, None)
        if draws_beside_captures(trainer, self.worker_class):  # see rollout/engine/graph_rng.py
            trainer.train_on = in_turn(trainer.train_on, CAPTURE_LOCK, None)
        self.mailbox = WeightMailbox()
        self.worker: Any = None
        """The worker of the running `train()`, or the last one's (ended) after it; None on ranks other than 0."""
        self.running = False
        self.restored: list[Trajectories] = []
        self.last_sampler_state: dict[str, int] | None = None

    def start(self, step: int) -> None:
        """Start the worker before the trainer's `step`, with the trainer's weights as they are now (version
        step - 1); it begins at the first step whose batch was not restored from a checkpoint."""
        trainer = self.trainer
        model = unsharded_copy(trainer.parts.actor, self.setup)  # every rank: the shards are gathered
        if self.setup.is_main:
            self.worker = self.worker_class(trainer, self.max_staleness, step + len(self.restored),
                                            trainer.config.trainer.total_steps, version=step - 1, lock=self.lock,
                                            mailbox=self.mailbox, model=model)
            for item in self.restored:
                self.worker.ready[item.step] = item
        self.restored = []
        self.last_sampler_state = trainer.sampler.state_dict()  # after the restored batches' prompts
        if self.worker is not None:
            self.worker.start()
        self.running = True

    def take(self, step: int, device: torch.device) -> tuple[RolloutBatch, dict[str, float], dict[str, float]]:
        """The scored batch of `step` on `device`, its reward metrics, and the pipeline's metrics."""
        if not self.running:
            self.start(step)
        item, metrics = self.share(lambda: self.await_batch(step))
        self.last_sampler_state = item.sampler_state
        if item.samples:
            self.trainer.logger.add_samples(*item.samples)
        return item.batch.to(device), item.reward_metrics, metrics

    def await_batch(self, step: int) -> tuple[Trajectories, dict[str, float]]:
        """Rank 0: the worker's batch of `step`, checked against the bound, and the pipeline's metrics."""
        item = self.worker.wait_for(step, self.trainer.config.trainer.hang_timeout_s)
        lag = step - 1 - int(item.versions.min())
        if lag > self.max_staleness:
            raise RuntimeError(f"the batch of step {step} is {lag} versions old, above trainer.max_staleness="
                               f"{self.max_staleness}; the rollout worker ran ahead of its bound")
        mask = item.batch.response_mask
        metrics = {**item.rollout_metrics, **staleness_metrics(item.versions, step - 1, item.token_versions, mask),
                   "timing/worker_generate_s": item.generate_s, "timing/worker_reward_s": item.reward_s}
        if hasattr(self.worker, "broadcast_s"):  # the process worker: the push's broadcast, done in a thread
            metrics["perf/weight_broadcast_s"] = self.worker.broadcast_s
        return item, metrics

    def share(self, produce: Any) -> Any:
        """`produce()` on rank 0, its result on every rank; an error there is raised on every rank (a reward's as
        a `RewardError`, so that every rank saves the finished steps together, as in the synchronous loop)."""
        if not self.setup.is_distributed:
            return produce()
        outcome: Any = None
        if self.setup.is_main:
            try:
                outcome = ("ok", produce())
            except BaseException as error:
                broadcast_object(("error", isinstance(error, USER_CODE_ERRORS), str(error)), self.setup)
                raise
        outcome = broadcast_object(outcome, self.setup)
        if outcome[0] == "error":
            user_code, message = outcome[1:]
            raise (RewardError if user_code else RuntimeError)(f"{message} (on training rank 0)")
        return outcome[1]

    def push(self, version: int) -> dict[str, float]:
        """After update `version`: publish the weights if a later batch is generated with them (every rank calls
        this: with several, the shards are gathered)."""
        start = time.perf_counter()
        if version + 1 + self.max_staleness <= self.trainer.config.trainer.total_steps:
            weights = full_weights(self.trainer.parts.actor, self.setup)
            if weights is not None:  # rank 0, the worker's owner
                self.mailbox.publish(version, weights, self.worker.weights_device)
        return {"perf/weight_push_s": time.perf_counter() - start}

    def close(self) -> None:
        """End the worker with the run (see the module's Determinism note). What it had ready for the next steps
        stays, as a checkpoint would restore it, so a later `train()` of this trainer continues where this ended
        (one process; with several, rank 0 keeps them)."""
        self.mailbox.close()
        if not self.running:
            return
        self.running = False
        if self.worker is not None:
            self.worker.stop()
            self.restored = self.ready_batches()
        sampler = self.restored[-1].sampler_state if self.restored else self.last_sampler_state
        if sampler is not None:  # the worker drew prompts for batches it will not deliver
            self.trainer.sampler.load_state_dict(sampler)
        self.mailbox = WeightMailbox()

    def ready_batches(self) -> list[Trajectories]:
        """The worker's batches of the next steps, in order, as far as they are ready now."""
        with self.worker.condition:
            ready = dict(self.worker.ready)
        batches, step = [], self.trainer.step_count + 1
        while step + len(batches) in ready:
            batches.append(ready[step + len(batches)])
        return batches

    def state_dict(self) -> dict[str, Any]:
        """The queued batches (steps s+1..s+k, waited for) and the data position after the last of them. After
        the worker failed (the trainer saves the finished steps of a run whose reward or environment code raised),
        those that are ready: the resumed worker generates the rest with the checkpoint's weights. Rank 0's
        (the one saved); the other ranks hold no batches ahead."""
        step, total = self.trainer.step_count, self.trainer.config.trainer.total_steps
        queued = self.restored
        if self.running and self.worker is None:
            queued = []
        elif self.running and self.worker.error is not None:
            queued = self.ready_batches()
        elif self.running:
            timeout = self.trainer.config.trainer.hang_timeout_s
            queued = [self.worker.peek(later, timeout) for later in range(step + 1, min(step + self.max_staleness,
                                                                                       total) + 1)]
        sampler = queued[-1].sampler_state if queued else self.last_sampler_state
        return {"queued": [item.to_json() for item in queued], "sampler": sampler}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before the worker starts (the trainer's resume runs before its first step)."""
        assert not self.running, "the pipeline's state is restored before its worker starts"
        self.restored = [Trajectories.from_json(record) for record in state["queued"]]
        if state["sampler"] is not None:
            self.trainer.sampler.load_state_dict(state["sampler"])
