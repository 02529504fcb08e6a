"""Data parallelism: FSDP2 over two gloo processes matches one process; world size 1 is the identity.

The two-process test spawns both ranks once and checks, in order: rollout from gathered weights
(HF generate and the built-in engine, ranks decoding different numbers of steps) equals one process;
PPO mini-batch updates with token-balanced row splits give the same losses and parameters as one
process on the same global batch (tolerance: atol 2e-6 on parameters, rel 1e-5 on losses, float32);
metric reduction and row gathering.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import tiny_actor

from hybridrl import algorithms
from hybridrl.models.loading import decoder_layers
from hybridrl.parallel import fsdp, process_group, sharding
from hybridrl.parallel.process_group import DistributedSetup
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.hf import HFBackend
from hybridrl.training.batch import decode_responses
from hybridrl.training.logprobs import response_logprobs
from hybridrl.training.optim import LeanAdamW
from hybridrl.training.update import mini_batches

PROMPTS = [[10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20, 21]]
GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
PARAM_ATOL, LOSS_RTOL = 2e-6, 1e-5  # measured: 2.1e-7 (params) after 4 AdamW steps


def make_batch(num: int = 8, prompt_len: int = 6, response_len: int = 5) -> dict[str, torch.Tensor]:
    """A rollout-shaped batch with ragged prompts and responses (so token balancing has work to do)."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 90, (num, prompt_len + response_len), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    for row in range(num):
        attention_mask[row, :row % prompt_len] = 0  # left padding of the prompt
        attention_mask[row, prompt_len + 1 + row % response_len:] = 0  # right padding of the response
    input_ids[attention_mask == 0] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "response_mask": attention_mask[:, prompt_len:].float(),
            "old_logp": -torch.rand(num, response_len, generator=gen) - 4.0,
            "advantages": torch.randn(num, response_len, generator=gen)}


def train(model: torch.nn.Module, batch: dict, setup: DistributedSetup, steps_mini: int = 8,
          micro: int = 2, epochs: int = 4, optimizer_class=torch.optim.AdamW) -> list[float]:
    """`update.run_epochs`'s loop with what data parallelism adds (`shard_micro_batches`, weights gathered once
    per mini-batch, gradients reduce-scattered only in the last of a rank's 2 micro-batches); returns the
    loss of every mini-batch (summed over ranks, so it is the global loss)."""
    optimizer = optimizer_class(model.parameters(), lr=1e-2)
    num_tokens = batch["attention_mask"].sum(1)
    losses = []
    for micros in mini_batches(len(num_tokens), steps_mini, micro, epochs, torch.Generator().manual_seed(0)):
        mini = torch.cat(micros)
        norm = {"num_tokens": batch["response_mask"][mini].sum().item(), "num_sequences": len(mini),
                "max_length": batch["response_mask"].shape[1]}
        total = 0.0
        local = sharding.shard_micro_batches(micros, num_tokens, setup)
        with fsdp.gathered_for_micro_batches(model):
            for index, rows in enumerate(local):
                fsdp.sync_gradients(model, index == len(local) - 1)
                part = {key: value[rows] for key, value in batch.items()}
                logp, _ = response_logprobs(model, part["input_ids"], part["attention_mask"], part["position_ids"],
                                            part["response_mask"].shape[1])
                loss, _ = algorithms.policy_loss(logp, part["old_logp"], part["advantages"], part["response_mask"],
                                                 clip_low=0.2, clip_high=0.2, **norm)
                loss.backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(process_group.reduce_metrics({"loss": total}, setup, sum_keys=["loss"])["loss"])
    return losses


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def rollouts(model, tokenizer, setup: DistributedSetup) -> list[list[list[int]]]:
    results = []
    for backend in (HFBackend(model, tokenizer), BuiltinBackend(model, tokenizer=tokenizer, kv_cache_memory=0.01)):
        with fsdp.gather_for_rollout(model):
            # ranks decode different lengths: forwards inside the block must not need the other rank
            sharding.generate_sharded(backend, PROMPTS[:1], SamplingParams(max_new_tokens=2 + 5 * setup.rank,
                                         temperature=0.0, ignore_eos=True), setup)
            generations = sharding.generate_sharded(backend, PROMPTS, GREEDY, setup,
                                                       decode=lambda share: decode_responses(tokenizer, share))
        backend.release_memory()
        # Each rank decoded only its share; the gathered texts must still be every response's own.
        assert [g.text for g in generations] == decode_responses(tokenizer, generations)
        results.append([[g.prompt_index, *g.token_ids, g.text] for g in generations])
    return results


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    setup = process_group.init_from_env("cpu", timeout_s=60, hang_timeout_s=60)
    model, tokenizer = tiny_actor()
    fsdp.parallelize(model, setup)
    generated = rollouts(model, tokenizer, setup)
    sharded_after = all(type(p).__name__ == "DTensor" for p in model.parameters())
    losses = train(model, make_batch(), setup)
    rows = sharding.shard_rows(torch.arange(8), make_batch()["attention_mask"].sum(1), setup)
    gathered = sharding.gather_rows(rows.float()[:, None] * 10, rows, 8, setup)
    metrics = process_group.reduce_metrics({"a": float(rank), "b": 1.0}, setup, sum_keys=["b"])
    micros = sharding.match_micro_batch_count([torch.arange(4)] if rank == 0 else [torch.arange(2), torch.arange(2, 4)], setup)
    state = fsdp.full_state_dict(model, setup)
    torch.save({"generated": generated, "sharded_after": sharded_after, "losses": losses,
                "params": full_parameters(model), "rows": rows, "gathered": gathered, "metrics": metrics,
                "micro_sizes": [len(m) for m in micros], "state": state},
               os.path.join(out_dir, f"rank{rank}.pt"))
    process_group.shutdown(setup)


