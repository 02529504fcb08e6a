"""Two GPUs, rollout on one and training on the other (`trainer.max_staleness` + `trainer.rollout_device`), against
the synchronous loop; and the weight push between the GPUs.

    python -m benchmarks.two_gpu_async                       # nvidia-h200-x2: every run below, table last
    python -m benchmarks.two_gpu_async --runs async-1        # one run (a device call has at most 10 minutes)
    python -m benchmarks.two_gpu_async --runs push           # the weight push only (1.5B and 7B shapes)
    python -m benchmarks.two_gpu_async --runs link           # the rollout process's push: NCCL against gloo
    python -m benchmarks.two_gpu_async --tiny                # CPU: a 2-layer model, rollout_device=cpu; checks the script
    # the synchronous loop colocated on both GPUs (FSDP2, same global batch), through torchrun as `hybridrl`'s
    # launcher starts it; on nvidia-h200-x2 export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    # NVSHMEM_DISABLE_NVLS=1 first:
    torchrun --standalone --nproc-per-node 2 -m benchmarks.two_gpu_async --runs sync

The model is Qwen2.5-1.5B-shaped (`long_tail.QWEN25_15B`), random init, bf16, trained in full (LeanAdamW, float32
state, gradient checkpointing, 16k-token micro-batches, one optimizer step per rollout, no KL). Every step has
`--prompts` x `--n` sequences (the same global batch in every run) whose response lengths are drawn as in
`benchmarks/long_tail.py` (log-normal, median `--median`, clipped to [`--min-len`, `--cap`]; step i draws with
seed i, so every run generates the same lengths) and forced (`ignore_eos` + `generate(response_lengths=)`), on the
built-in engine with the paged KV cache.

Runs (`--runs`):
- `async-1`, `async-2`: `trainer.max_staleness` 1 and 2, the thread worker's copy of the actor on `cuda:0`
  (`trainer.rollout_device`), the trainer on `cuda:1`; truncated importance sampling (cap 2.0).
- `sync`: the synchronous loop (`max_staleness=0`), rollout and training colocated. In one process it runs on
  `cuda:0` (one GPU); under torchrun with two processes (the command above) on both GPUs, FSDP2, each rank
  generating its share of the same global batch with its share of the same drawn lengths.
- `push`: the weight push GPU 1 -> GPU 0 for the 1.5B and 7B shapes: `WeightMailbox.publish` (the copy across
  devices that `perf/weight_push_s` times in a run) and the worker's load of it into its own tensors (on GPU 0).
- `link`: the rollout process's push (`trainer.rollout_worker=process`), between two processes over a
  `weight_push` link, from a model on GPU 0 into one on GPU 1, for the 1.5B and 7B shapes: over NCCL (what the
  trainer picks for two GPUs) and over gloo, each bucket staged through the CPU (what it picks on one GPU); the
  receiver's time from its call to its last byte (`perf/weight_push_s` of the worker), after one warm-up push.

Step time is the mean of `timing/step_s` over the steps after the first (compilation, warm-up); tokens/s per GPU are
the generated tokens per step over the step time and the GPUs the run uses; each GPU's busy share is
`torch.cuda.utilization` (NVML: the share of time a kernel ran) sampled every 100 ms over those steps (n/a on CPU or
without NVML); staleness is the mean of `rollout/staleness_mean`.

Prints a table last; writes JSON to $OUT/two_gpu_async.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from benchmarks.grpo_step import build_tokenizer, even_fraction
from benchmarks.long_tail import QWEN25_15B, add_batch_arguments, apply_tiny_defaults, response_lengths
from benchmarks.rollout import TINY
from hybridrl.parallel.weight_push import connect, push_weights
from hybridrl.training.async_pipeline import RolloutWorker, WeightMailbox

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
"""Qwen2.5-7B's shape (untied embeddings)."""
RUNS = {"async-1": 1, "async-2": 2, "sync": 0}
"""Run -> trainer.max_staleness."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.two_gpu_async", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="async-1,async-2,sync,push,link",
                        help="comma-separated: async-1,async-2,sync,push,link")
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is left out of the means")
    add_batch_arguments(parser)
    parser.add_argument("--kv-cache-memory", type=float, default=0.3, help="rollout.kv_cache_memory")
    parser.add_argument("--max-tokens", type=int, default=16384, help="actor.max_tokens_per_micro_batch")
    parser.add_argument("--push-repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="CPU: a 2-layer model, 4 prompts x 2, short lengths")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tiny:
        apply_tiny_defaults(parser, args, dict(steps=3, prompts=4, n=2, prompt_len=8, median=4, min_len=2, cap=8,
                                               max_tokens=256, push_repeats=1))
    return args


def world() -> tuple[int, int]:
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def step_lengths(step: int, args) -> list[int]:
    """The forced response lengths of `step`'s whole batch (prompt-major), the same in every run."""
    return response_lengths(args.prompts * args.n, args.median, args.sigma, args.min_len, args.cap, seed=step)


