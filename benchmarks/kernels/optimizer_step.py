"""LeanAdamW's step on a real parameter layout: seconds per step with the moments resident, half offloaded and
all offloaded, against the floor (the offloaded moments over PCIe, each direction at the pinned-copy bandwidth
measured in the same run, the two directions overlapping; the update's HBM traffic at `--bandwidth`).

`--baseline FILE` times another version of `hybridrl/training/optim.py` (for example the previous commit's, saved with
`git show HEAD~1:hybridrl/training/optim.py > /tmp/old_optim.py`) side by side, on the same parameters and gradients.

    python -m benchmarks.kernels.optimizer_step                      # one GPU: the grpo-0.5b shape (Qwen2-0.5B)
    python -m benchmarks.kernels.optimizer_step --shape 1.5b --baseline /tmp/old_optim.py
    python -m benchmarks.kernels.optimizer_step --offloads 0 --compiled-baseline   # Triton kernel vs torch.compile
    python -m benchmarks.kernels.optimizer_step --quick              # CPU, the tiny shape: that it runs
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import torch

from benchmarks.grpo_step import BANDWIDTH, SHAPES


def parameters(shape: str, device: str) -> list[torch.nn.Parameter]:
    """The shape's parameters in bf16 (random init, in the model's order) with random bf16 gradients."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape])).to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator(device).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, device=device, dtype=torch.bfloat16)
    return params


def pinned_bandwidth(device: str, megabytes: int = 512) -> dict:
    """GB/s of pinned host-to-device and device-to-host copies, each alone and both at once."""
    host = torch.empty(megabytes << 20, dtype=torch.uint8, pin_memory=True)
    back = torch.empty_like(host, pin_memory=True)
    gpu, gpu2 = torch.empty(host.shape, dtype=torch.uint8, device=device), torch.empty(host.shape, dtype=torch.uint8, device=device)
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 5

    def both():
        with torch.cuda.stream(streams[0]):
            gpu.copy_(host, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            back.copy_(gpu2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(streams[0])
        torch.cuda.current_stream().wait_stream(streams[1])

    size = host.numel() / 1e9
    return dict(h2d=size / timed(lambda: gpu.copy_(host, non_blocking=True)),
                d2h=size / timed(lambda: back.copy_(gpu2, non_blocking=True)),
                both=size / timed(both))  # GB each way per second with the two overlapping


def time_steps(optimizer_class, params, offload: float, steps: int, device: str) -> tuple[float, dict]:
    """Seconds per step, and the GPU memory the steps allocated and reserved beyond the parameters and
    gradients (GiB; a pipeline that queues every copy at once shows here), with the first step's seconds (it
    allocates the moments and, the first time in a process, builds the update kernel)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    optimizer = optimizer_class(params, lr=1e-5, weight_decay=0.01, offload=offload, seed=1)
    first = time.perf_counter()
    optimizer.step()  # the first step allocates the moments (and builds the update kernel)
    if device == "cuda":
        torch.cuda.synchronize()
    memory = {"first_step_s": time.perf_counter() - first}
    optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    if device == "cuda":
        memory |= {"extra_allocated_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
                  "extra_reserved_gib": (torch.cuda.max_memory_reserved() - base) / 2**30}
    del optimizer
    return seconds, memory


def load_optim(path: str):
    spec = importlib.util.spec_from_file_location("baseline_optim", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LeanAdamW


def compiled_update_optimizer():
    """LeanAdamW with its CUDA update as `torch.compile(adamw_chunk, dynamic=True)` instead of the Triton kernel
    (`training/adamw_kernel.py`): the same arithmetic through inductor, for `--compiled-baseline`."""
    from hybridrl.training import optim

    compiled = torch.compile(optim.adamw_chunk, dynamic=True)

    class CompiledUpdate(optim.LeanAdamW):
        def step(self, closure=None, apply=None):
            plain = optim.chunk_update_function
            optim.chunk_update_function = lambda device: compiled if device.type == "cuda" else plain(device)
            try:
                return super().step(closure, apply)
            finally:
                optim.chunk_update_function = plain

    return CompiledUpdate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    parser.add_argument("--offloads", default="1.0,0.5,0.0", help="shares of the moments in CPU memory")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--baseline", help="another optim.py whose LeanAdamW is timed beside this one")
    parser.add_argument("--compiled-baseline", action="store_true",
                        help="also time the update through torch.compile(adamw_chunk) instead of the Triton kernel")
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shape")
    args = parser.parse_args()
    device = "cpu" if args.quick else "cuda"
    shape = "tiny" if args.quick else args.shape
    from hybridrl.training.optim import LeanAdamW

    versions = {"this": LeanAdamW} | ({"baseline": load_optim(args.baseline)} if args.baseline else {}) | (
        {"compiled": compiled_update_optimizer()} if args.compiled_baseline else {})
    params = parameters(shape, device)
    elements = sum(p.numel() for p in params)
    bandwidth = pinned_bandwidth(device) if device == "cuda" else None
    if bandwidth:
        print("pinned copies, GB/s: host->device {h2d:.1f}, device->host {d2h:.1f}, both at once {both:.1f} each way"
              .format(**bandwidth))
    rows = []
    print(f"\n{shape}: {len(params)} parameters, {elements / 1e6:.0f}M elements")
    print(f"{'offloaded':>9} {'version':>9} {'ms/step':>8} {'floor ms':>9} {'+alloc GiB':>10} {'+reserved':>9} "
          f"{'first s':>8}")
    for offload in (float(x) for x in args.offloads.split(",")):
        moved = 8 * elements * offload  # float32 m and v, each way
        hbm = elements * (2 + 2 + 2 + (0 if offload else 16)) / BANDWIDTH  # weights in/out, grads; resident moments
        floor = max(moved / (bandwidth["both"] * 1e9) if bandwidth else 0.0, hbm)
        for name, optimizer_class in versions.items():
            seconds, memory = time_steps(optimizer_class, params, offload, args.steps, device)
            rows.append(dict(shape=shape, offload=offload, version=name, step_s=seconds, floor_s=floor, **memory))
            print(f"{offload:>9.2f} {name:>9} {1e3 * seconds:>8.1f} {1e3 * floor:>9.1f} "
                  f"{memory.get('extra_allocated_gib', float('nan')):>10.2f} {memory.get('extra_reserved_gib', float('nan')):>9.2f} "
                  f"{memory['first_step_s']:>8.3f}",
                  flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "optimizer_step.json"), "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