def _rank_main_replicated(rank: int, port: int, out_dir: str) -> None:
    """fsdp_shard_size=1: a 2-D (replicate x shard) mesh with shards of one rank, i.e. every rank keeps
    the whole model and gradients are all-reduced."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    setup = process_group.init_from_env("cpu", timeout_s=60, hang_timeout_s=None, shard_size=1)
    model, _ = tiny_actor()
    fsdp.parallelize(model, setup)
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    losses = train(model, make_batch(), setup)
    bf16, _ = tiny_actor()  # bf16 with LeanAdamW's stochastic rounding: the replicas must round alike
    fsdp.parallelize(bf16.to(torch.bfloat16), setup)
    torch.manual_seed(rank)  # ranks' global RNGs differ in real runs; the rounding must not depend on them
    train(bf16, make_batch(), setup, optimizer_class=LeanAdamW)
    torch.save({"losses": losses, "params": full_parameters(model), "local_numel": local_numel,
                "mesh": tuple(setup.mesh.shape), "bf16": {n: p.to_local() for n, p in bf16.named_parameters()}},
               os.path.join(out_dir, f"replicated{rank}.pt"))
    process_group.shutdown(setup)


def test_replicated_two_ranks_match_one_process(tmp_path):
    model, _ = tiny_actor()
    expected_losses = train(model, make_batch(), DistributedSetup())
    expected_params = full_parameters(model)
    mp.start_processes(_rank_main_replicated, args=(free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    results = [torch.load(tmp_path / f"replicated{rank}.pt") for rank in range(2)]
    for name, value in results[0]["bf16"].items():
        assert torch.equal(value, results[1]["bf16"][name]), f"replicas drifted apart: {name}"
    for result in results:
        assert result["mesh"] == (2, 1)
        assert result["local_numel"] == sum(p.numel() for p in model.parameters())  # a whole copy per rank
        assert result["losses"] == pytest.approx(expected_losses, rel=LOSS_RTOL)
        for name, value in expected_params.items():
            torch.testing.assert_close(result["params"][name], value, atol=PARAM_ATOL, rtol=0, msg=name)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_fsdp_two_ranks_match_one_process(tmp_path):
    single = DistributedSetup()
    model, tokenizer = tiny_actor()
    expected_generated = rollouts(model, tokenizer, single)
    expected_losses = train(model, make_batch(), single)
    expected_params = full_parameters(model)

    # fork, not spawn: the children inherit the imported modules (a cold transformers import is ~12 s);
    # they use one thread each, so no OpenMP pool crosses the fork.
    mp.start_processes(_rank_main, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    for result in ranks:
        assert result["generated"] == expected_generated  # HF and built-in engine, greedy, all 4 prompts
        assert result["sharded_after"], "weights must be resharded after the rollout"
        assert result["losses"] == pytest.approx(expected_losses, rel=LOSS_RTOL)
        for name, value in expected_params.items():
            torch.testing.assert_close(result["params"][name], value, atol=PARAM_ATOL, rtol=0, msg=name)
        assert result["metrics"] == {"a": 0.5, "b": 2.0}
        assert torch.equal(result["gathered"], torch.arange(8).float()[:, None] * 10)
        assert result["micro_sizes"] == [2, 2]
    torch.testing.assert_close(ranks[0]["state"]["model.embed_tokens.weight"],
                               expected_params["model.embed_tokens.weight"], atol=PARAM_ATOL, rtol=0)
    assert ranks[1]["state"] is None
    assert sorted(torch.cat([r["rows"] for r in ranks]).tolist()) == list(range(8))
    changed = max((expected_params[n] - v).abs().max().item() for n, v in full_parameters(tiny_actor().model).items())
    assert changed > 1e-3, "the updates must move the parameters, or the comparison says nothing"


def lora_actor():
    """The tiny actor with rank-4 LoRA on every linear layer and non-zero B, so the adapter changes outputs."""
    from hybridrl.models.lora import apply_lora

    model, tokenizer = tiny_actor()
    torch.manual_seed(0)  # lora_A's init draws from the global RNG, which a forked rank inherits mid-stream
    model = apply_lora(model, rank=4, alpha=8.0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model, tokenizer


def lora_reference_logprobs(model) -> torch.Tensor:
    from hybridrl.models.lora import AdapterDisabled

    batch = make_batch()
    with torch.no_grad():
        return response_logprobs(AdapterDisabled(model), batch["input_ids"], batch["attention_mask"],
                                 batch["position_ids"], batch["response_mask"].shape[1])[0]


def _rank_main_lora(rank: int, port: int, out_dir: str) -> None:
    from hybridrl.models.lora import AdapterDisabled

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    setup = process_group.init_from_env("cpu", timeout_s=60, hang_timeout_s=None)
    model, tokenizer = lora_actor()
    fsdp.parallelize(model, setup)
    generated = rollouts(model, tokenizer, setup)
    # As the trainer does it: AdapterDisabled holds no FSDP module, so nothing is gathered for the block and
    # each forward gathers its layers. (Inside a gathered block of the peft model, peft's requires_grad
    # toggling would land on the unsharded parameters and leave the sharded adapters frozen.)
    with fsdp.gathered_for_micro_batches(AdapterDisabled(model)):
        reference = lora_reference_logprobs(model)
    losses = train(model, make_batch(), setup)
    torch.save({"generated": generated, "reference": reference, "losses": losses, "params": full_parameters(model)},
               os.path.join(out_dir, f"lora{rank}.pt"))
    process_group.shutdown(setup)


def test_lora_fsdp_two_ranks_match_one_process(tmp_path):
    """LoRA under FSDP2: the PeftModel's generate() and forward() skip its own forward, so the wrapped
    *ForCausalLM must be the FSDP root (a PeftModel root failed with "FSDP requires running forward
    through the root module first"). Rollouts (HF and built-in), the adapter-disabled reference and
    LoRA-only updates equal one process."""
    single = DistributedSetup()
    model, tokenizer = lora_actor()
    expected_generated = rollouts(model, tokenizer, single)
    expected_reference = lora_reference_logprobs(model)
    expected_losses = train(model, make_batch(), single)
    expected_params = full_parameters(model)
    mp.start_processes(_rank_main_lora, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    for rank in range(2):
        result = torch.load(tmp_path / f"lora{rank}.pt")
        assert result["generated"] == expected_generated
        torch.testing.assert_close(result["reference"], expected_reference, atol=1e-5, rtol=0)
        assert result["losses"] == pytest.approx(expected_losses, rel=LOSS_RTOL)
        for name, value in expected_params.items():
            torch.testing.assert_close(result["params"][name], value, atol=PARAM_ATOL, rtol=0, msg=name)


# ----------------------------------------------------------------------------------------------
# One process: every helper is the identity


def test_world_size_one_is_the_identity():
    setup = process_group.init_from_env("cpu")
    assert not setup.is_distributed and setup.is_main
    model = tiny_actor().model
    assert fsdp.parallelize(model, setup) is model
    rows = torch.tensor([3, 1, 2, 0])
    assert sharding.shard_rows(rows, torch.ones(4), setup) is rows
    micros = [rows[:2], rows[2:]]
    assert sharding.shard_micro_batches(micros, torch.ones(4), setup) is micros
    assert sharding.match_micro_batch_count(micros, setup) is micros
    values = torch.randn(4, 2)
    assert sharding.gather_rows(values, rows, 4, setup) is values
    metrics = {"actor/loss": 1.5}
    assert process_group.reduce_metrics(metrics, setup) is metrics
    assert process_group.broadcast_object("x", setup) == "x"
    with fsdp.gather_for_rollout(model) as sync:
        assert sync.seconds == 0.0
    process_group.shutdown(setup)


def test_balanced_partition_equal_counts_and_balanced_tokens():
    costs = [100, 1, 1, 1, 90, 5, 5, 2]
    parts = sharding.balanced_partition(costs, 2)
    assert [len(p) for p in parts] == [4, 4]
    assert sorted(parts[0] + parts[1]) == list(range(8))
    sums = [sum(costs[i] for i in p) for p in parts]
    assert abs(sums[0] - sums[1]) <= 10, sums  # 100 and 90 land on different ranks
    assert [len(p) for p in sharding.balanced_partition(list(range(7)), 3)] == [3, 2, 2]


def test_uneven_split_is_refused_with_the_fix():
    setup = DistributedSetup(rank=0, world_size=2)
    with pytest.raises(ValueError, match="multiples of trainer.num_gpus"):
        sharding.shard_rows(torch.arange(5), torch.ones(5), setup)


def test_decoder_layers_found_for_causal_lm_and_critic():
    from hybridrl.models.loading import ValueModel

    model = tiny_actor().model
    assert len(decoder_layers(model)) == 2
    assert len(decoder_layers(ValueModel(model))) == 2
    for layer in decoder_layers(model):  # what fully_shard does: a subclass named FSDP<Name>
        layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    assert len(decoder_layers(model)) == 2  # found again after sharding (model.compile needs this)


# ----------------------------------------------------------------------------------------------
# The whole trainer: `hybridrl train ... trainer.num_gpus=2` on the CPU


REWARD_FILE = '''
def contains_seven(prompts, completions, **columns):
    return [float("7" in c) for c in completions]
'''


def test_cli_trains_with_two_processes(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import toy_prompts

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in toy_prompts()))
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    out = tmp_path / "run"
    overrides = [f"data.train_path={tmp_path / 'prompts.jsonl'}", "data.max_prompt_length=16",
                 f"reward.functions=[{{fn: '{tmp_path / 'rewards.py'}:contains_seven'}}]", "model.path=tiny:llama",
                 "rollout.max_new_tokens=4", "rollout.num_samples_per_prompt=4", "trainer.prompts_per_step=8",
                 "actor.micro_batch_size=8", "actor.lr=1e-3", "trainer.total_steps=2", "trainer.device=cpu",
                 "trainer.num_gpus=2", f"trainer.output_dir={out}", "logging.sinks=[jsonl]", "trainer.save_every=0"]
    config = tmp_path / "config.yaml"
    config.write_text("{}\n")
    result = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(config), *overrides],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]  # rank 0 alone writes metrics
    assert all(row["actor/grad_norm"] > 0 and "perf/weight_sync_s" in row for row in rows)
    assert (out / "model" / "model.safetensors").is_file()


def test_shared_prompts_on_two_processes_match_separate_rows(tmp_path):
    """`actor.share_prompt_tokens` with 2 processes (each prompt's rows on one rank, in the update and in the
    old-policy and reference passes): the losses and gradient norms of the same run without sharing (float32)."""
    import json

    metrics = []
    for share in ("false", "true"):
        out = tmp_path / f"share_{share}"
        _train(tmp_path, [*_cli_overrides(tmp_path, out, steps=2, num_gpus=2), "model.dtype=float32",
                          "trainer.save_every=0", f"actor.share_prompt_tokens={share}", "algorithm.kl_coef=0.05",
                          "actor.reuse_logprobs_on_policy=false", "actor.max_tokens_per_micro_batch=64"])
        metrics.append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert any(row["actor/grad_norm"] > 0 for row in metrics[0])
    for separate, shared in zip(*metrics):
        for key in ("actor/policy_loss", "actor/grad_norm", "actor/kl"):
            assert shared[key] == pytest.approx(separate[key], rel=1e-4, abs=1e-7), key


def _cli_overrides(tmp_path, out, steps: int, num_gpus: int) -> list[str]:
    import json

    from conftest import toy_prompts

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in toy_prompts()))
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    return [f"data.train_path={tmp_path / 'prompts.jsonl'}", "data.max_prompt_length=16",
            f"reward.functions=[{{fn: '{tmp_path / 'rewards.py'}:contains_seven'}}]", "model.path=tiny:llama",
            "rollout.max_new_tokens=4", "rollout.num_samples_per_prompt=4", "trainer.prompts_per_step=8",
            "actor.micro_batch_size=8", "actor.lr=1e-3", f"trainer.total_steps={steps}", "trainer.device=cpu",
            f"trainer.num_gpus={num_gpus}", f"trainer.output_dir={out}", "logging.sinks=[jsonl]",
            "trainer.save_every=1", "trainer.save_model=false", "model.dtype=bfloat16"]


def _train(tmp_path, overrides: list[str]) -> None:
    import subprocess
    import sys

    config = tmp_path / "config.yaml"
    config.write_text("{}\n")
    result = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(config), *overrides],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("offload", [False, True, 0.5], ids=["moments-sharded", "moments-offloaded", "half-offloaded"])
def test_two_process_checkpoint_resumes_exactly_and_on_one_process(tmp_path, offload):
    """bf16 parameters, so LeanAdamW with DTensor moments, as on GPUs. Saved by 2 ranks (rank 0 gathers the
    FSDP shards), resumed by 2 ranks: the same step-3 and step-4 metrics as a run that never stopped (step 4
    on weights updated with the restored moments); resumed by 1
    process: it loads and trains on (the checkpoint is unsharded). With `actor.optimizer_offload` the moments
    are per-rank CPU shards, gathered and cut back by `hybridrl/checkpoint/sharded_offload.py`; with a fraction, some
    moments are CPU shards and the others DTensors."""
    import json
    import shutil

    from safetensors import safe_open

    from hybridrl.checkpoint.store import check_checkpoint

    def overrides(out, steps, processes):
        fraction = [f"actor.optimizer_offload_fraction={offload}"] if not isinstance(offload, bool) else []
        return _cli_overrides(tmp_path, out, steps, processes) + [f"actor.optimizer_offload={str(bool(offload)).lower()}"] \
            + fraction

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    _train(tmp_path, overrides(straight, 4, 2))
    _train(tmp_path, overrides(stopped, 2, 2))
    step2 = stopped / "checkpoints" / "step_000002"
    assert check_checkpoint(step2) is None
    assert (step2 / "rng.safetensors").is_file() and (step2 / "rng_rank1.safetensors").is_file()
    with safe_open(str(next((step2 / "state").glob("*.safetensors"))), "pt") as saved:  # full, not one rank's shard
        weight = [key for key in saved.keys() if key.startswith("actor.") and key.endswith("embed_tokens.weight")][0]
        moment = saved.get_slice(f"actor_optim.{weight[len('actor.'):]}.exp_avg").get_shape()
        assert moment == saved.get_slice(weight).get_shape()
    shutil.copytree(stopped, tmp_path / "one")  # the same checkpoint, to resume on one process below
    _train(tmp_path, overrides(stopped, 4, 2))

    def rows(out):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    resumed, reference = rows(stopped), rows(straight)
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]
    for key in ("actor/policy_loss", "actor/grad_norm", "actor/entropy", "reward/mean"):
        # Step 4 runs on the weights that step 3's optimizer step made from the restored moments.
        assert [row[key] for row in resumed[2:]] == [row[key] for row in reference[2:]], key
    _train(tmp_path, overrides(tmp_path / "one", 3, 1))
    assert [row["step"] for row in rows(tmp_path / "one")] == [1, 2, 3]


def _length_reward(prompts, completions, **columns):
    """Records what this process scored; fails on the completion 'bad'."""
    if "bad" in completions:
        raise ValueError("cannot score 'bad'")
    _length_reward.seen.extend(completions)
    return [float(len(c)) for c in completions]


def _rank_main_scoring(rank: int, port: int, out_dir: str) -> None:
    from hybridrl.rewards import RewardComposer, RewardError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    setup = process_group.init_from_env("cpu", timeout_s=60, hang_timeout_s=None)
    rewards = RewardComposer([("length", _length_reward, 2.0)])
    completions = ["a" * (i + 1) for i in range(12)]  # 3 prompts x 4 samples
    prompts, columns = [f"p{i // 4}" for i in range(12)], {"answer": [str(i) for i in range(12)]}
    _length_reward.seen = []
    total, per_function = sharding.score_sharded(rewards.score, prompts, completions, columns, 4, setup)
    seen = list(_length_reward.seen)
    try:
        sharding.score_sharded(rewards.score, prompts, completions[:9] + ["bad"] + completions[10:], columns, 4,
                                  setup)
        error = None
    except RewardError as raised:
        error = str(raised)
    torch.save({"total": total, "per_function": per_function, "seen": seen, "error": error},
               os.path.join(out_dir, f"scoring{rank}.pt"))
    process_group.shutdown(setup)


def test_rewards_are_scored_in_shares_of_whole_groups_and_gathered(tmp_path):
    """Two processes: each scores whole prompt groups of its share (3 groups of 4: 4 and 8 samples), both
    return the whole batch's scores in order; a reward error in rank 1's share is raised on both ranks,
    naming the sample by its place in the whole batch."""
    mp.start_processes(_rank_main_scoring, args=(free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    results = [torch.load(tmp_path / f"scoring{rank}.pt") for rank in range(2)]
    lengths = [float(i + 1) for i in range(12)]
    assert results[0]["seen"] == ["a" * (i + 1) for i in range(4)]
    assert results[1]["seen"] == ["a" * (i + 1) for i in range(4, 12)]
    for result in results:
        assert result["total"].tolist() == [2 * n for n in lengths]
        assert result["per_function"] == {"length": lengths}
        assert "on sample 9 (the first failing one" in result["error"]


def test_sigterm_to_the_launcher_stops_every_rank_cleanly_with_a_checkpoint(tmp_path):
    """What a scheduler does: SIGTERM to `hybridrl train` of a 2-process run. Each rank gets one SIGTERM,
    finishes its step and saves; the launcher exits 143 and no process of the run is left."""
    import json
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from conftest import toy_prompts

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in toy_prompts()))
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    out = tmp_path / "run"
    overrides = [f"data.train_path={tmp_path / 'prompts.jsonl'}", "data.max_prompt_length=16",
                 f"reward.functions=[{{fn: '{tmp_path / 'rewards.py'}:contains_seven'}}]", "model.path=tiny:llama",
                 "rollout.max_new_tokens=4", "rollout.num_samples_per_prompt=4", "trainer.prompts_per_step=8",
                 "actor.micro_batch_size=8", "trainer.total_steps=100000", "trainer.device=cpu",
                 "trainer.num_gpus=2", f"trainer.output_dir={out}", "logging.sinks=[jsonl]", "trainer.save_every=0"]
    config = tmp_path / "config.yaml"
    config.write_text("{}\n")
    launcher = subprocess.Popen([sys.executable, "-m", "hybridrl.cli", "train", str(config), *overrides],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.5)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=90)
    finally:
        launcher.kill()
    assert launcher.returncode == 143, stderr[-3000:]
    assert "SIGTERM passed to 2 rank(s)" in stderr and "stopped by SIGTERM" in stderr
    assert list((out / "checkpoints").glob("step_*")), "the ranks saved no checkpoint"
    time.sleep(1)
    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if str(out).encode() in _read(p)]
    assert not left, f"processes of the run still alive: {[p.parent.name for p in left]}"


def _read(path):
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _rank_main_stop_agreement(rank: int, port: int, out_dir: str) -> None:
    from types import SimpleNamespace

    from hybridrl.training.trainer import RLTrainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    setup = process_group.init_from_env("cpu", timeout_s=60, hang_timeout_s=None)
    trainer = SimpleNamespace(parts=SimpleNamespace(setup=setup), device=torch.device("cpu"))
    # Rank 1 alone got the signal in this step; then nobody; then both.
    answers = [RLTrainer.any_rank_stopping(trainer, asked) for asked in (rank == 1, False, True)]
    torch.save(answers, os.path.join(out_dir, f"stop{rank}.pt"))
    process_group.shutdown(setup)


def test_a_stop_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """The launcher signals each rank on its own, so they may see SIGTERM in different steps: the trainer's
    after-step check is agreed (any rank asked -> all stop and save that step together)."""
    mp.start_processes(_rank_main_stop_agreement, args=(free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    assert [torch.load(tmp_path / f"stop{rank}.pt") for rank in range(2)] == [[True, False, True]] * 2