def force_lengths(backend, args):
    """`backend`, each `generate` call (one per step, in step order) forced to that step's drawn lengths; under
    torchrun a rank generates a contiguous share of the prompts (`sharding.generate_sharded`) and gets their share."""
    generate, calls = backend.generate, [0]
    size, rank = world()

    def generate_forced(prompts, params, **kwargs):
        calls[0] += 1
        start = args.prompts * rank // size  # the share generate_sharded gave this rank
        lengths = step_lengths(calls[0], args)[start * params.n:(start + len(prompts)) * params.n]
        return generate(prompts, params, response_lengths=lengths, **kwargs)

    backend.generate = generate_forced
    return backend


def worker_forcing(args):
    """The thread worker, its backend forced to the drawn lengths."""
    class ForcedLengthWorker(RolloutWorker):
        def __init__(self, *positional, **named):
            super().__init__(*positional, **named)
            force_lengths(self.backend, args)

    return ForcedLengthWorker


class Busy:
    """`torch.cuda.utilization` of each device, sampled on a thread while the block runs."""

    def __init__(self, devices: list[int], period_s: float = 0.1) -> None:
        self.devices, self.period_s, self.samples = devices, period_s, {d: [] for d in devices}
        self.stop = threading.Event()

    def _run(self) -> None:
        while not self.stop.is_set():
            for device in self.devices:
                self.samples[device].append(torch.cuda.utilization(device))
            time.sleep(self.period_s)

    def __enter__(self):
        try:
            for device in self.devices:
                torch.cuda.utilization(device)
        except Exception as error:  # noqa: BLE001 - the figure is optional; say why it is missing
            print(f"GPU busy share unavailable: {error}", flush=True)
            self.devices = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def shares(self) -> dict[str, float]:
        return {f"cuda:{d}": statistics.mean(s) for d, s in self.samples.items() if s}


def build_trainer(args, staleness: int, device: str, rollout_device: str):
    from hybridrl import PromptDataset
    from hybridrl.models.loading import HFModel
    from hybridrl.training.trainer import RLTrainer

    shape = TINY if args.tiny else QWEN25_15B
    config = Qwen2Config(**shape, max_position_embeddings=args.prompt_len + args.cap + 8, eos_token_id=0,
                         pad_token_id=1, bos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if args.tiny else torch.bfloat16)
    tokenizer = build_tokenizer(shape["vocab_size"])
    rng = random.Random(0)
    records = [{"prompt": " ".join(f"t{rng.randrange(100, shape['vocab_size'])}" for _ in range(args.prompt_len))}
               for _ in range(args.prompts * args.steps)]
    dataset = PromptDataset(records, tokenizer, max_length=args.prompt_len, use_chat_template=False)
    size, _ = world()
    settings = dict(
        model__gradient_checkpointing=True, rollout__backend="builtin", rollout__max_new_tokens=args.cap,
        rollout__num_samples_per_prompt=args.n, rollout__temperature=1.0, rollout__ignore_eos=True,
        rollout__kv_cache_memory=args.kv_cache_memory, rollout__engine__kv_cache="paged",
        trainer__prompts_per_step=args.prompts, trainer__total_steps=args.steps, trainer__device=device,
        trainer__num_gpus=size, trainer__max_staleness=staleness, trainer__rollout_device=rollout_device,
        trainer__save_model=False, trainer__resume="off", trainer__output_dir=tempfile.mkdtemp(),
        logging__sinks=["jsonl"], actor__lr=1e-6, actor__micro_batch_size=min(32, args.prompts * args.n),
        actor__max_tokens_per_micro_batch=args.max_tokens, algorithm__name="grpo", algorithm__kl_coef=0.0,
        algorithm__rollout_correction_cap=2.0 if staleness else None)
    trainer = RLTrainer(actor=HFModel(model, tokenizer), reward_fn=even_fraction, dataset=dataset, **settings)
    if trainer.pipeline is not None:
        trainer.pipeline.worker_class = worker_forcing(args)
    else:
        force_lengths(trainer.parts.rollout, args)
    return trainer


