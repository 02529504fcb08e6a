"""Why the time-to-accuracy run's first hybridrl step costs what it does, and why it differs between runs: the TTA's
first step (`short_steps.py --evaluate-first`) in several fresh processes, one after another, each loading the same
saved model and starting from its own copy of the same Triton and Inductor caches, which hold the optimizer's
kernel (as the TTA's runs do: its SFT built it).

    python -m benchmarks.profiling.first_step                      # one GPU: 4 processes, ~100 s
    python -m benchmarks.profiling.first_step --tiny               # CPU, a tiny model: checks the script

Each process is a variant: `plain`, `cprofile` (step 1 under cProfile: where its seconds go), `no-cuda-cache`
(`CUDA_CACHE_DISABLE=1`: the driver's on-disk cache of kernels compiled from PTX not used), `fresh-jit` (that cache
in an empty folder of the process's own: as on a new machine), `fresh-pyc` (`PYTHONPYCACHEPREFIX` an empty folder:
every module compiled to bytecode again) and `cudnn` (`trainer.cudnn_attention=true`: SDPA may use cuDNN's kernels,
as before `training/attention_choice.py`), or several joined by `+`. The TTA's first hybridrl run paid
~1.4 s more in its first step than the runs after it, each with the same copied kernel caches: if the first process
here is slower than the second, something outside those caches persists between processes; the last two variants
say whether it is the driver's cache or Python's bytecode. Between processes: the size of the driver's cache
(`~/.nv/ComputeCache`) and the number of `.pyc` files in the checkout and in torch, triton and transformers (a
first process compiles the bytecode of every module that has none yet), and which large libraries (cuDNN, cuBLAS,
...) the process read into the page cache (`fincore`): a first process reads them from disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from benchmarks import time_to_accuracy as tta

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {
    "plain": ([], {}),
    "cprofile": (["--cprofile-step1", "40"], {}),
    "no-cuda-cache": ([], {"CUDA_CACHE_DISABLE": "1"}),
    "fresh-jit": ([], {"CUDA_CACHE_PATH": "{scratch}/nv"}),
    "fresh-pyc": ([], {"PYTHONPYCACHEPREFIX": "{scratch}/pycache"}),
    "cudnn": (["trainer.cudnn_attention=true"], {}),
}
"""variant -> (short_steps.py arguments, environment variables; `{scratch}` a new empty folder per process). A
process's variant may combine several with `+` (e.g. `fresh-jit+cudnn`)."""


def variant_settings(variant: str) -> tuple[list[str], dict[str, str]]:
    """The arguments and environment of `variant`'s parts together."""
    arguments, environment = [], {}
    for part in variant.split("+"):
        arguments += VARIANTS[part][0]
        environment.update(VARIANTS[part][1])
    return arguments, environment


def disk_state() -> str:
    """The driver's PTX cache size and the count of bytecode files in the checkout: what a process leaves behind."""
    compute_cache = Path.home() / ".nv" / "ComputeCache"
    size = sum(f.stat().st_size for f in compute_cache.rglob("*") if f.is_file()) if compute_cache.is_dir() else 0
    folders = {"checkout": [ROOT / "hybridrl", ROOT / "benchmarks"],
               "torch, triton, transformers": [Path(sysconfig.get_paths()["purelib"]) / name
                                               for name in ("torch", "triton", "transformers")]}
    pyc = {name: sum(1 for folder in paths if folder.is_dir() for _ in folder.rglob("*.pyc"))
           for name, paths in folders.items()}
    return f"~/.nv/ComputeCache {size / 2**20:.1f} MiB; .pyc files: " + ", ".join(f"{n} {c}" for n, c in pyc.items())


def large_libraries() -> list[Path]:
    """The shared libraries over 20 MB of torch and the NVIDIA wheels (cuDNN, cuBLAS, NVRTC ...): a process's first
    use of one reads it from disk unless an earlier process left it in the page cache."""
    site = Path(sysconfig.get_paths()["purelib"])
    files = [f for folder in (site / "nvidia", site / "torch" / "lib", site / "triton") if folder.is_dir()
             for f in folder.rglob("*.so*") if f.is_file()]
    return [f for f in files if f.stat().st_size > 20 * 2**20]


