"""The rollout worker in a process of its own (`trainer.rollout_worker=process`): split placement on one machine.

The trainer's process (rank 0 of the training processes, when there are several) spawns one rollout process and
links to it with two groups of their own (`weight_push.connect`: trainer 0, worker 1), apart from the training
processes' own group, so that weights and batches never wait for each other: a thread of the trainer broadcasts each
published version (`parallel/weight_push.py`, in buckets, into the worker model's own tensors; over NCCL from the
trainer's GPU when the worker sits on another GPU, else over gloo through the CPU: `push_backend`, its choice logged
at the start), and another receives the generated batches and scores them with the trainer's rewards
(`RLTrainer.score`, the whole batch in that process) while the trainer updates. The worker process only generates:
it holds the data set and the sampler (its position travels with each batch, for checkpoints), and generates the
batch of step b with version `needed_version(b, k)` (`async_pipeline.py`), receiving versions in order as it needs
them. With `env:` it makes the episodes itself, with environments and tool workers of its own built from the config
(one training process). With dynamic sampling the trainer's side scores each round and tells the process whether the
step needs another (`produce_rounds`, as the thread worker does), so the process waits for that answer after each
round.

With several training processes the worker makes each rank's share of the prompts with that rank's seed
(`sharding.rank_share`), the batch the ranks would have generated themselves; rank 0 hands the scored batch to
the other ranks (`AsyncPipeline.take`), and each trains on its rows as in the synchronous loop. The weights it
pushes are the full ones, gathered from the FSDP shards by every rank after the update (`AsyncPipeline.push`).

The same schedule as the thread worker, so a run gives the same metrics with either worker. A worker process that
dies makes the trainer's receive fail at once (the batches' link is gloo in every case), naming rank 1; one that
hangs is named after `trainer.hang_timeout_s` (the links' timeout and the trainer's wait); a push blocked in NCCL
by a peer gone is aborted when the run ends. On one machine, on the rollout device
(`trainer.device_mesh.rollout`, else the trainer's); a worker on another node is not built.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import socket
import threading
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridrl.envs.base import EnvironmentCodeError
from hybridrl.parallel.weight_push import (
    RolloutPeerError,
    broadcast_tensors,
    connect,
    push_backend,
    push_names,
    push_weights,
    receive_object,
    send_object,
)
from hybridrl.training.async_pipeline import (
    STOP_WAIT_S,
    BatchQueue,
    RolloutWorker,
    WeightMailbox,
    generate_batch,
    needed_version,
    produce_rounds,
    rollout_device,
    score_batch,
    with_index,
)
from hybridrl.training.components import build_rollout
from hybridrl.training.episodes import build_environment, build_episode_rollout

TRAINER_RANK, WORKER_RANK = 0, 1

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def join_links(port: int, rank: int, timeout_s: float, weights_backend: str, device: torch.device) -> tuple[Any, Any]:
    """The two links between the trainer and the worker: (weights, batches); the weights' over `weights_backend`
    (`push_backend`: NCCL between two GPUs, on this side's `device`), the pickled batches' over gloo."""
    links = connect(port, rank, timeout_s, {"weights": weights_backend, "batches": "gloo"}, device)
    return links["weights"], links["batches"]


def serve_rollouts(port: int, job: dict[str, Any]) -> None:
    """The rollout process: generate the batches of `first_step`..`last_step` and send them to the trainer. With
    `env:` it runs the episodes itself (its own environments and tool workers, built from the config); an
    environment's error is sent to the trainer as the step's record, which raises it as the user's error."""
    torch.set_num_threads(job["threads"])  # as the trainer's process was set (a fresh process has torch's default)
    config, parts = job["config"], job["parts"]
    if parts.device.type == "cuda":
        torch.cuda.set_device(parts.device)
    weights_link, batches_link = join_links(port, WORKER_RANK, job["timeout_s"], job["weights_backend"], parts.device)
    model = parts.actor.to(parts.device)  # sent on the CPU
    backend = build_rollout(config, model, parts.tokenizer, parts.device)
    episodes = build_episode_rollout(config, build_environment(config), parts.tokenizer, backend, parts.pad_token_id)
    sampler = parts.dataset.sampler(config.trainer.prompts_per_step)
    sampler.load_state_dict(job["sampler_state"])
    version, base = job["version"], job["sampling"]
    with episodes or nullcontext():  # the tool workers end with the process's work
        for step in range(job["first_step"], job["last_step"] + 1):
            while version < needed_version(step, job["max_staleness"]):  # versions arrive in order, one per update
                push_weights(model, TRAINER_RANK, group=weights_link)
                version += 1
            for generation_round in itertools.count():  # dynamic sampling: until the trainer has enough groups
                indices = next(sampler)
                start = time.perf_counter()
                # RLTrainer.sampling_params's seed grows by one per step and by `round_stride` per round
                params = dataclasses.replace(base, seed=base.seed + step + job["round_stride"] * generation_round)
                record = {"step": step, "version": version, "indices": indices}
                try:
                    record.update(generate_step(backend, episodes, parts, indices, params, job["num_ranks"]))
                except EnvironmentCodeError as error:
                    send_object({**record, "error": str(error)}, TRAINER_RANK, group=batches_link)
                    batches_link.barrier()  # the trainer has the error before this process goes away
                    return
                send_object({**record, "sampler_state": sampler.state_dict(),
                             "generate_s": time.perf_counter() - start}, TRAINER_RANK, group=batches_link)
                if not (config.algorithm.dynamic_sampling and
                        receive_object(TRAINER_RANK, f"whether step {step} needs another round",
                                       group=batches_link)["more"]):
                    break
    batches_link.barrier()  # the trainer has received everything before the links go away


@torch.no_grad()
def generate_step(backend: Any, episodes: Any, parts: Any, indices: list[int], params: Any,
                  num_ranks: int) -> dict[str, Any]:
    """One step's batch (single-turn, or `env:` episodes) and its rollout metrics."""
    prompts = parts.dataset.batch(indices)
    if episodes is None:
        return {"batch": generate_batch(backend, parts, prompts["prompt_ids"], params, num_ranks), "metrics": {}}
    batch, metrics = episodes.generate(backend, prompts, params)
    backend.release_memory()
    return {"batch": batch.to(torch.device("cpu")), "metrics": metrics}


@dataclasses.dataclass
class WorkerParts:
    """What the rollout process needs of the trainer's `Components` (sent to it when it starts)."""

    actor: torch.nn.Module
    tokenizer: Any
    pad_token_id: int
    dataset: Any
    device: torch.device


class ProcessWorker(BatchQueue):
    """The trainer's side of the rollout process: the same interface as the thread worker (`RolloutWorker`)."""

    serve = staticmethod(serve_rollouts)
    """What the rollout process runs (`serve_rollouts(port, job)`; a test may wrap it to look inside)."""

    def __init__(self, trainer: Any, max_staleness: int, first_step: int, last_step: int, version: int,
                 lock: threading.Lock, mailbox: WeightMailbox, model: torch.nn.Module):
        super().__init__()
        self.trainer, self.max_staleness, self.mailbox = trainer, max_staleness, mailbox
        self.model = model
        """The worker's copy of the actor (version `version`), sent to the rollout process when it starts. Its
        parameters keep `requires_grad` as the trainer's: on the CPU, generating with parameters that do not
        require gradients (even under no_grad) rounded some log-probs differently from the trainer's own rollout."""
        self.first_step, self.last_step, self.version = first_step, last_step, version
        self.process: Any = None
        self.threads: list[threading.Thread] = []
        self.label = f"rollout worker (process, rank {WORKER_RANK})"
        self.broadcast_s = 0.0
        """The last version's broadcast, logged as `perf/weight_broadcast_s` (the trainer's thread waits for the
        worker to ask for it, so this is transfer time only once the worker is waiting)."""
        trainer_device, worker_device = with_index(trainer.parts.device), rollout_device(trainer)
        self.push_link = push_backend(trainer_device, worker_device, dist.is_nccl_available())
        """(backend, why) of the weights link (`weight_push.push_backend`), logged when the process starts."""
        self.weights_device = trainer_device if self.push_link[0] == "nccl" else torch.device("cpu")
        """Where the trainer publishes each version for the broadcast: its own GPU for NCCL (a bucket leaves from
        there), the CPU for gloo (where a bucket is staged anyway)."""

    def start(self) -> None:
        trainer, parts = self.trainer, self.trainer.parts
        timeout_s = trainer.config.trainer.hang_timeout_s
        sampler_state = trainer.sampler.state_dict()
        job = {"config": trainer.config, "timeout_s": timeout_s, "threads": torch.get_num_threads(),
               "max_staleness": self.max_staleness, "first_step": self.first_step, "last_step": self.last_step,
               "version": self.version, "sampler_state": sampler_state, "sampling": trainer.sampling_params(step=0, generation_round=0),
               "round_stride": trainer.sampling_params(step=0, generation_round=1).seed
               - trainer.sampling_params(step=0, generation_round=0).seed,
               "num_ranks": parts.setup.world_size, "weights_backend": self.push_link[0],
               "parts": WorkerParts(self.model.cpu(), parts.tokenizer, parts.pad_token_id, parts.dataset,
                                    rollout_device(trainer))}
        self.names = push_names(self.model)
        port = free_port()
        self.process = mp.get_context("spawn").Process(target=self.serve, args=(port, job), daemon=True,
                                                       name="hybridrl-rollout-process")
        self.process.start()
        self.model = None  # the process has its own copy now
        backend, why = self.push_link
        logger.info("rollout process on %s: weights pushed over %s (%s)", job["parts"].device, backend.upper(), why)
        self.weights_link, self.batches_link = join_links(port, TRAINER_RANK, timeout_s, backend, self.weights_device)
        self.label = f"rollout worker (process {self.process.pid}, rank {WORKER_RANK})"
        self.threads = [threading.Thread(target=self.receive_batches, daemon=True),
                        threading.Thread(target=self.push_versions, daemon=True)]
        for thread in self.threads:
            thread.start()

    def alive(self) -> bool:
        return self.threads[0].is_alive() or bool(self.ready)

    def stop(self) -> None:
        """End the rollout process if it still runs (its run ended early: nothing will take its batches); the mailbox
        is closed first, so the pushing thread returns, and the receiving one fails once its peer is gone."""
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_WAIT_S)
        if self.threads:  # the process has ended: end an NCCL link too (a push blocked in it is released)
            self.weights_link.close()
        for thread in self.threads:
            thread.join(STOP_WAIT_S)

    def receive_batches(self) -> None:
        """Each step's rounds (`produce_rounds`: with dynamic sampling the trainer's side decides whether the process
        makes another), scored here and handed to the trainer."""
        dynamic = self.trainer.config.algorithm.dynamic_sampling
        try:
            for step in range(self.first_step, self.last_step + 1):
                item = produce_rounds(self.trainer, step, self.receive_round)
                if dynamic:
                    send_object({"more": False}, WORKER_RANK, group=self.batches_link)
                self.deliver(step, item)
            self.batches_link.barrier()  # every version was pushed before the last batch was generated
        except EnvironmentCodeError as error:  # raised in the rollout process, which waits until this side has it
            self.fail(error)
            self.batches_link.barrier()
        except BaseException as error:
            self.fail(error)

    def receive_round(self, step: int, generation_round: int) -> Any:
        """The rollout process's next round of `step` (asking for it after the first), scored."""
        if generation_round:
            send_object({"more": True}, WORKER_RANK, group=self.batches_link)
        record = receive_object(WORKER_RANK, f"the batch of step {step}", group=self.batches_link)
        if "error" in record:  # the environment's code raised in the rollout process
            raise EnvironmentCodeError(record["error"])
        item = score_batch(self.trainer, step, record["version"], record["indices"], record["sampler_state"],
                           record["batch"], record["generate_s"])
        item.rollout_metrics = record["metrics"]
        return item

    def push_versions(self) -> None:
        """Broadcast versions version+1, version+2, ... as the trainer publishes them, while the worker needs them."""
        names = self.names
        last_needed = needed_version(self.last_step, self.max_staleness)
        if self.weights_device.type == "cuda":  # per thread: NCCL launches on the current GPU
            torch.cuda.set_device(self.weights_device)
        try:
            for version in range(self.version + 1, last_needed + 1):
                state = self.mailbox.take(version)
                if state is None:
                    return
                pushed = broadcast_tensors([state[name] for name in names], TRAINER_RANK, group=self.weights_link)
                self.broadcast_s = pushed["perf/weight_push_s"]  # from the worker's call to its last byte
        except RuntimeError as error:
            self.fail(RolloutPeerError(f"the rollout worker (rank {WORKER_RANK}) went away while the trainer pushed "
                                       f"version {version}: {error}"))


ROLLOUT_WORKERS = {"thread": RolloutWorker, "process": ProcessWorker}
"""`trainer.rollout_worker` -> the worker class."""