def run_training(name: str, args) -> dict:
    """One of `async-1`, `async-2`, `sync`: its steps, timed, with each GPU's busy share after the first step."""
    staleness, (size, rank) = RUNS[name], world()
    cuda = not args.tiny
    if size > 1 and cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = "cpu" if not cuda else "cuda" if size > 1 else "cuda:1" if staleness else "cuda:0"
    rollout_device = ("cpu" if not cuda else "cuda:0") if staleness else ""
    devices = [] if not cuda else [0, 1] if staleness or size > 1 else [0]
    if cuda and size == 1:  # the trainer's thread works on its own GPU (the worker's thread sets cuda:0 for itself)
        torch.cuda.set_device(torch.device(device))
    trainer = build_trainer(args, staleness, device, rollout_device)
    rows, busy = [], Busy(devices)
    for index in range(args.steps):
        if index == 1:
            busy.__enter__()
        rows.append(trainer.step())
        if rank == 0:
            print(name, "step", index + 1, json.dumps({k: round(float(v), 3) for k, v in rows[-1].items()
                                                       if k.startswith(("timing/step", "perf/weight", "rollout/stale"))}),
                  flush=True)
    busy.__exit__()
    for step, row in enumerate(rows, start=1):  # the run generated what was drawn, or its figures mean nothing
        drawn = step_lengths(step, args)
        assert abs(row["rollout/response_length_mean"] - sum(drawn) / len(drawn)) < 1e-3, f"{name} step {step}"
    steady = rows[1:] or rows
    step_s = statistics.mean(row["timing/step_s"] for row in steady)
    generated = statistics.mean(sum(step_lengths(step, args)) for step in range(2, args.steps + 1)) if args.steps > 1 \
        else sum(step_lengths(1, args))
    gpus = max(1, len(devices))
    return dict(run=name if size == 1 else f"{name} x{size}", max_staleness=staleness, device=device,
                rollout_device=rollout_device or device, gpus=gpus, step_s=step_s,
                tokens_per_s_per_gpu=generated / step_s / gpus, generated_per_step=generated,
                staleness_mean=statistics.mean(row.get("rollout/staleness_mean", 0.0) for row in steady),
                weight_push_s=statistics.mean(row.get("perf/weight_push_s", 0.0) for row in steady),
                busy=busy.shares())


def time_push(shape_name: str, shape: dict, source: str, target: str, repeats: int) -> dict:
    """`WeightMailbox.publish` from `source` to `target` (the trainer's side of a push) and the worker's load of it
    into a model of its own on `target`; the best of `repeats`."""
    config = Qwen2Config(**{"tie_word_embeddings": True, **shape})
    models = {}
    for device in (source, target):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        models[device] = model.to_empty(device=device)
    mailbox, publish, load = WeightMailbox(), [], []
    for version in range(1, repeats + 1):
        start = time.perf_counter()
        mailbox.publish(version, models[source].state_dict(), torch.device(target))
        publish.append(time.perf_counter() - start)
        start = time.perf_counter()
        models[target].load_state_dict(mailbox.take(version))
        if target.startswith("cuda"):
            torch.cuda.synchronize(target)
        load.append(time.perf_counter() - start)
    size = sum(t.numel() * t.element_size() for t in models[source].state_dict().values())
    del models
    return dict(shape=shape_name, source=source, target=target, gib=size / 2**30, publish_s=min(publish),
                load_s=min(load), gb_per_s=size / 1e9 / min(publish))


def run_pushes(args) -> list[dict]:
    source, target = ("cpu", "cpu") if args.tiny else ("cuda:1", "cuda:0")
    shapes = {"tiny": TINY} if args.tiny else {"1.5b": QWEN25_15B, "7b": QWEN25_7B}
    return [time_push(name, shape, source, target, args.push_repeats) for name, shape in shapes.items()]


def time_link(rank: int, port: int, backend: str, devices: list[str], shape: dict, repeats: int, out: str) -> None:
    """One side of pushes over a link of `backend` between two processes: rank 0 sends from a model on
    `devices[0]`, rank 1 receives into one of its own on `devices[1]` and writes its best time to `out`."""
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    link = connect(port, rank, 600.0, {"weights": backend}, device)["weights"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**{"tie_word_embeddings": True, **shape}),
                                                 dtype=torch.bfloat16)
    model = model.to_empty(device=device)
    pushed = [push_weights(model, 0, group=link) for _ in range(repeats + 1)][1:]  # the first warms the link up
    if rank == 1:
        with open(out, "w") as handle:
            json.dump(dict(push_s=min(row["perf/weight_push_s"] for row in pushed),
                           gib=pushed[0]["perf/weight_push_gib"]), handle)
    link.close()