def resident_bytes(files: list[Path]) -> dict[str, int]:
    """Bytes of each file in the page cache (`fincore`; empty where the tool is missing)."""
    if not files or shutil.which("fincore") is None:
        return {}
    done = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES,FILE", *map(str, files)],
                          capture_output=True, text=True)
    rows = (line.split(None, 1) for line in done.stdout.splitlines() if line.strip())
    return {Path(name).name: int(size) for size, name in rows}


def page_cache_change(before: dict[str, int], after: dict[str, int]) -> str:
    grown = {name: after[name] - before.get(name, 0) for name in after if after[name] - before.get(name, 0) > 2**20}
    if not after:
        return "page cache: not measured (no fincore)"
    return (f"page cache: large libraries {sum(after.values()) / 2**20:.0f} MiB resident; read in by this process: "
            + (", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in sorted(grown.items(), key=lambda x: -x[1]))
               or "none"))


def child(variant: str, index: int, args: argparse.Namespace, model_dir: Path, start_caches: Path,
          out: Path) -> float:
    """One fresh process of `variant`; returns its wall seconds."""
    extra, environment = variant_settings(variant)
    scratch = Path(tempfile.mkdtemp(prefix=f"first_step_{index}_"))
    caches = scratch / "caches"
    shutil.copytree(start_caches, caches)
    env = {**os.environ, **tta.use_caches(caches), **{k: v.format(scratch=scratch) for k, v in environment.items()}}
    env["OUT"] = str(out / f"{index}_{variant}")
    command = [sys.executable, "-m", "benchmarks.profiling.short_steps", "--steps", str(args.steps), "--profile",
               "none", "--evaluate-first", "--warm-cache", "--model-dir", str(model_dir), "--out-dir",
               str(scratch / "run"), *(["--tiny"] if args.tiny else []),
               *[a for a in extra if "=" not in a], *[a for a in extra if "=" in a]]  # overrides last
    print(f"\n==== process {index}: {variant} ({' '.join(f'{k}={v}' for k, v in environment.items()) or 'as is'})",
          flush=True)
    libraries = large_libraries()
    resident = resident_bytes(libraries)
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, timeout=args.timeout)
    took = time.perf_counter() - started
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"==== process {index} took {took:.1f} s; after it: {disk_state()}; "
          f"{page_cache_change(resident, resident_bytes(libraries))}", flush=True)
    return took


def build_optimizer_kernel() -> None:
    """One LeanAdamW step of a bf16 tensor here, so the start caches hold its Triton kernel as the TTA's do (its
    SFT, in the parent process, builds it)."""
    import torch

    from hybridrl.training.optim import build_optimizer

    weight = torch.nn.Parameter(torch.zeros(4096, device="cuda", dtype=torch.bfloat16))
    optimizer = build_optimizer([weight], lr=1e-6)
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="fresh-jit+cudnn,fresh-jit,fresh-jit+cprofile,plain",
                        help=f"comma-separated, run in this order; from {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=45.0, help="seconds per process")
    parser.add_argument("--out-dir", default="runs/first_step")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the script")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [part for v in variants for part in v.split("+") if part not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}.")
    settings = tta.parse_args(["--tiny"] if args.tiny else [])
    out = Path(os.environ.get("OUT") or args.out_dir).resolve()
    work = Path(args.out_dir).resolve() / ("tiny" if args.tiny else settings.body)
    start_caches = work / "caches_start"  # what this process builds (nothing, or the model's first kernels)
    shutil.rmtree(start_caches, ignore_errors=True)
    start_caches.mkdir(parents=True)
    os.environ.update(tta.use_caches(start_caches))
    started = time.perf_counter()
    tta.build_model(settings.body, settings.device, work / "init")
    if settings.device == "cuda":
        build_optimizer_kernel()
    print(f"model {settings.body} saved in {time.perf_counter() - started:.1f} s; before the first process: "
          f"{disk_state()}", flush=True)
    took = [child(variant, index, args, work / "init", start_caches, out) for index, variant in enumerate(variants)]
    print("\nprocess seconds: " + ", ".join(f"{i} {v} {t:.1f}" for i, (v, t) in enumerate(zip(variants, took))))


if __name__ == "__main__":
    main()
