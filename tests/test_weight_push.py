"""Split placement's transport on two gloo processes (rank 0 trains, rank 1 generates): a bucketed weight push
leaves the worker's weights equal to the trainer's (checksums) in its own tensors; scored batches travel back; a
rollout worker killed mid-run ends the trainer's run within the watchdog's bound, naming the worker. Which backend
the weights' link takes follows from the two sides' devices (NCCL only between two GPUs); the NCCL push itself is a
GPU test that needs two GPUs (`pytest -m gpu`)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_actor

from hybridrl.parallel import process_group
from hybridrl.parallel.weight_push import (
    RolloutPeerError,
    buckets,
    connect,
    new_backend,
    push_backend,
    push_tensors,
    push_weights,
    receive_object,
    send_object,
    weights_checksum,
)
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.hf import HFBackend
from hybridrl.training.rollout_process import free_port

HANG_TIMEOUT_S = 20.0
PROMPTS = [[10, 11, 12], [13, 14]]


def test_buckets_keep_order_one_dtype_each_and_the_byte_bound():
    f32, bf16 = torch.float32, torch.bfloat16
    assert buckets([40, 40, 40, 100, 8], [f32] * 5, 100) == [[0, 1], [2], [3], [4]]
    assert buckets([4, 4, 4], [f32, bf16, bf16], 100) == [[0], [1, 2]]
    assert buckets([], [], 100) == []


def test_push_tensors_lists_tied_weights_once():
    model, _ = tiny_actor()
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them
    names = list(model.state_dict())
    assert len(push_tensors(model)) == len(names) - 1


def _join(rank: int, port: int, watchdog: bool) -> process_group.DistributedSetup:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), HYBRIDRL_WATCHDOG="1" if watchdog else "0")
    torch.set_num_threads(1)
    return process_group.init_from_env("cpu", timeout_s=60, hang_timeout_s=HANG_TIMEOUT_S)


def _push_main(rank: int, port: int, out_dir: str) -> None:
    """Rank 0 trains one step and pushes in small buckets; rank 1 receives into its model (other weights before)."""
    setup = _join(rank, port, watchdog=False)
    model, tokenizer = tiny_actor(seed=rank)
    before = weights_checksum(model)
    storages = [tensor.data_ptr() for tensor in push_tensors(model)]
    if rank == 0:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.tensor([PROMPTS[0]])).logits.sum().backward()
        optimizer.step()
    metrics = push_weights(model, source=0, bucket_bytes=4096)
    after = weights_checksum(model)
    # Batches go back: the worker generates with the pushed weights and sends the result to the trainer.
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    generated = [g.token_ids for g in HFBackend(model, tokenizer).generate(PROMPTS, greedy)]
    if rank == 1:
        send_object(generated, 0)
    received = receive_object(1, "a batch") if rank == 0 else None
    torch.save({"before": before, "after": after, "same_storage": storages == [t.data_ptr() for t in push_tensors(model)],
                "metrics": metrics, "generated": generated, "received": received}, f"{out_dir}/rank{rank}.pt")
    process_group.shutdown(setup)


def test_push_makes_the_workers_weights_the_trainers_in_its_own_tensors(tmp_path):
    mp.spawn(_push_main, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    trainer, worker = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert trainer["before"] != worker["before"] and trainer["after"] != trainer["before"]
    assert worker["after"] == trainer["after"]  # bitwise equal weights after the push
    assert worker["same_storage"] and trainer["same_storage"]  # copied into the tensors the engine reads
    assert worker["metrics"]["perf/weight_push_s"] > 0 and worker["metrics"]["perf/weight_push_gib"] > 0
    assert trainer["received"] == worker["generated"] == trainer["generated"]


def _killed_worker_main(rank: int, port: int, out_dir: str) -> None:
    """Rank 1 sends one batch and is killed (SIGKILL); rank 0 waits for the second one."""
    _join(rank, port, watchdog=True)
    from hybridrl.parallel import watchdog

    watchdog.heartbeat()
    if rank == 1:
        send_object(["batch of step 1"], 0)
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    receive_object(1, "the batch of step 1")
    start = time.monotonic()
    watchdog.heartbeat()
    try:
        receive_object(1, "the batch of step 2")
        message = "no error"
    except RolloutPeerError as error:
        message = str(error)
    with open(f"{out_dir}/rank0.txt", "w") as file:
        file.write(f"{time.monotonic() - start:.3f}\n{message}")
    os._exit(0)  # the group is broken: leave without its teardown


def test_a_killed_rollout_worker_ends_the_run_naming_it_within_the_bound(tmp_path):
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_killed_worker_main, args=(rank, port, str(tmp_path))) for rank in (0, 1)]
    start = time.monotonic()
    for process in processes:
        process.start()
    for process in processes:
        process.join(HANG_TIMEOUT_S + 60)
    assert time.monotonic() - start < HANG_TIMEOUT_S + 60
    assert processes[1].exitcode == -signal.SIGKILL
    assert processes[0].exitcode == 0  # it reported the worker itself, before the watchdog's bound
    seconds, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert "rollout worker (rank 1) went away" in message and "batch of step 2" in message, message
    assert float(seconds) < HANG_TIMEOUT_S


@pytest.mark.parametrize("trainer, worker, nccl_available, backend, words", [
    ("cuda:0", "cuda:1", True, "nccl", "different GPUs"),
    ("cuda:3", "cuda:2", True, "nccl", "no CPU staging"),
    ("cuda:1", "cuda:1", True, "gloo", "NCCL refuses two ranks on one GPU"),
    ("cpu", "cpu", True, "gloo", "on the CPU"),
    ("cuda:0", "cpu", True, "gloo", "on the CPU"),
    ("cpu", "cuda:0", True, "gloo", "on the CPU"),
    ("cuda:0", "cuda:1", False, "gloo", "has no NCCL"),
])
def test_the_weights_link_is_nccl_exactly_between_two_gpus(trainer, worker, nccl_available, backend, words):
    chosen, why = push_backend(torch.device(trainer), torch.device(worker), nccl_available)
    assert chosen == backend and words in why


def _nccl_push_main(rank: int, port: int, out_dir: str) -> None:
    """Rank 0 on cuda:0 trains one step and pushes over an NCCL link; rank 1 receives on cuda:1."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank)
    link = connect(port, rank, 60.0, {"weights": "nccl"}, device)["weights"]
    model, _ = tiny_actor(seed=rank)
    model = model.to(device)
    storages = [tensor.data_ptr() for tensor in push_tensors(model)]
    if rank == 0:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.tensor([PROMPTS[0]], device=device)).logits.sum().backward()
        optimizer.step()
    metrics = push_weights(model, source=0, bucket_bytes=4096, group=link)
    torch.save({"after": weights_checksum(model), "link_device": str(link.device), "metrics": metrics,
                "same_storage": storages == [t.data_ptr() for t in push_tensors(model)]}, f"{out_dir}/rank{rank}.pt")
    link.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL link needs two GPUs (NCCL refuses two ranks on one)")
def test_an_nccl_link_between_two_gpus_pushes_the_trainers_weights_into_the_workers_tensors(tmp_path):
    mp.start_processes(_nccl_push_main, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    trainer, worker = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert worker["after"] == trainer["after"]  # bitwise equal weights after the push
    assert worker["same_storage"] and (trainer["link_device"], worker["link_device"]) == ("cuda:0", "cuda:1")
    assert worker["metrics"]["perf/weight_push_gib"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_nccl_link_of_one_rank_sends_its_buckets_from_the_gpu():
    """What one GPU can check of the NCCL link: this torch build makes it as `new_backend` does (options, eager
    connect, abort) and a push's sending side runs over it, its buckets on the GPU."""
    import datetime

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=60))
    link = new_backend("nccl", dist.PrefixStore("weights", store), 0, datetime.timedelta(seconds=60),
                       torch.device("cuda", 0), size=1)
    model, _ = tiny_actor()
    before = weights_checksum(model)
    metrics = push_weights(model.to("cuda"), source=0, bucket_bytes=4096, group=link)
    link.close()
    assert link.device == torch.device("cuda", 0) and metrics["perf/weight_push_gib"] > 0
    assert weights_checksum(model) == before