def run_links(args) -> list[dict]:
    """`link`: NCCL and gloo between GPUs 0 and 1 for each shape (gloo on the CPU with --tiny)."""
    import torch.multiprocessing as mp

    from hybridrl.training.rollout_process import free_port

    devices = ["cpu", "cpu"] if args.tiny else ["cuda:0", "cuda:1"]
    shapes = {"tiny": TINY} if args.tiny else {"1.5b": QWEN25_15B, "7b": QWEN25_7B}
    rows = []
    for name, shape in shapes.items():
        for backend in ("gloo",) if args.tiny else ("nccl", "gloo"):
            out = os.path.join(tempfile.mkdtemp(), "link.json")
            mp.start_processes(time_link, args=(free_port(), backend, devices, shape, args.push_repeats, out),
                               nprocs=2, join=True, start_method="spawn")
            with open(out) as handle:
                timed = json.load(handle)
            rows.append(dict(shape=name, backend=backend, source=devices[0], target=devices[1], **timed,
                             gb_per_s=timed["gib"] * 2**30 / 1e9 / timed["push_s"]))
    return rows


def print_table(result: dict) -> None:
    args = result["args"]
    print(f"\ntwo_gpu_async on {result['device']}: {args['prompts']} prompts x {args['n']}, prompt "
          f"{args['prompt_len']}, long-tail responses (median {args['median']}, cap {args['cap']})")
    runs = result["runs"]
    if runs:
        print("| run | max_staleness | rollout / train device | s/step | generated tok/s per GPU | GPU busy % | "
              "staleness | weight push s |\n| --- | ---: | --- | ---: | ---: | --- | ---: | ---: |")
        for r in runs:
            busy = " ".join(f"{d} {share:.0f}" for d, share in r["busy"].items()) or "n/a"
            print(f"| {r['run']} | {r['max_staleness']} | {r['rollout_device']} / {r['device']} | {r['step_s']:.2f} | "
                  f"{r['tokens_per_s_per_gpu']:,.0f} | {busy} | {r['staleness_mean']:.2f} | {r['weight_push_s']:.3f} |")
        sync = [r for r in runs if r["max_staleness"] == 0]
        for r in runs:
            if r["max_staleness"] and sync:
                print(f"{r['run']} / {sync[0]['run']}: {sync[0]['step_s'] / r['step_s']:.2f}x step time")
    if result["pushes"]:
        print("| push | shape | GiB | publish s | worker load s | GB/s |\n| --- | --- | ---: | ---: | ---: | ---: |")
        for p in result["pushes"]:
            print(f"| {p['source']} -> {p['target']} | {p['shape']} | {p['gib']:.2f} | {p['publish_s']:.3f} | "
                  f"{p['load_s']:.3f} | {p['gb_per_s']:.1f} |")
    if result.get("links"):
        print("| link | process -> process | shape | GiB | push s | GB/s |\n| --- | --- | --- | ---: | ---: | ---: |")
        for link in result["links"]:
            print(f"| {link['backend']} | {link['source']} -> {link['target']} | {link['shape']} | {link['gib']:.2f} | "
                  f"{link['push_s']:.3f} | {link['gb_per_s']:.1f} |")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    names = [name for name in args.runs.split(",") if name]
    unknown = sorted(set(names) - {*RUNS, "push", "link"})
    if unknown:
        raise SystemExit(f"--runs has unknown run {unknown[0]!r}; choose from {', '.join([*RUNS, 'push', 'link'])}.")
    size, rank = world()
    if size > 1 and names != ["sync"]:
        raise SystemExit("under torchrun only --runs sync runs (the synchronous loop colocated on the GPUs).")
    if not args.tiny and torch.cuda.device_count() < 2 and size == 1 and names != ["sync"]:
        raise SystemExit(f"{torch.cuda.device_count()} CUDA device(s) visible; the async runs and the push need two "
                         "(nvidia-h200-x2), or use --tiny on the CPU.")
    runs = [run_training(name, args) for name in names if name in RUNS]
    pushes = run_pushes(args) if "push" in names and rank == 0 else []
    links = run_links(args) if "link" in names and rank == 0 else []
    result = dict(device="cpu" if args.tiny else torch.cuda.get_device_name(), args=vars(args), runs=runs,
                  pushes=pushes, links=links)
    if rank == 0:
        print_table(result)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "two_gpu_async.json"), "w") as handle:
                json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
