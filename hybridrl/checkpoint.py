"""Step checkpoints that resume exactly: weights, optimizer, schedulers, RNG, data position, metrics.

Layout of `output_dir/checkpoints/`:

    step_000010/
        state/            actor, critic and optimizer tensors, written by torch.distributed.checkpoint
                          through its safetensors (Hugging Face) storage writer
        rng.safetensors   RNG states of python, numpy, torch CPU and every CUDA device
        trainer.json      step, sampler position, scheduler states, optimizer hyper-parameters, metrics
        hf/               model config, generation config, tokenizer (what `hybridrl export` needs)
        COMPLETE          written last: every file's size and sha256
    latest                name of the newest complete checkpoint

Choices:
- Atomic: a checkpoint is written to `.tmp-step_*` and renamed into place only after its `COMPLETE`
  marker is written, so an existing checkpoint is never overwritten by a half-written one.
  A directory whose marker is missing or whose files do not match it is skipped, with a message,
  for the previous good one.
- Nothing is unpickled: tensors are read with safetensors, everything else is JSON. RNG states and
  optimizer states are stored as tensors plus plain numbers.
- DCP (`torch.distributed.checkpoint`) writes and reads the model and optimizer tensors, so the
  same code path serves sharded (DTensor/FSDP) state; with one process it runs without a process
  group. Multi-rank saving (rank-0 metadata, barriers, `save_distributed`) is left to the
  multi-GPU work; everything here is written by the single process.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STEP_PREFIX = "step_"
MARKER = "COMPLETE"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked (missing, damaged, or from another setup)."""


# ----------------------------------------------------------------------------------------------
# Flat tensor state of models and optimizers (what DCP reads and writes)


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without the second name of tied tensors (safetensors refuses aliases)."""
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            state[name] = tensor
    return state


def tensor_state(parts: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(flat tensors for DCP, plain optimizer hyper-parameters) of actor, critic and their optimizers.

    The tensors are the live ones (or, for a fresh optimizer, its just-initialised state), so
    `dcp.load` into them restores in place.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tensors, plain = {}, {}
    for role, model, optimizer in (("actor", parts.actor, parts.actor_optimizer),
                                   ("critic", parts.critic, parts.critic_optimizer)):
        if model is None:
            continue
        _, optim_state = get_state_dict(model, optimizer)
        tensors.update({f"{role}.{name}": tensor for name, tensor in model_state(model).items()})
        for name, slots in optim_state["state"].items():
            tensors.update({f"{role}_optim.{name}.{slot}": value for slot, value in slots.items()})
        plain[role] = optim_state["param_groups"]
    return tensors, plain


def load_tensor_state(parts: Any, tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for role, model, optimizer in (("actor", parts.actor, parts.actor_optimizer),
                                   ("critic", parts.critic, parts.critic_optimizer)):
        if model is None:
            continue
        model_full, optim_state = get_state_dict(model, optimizer)
        for name, slots in optim_state["state"].items():
            for slot in slots:
                slots[slot] = tensors[f"{role}_optim.{name}.{slot}"]
        groups = [{**group, **({"betas": tuple(group["betas"])} if "betas" in group else {})} for group in plain[role]]
        optim_state["param_groups"] = groups
        set_state_dict(model, optimizer, model_state_dict=model_full, optim_state_dict=optim_state)


def dcp_save(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(str(directory)),
                 no_dist=not (dist.is_available() and dist.is_initialized()))


def dcp_load(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Fill `tensors` in place from `directory` (keys absent from `tensors` are not read)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(directory)),
                 no_dist=not (dist.is_available() and dist.is_initialized()))


# ----------------------------------------------------------------------------------------------
# RNG states as tensors + plain numbers


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    version, python_state, gauss = random.getstate()
    kind, numpy_keys, numpy_pos, has_gauss, cached = np.random.get_state()
    tensors = {"python": torch.tensor(python_state, dtype=torch.int64),
               "numpy": torch.from_numpy(numpy_keys.astype(np.int64)), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    plain = {"python_version": version, "python_gauss": gauss, "numpy_kind": kind, "numpy_pos": int(numpy_pos),
             "numpy_has_gauss": int(has_gauss), "numpy_cached_gaussian": float(cached)}
    return tensors, plain


def set_rng_state(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    random.setstate((plain["python_version"], tuple(tensors["python"].tolist()), plain["python_gauss"]))
    np.random.set_state((plain["numpy_kind"], tensors["numpy"].numpy().astype(np.uint32), plain["numpy_pos"],
                         plain["numpy_has_gauss"], plain["numpy_cached_gaussian"]))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available() and len(tensors["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(list(tensors["cuda"]))


# ----------------------------------------------------------------------------------------------
# Saving


def save_checkpoint(trainer: Any, root: str | Path, keep_last_n: int = 0) -> Path:
    """Write the trainer's complete state for its current step under `root`; returns the checkpoint dir."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"{STEP_PREFIX}{trainer.step_count:06d}"
    temporary = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    parts = trainer.parts
    tensors, optimizer_groups = tensor_state(parts)
    dcp_save(tensors, temporary / "state")
    rng_tensors, rng_plain = rng_state()
    save_file({k: v.contiguous() for k, v in rng_tensors.items()}, temporary / "rng.safetensors")
    actor = parts.actor
    state = {
        "format_version": FORMAT_VERSION, "step": trainer.step_count, "sampler": trainer.sampler.state_dict(),
        "schedulers": {role: s.state_dict() for role, s in (("actor", parts.actor_scheduler),
                                                             ("critic", parts.critic_scheduler)) if s is not None},
        "optimizer_groups": optimizer_groups, "rng": rng_plain, "history": trainer.logger.history,
        "actor_dtype": str(next(actor.parameters()).dtype).removeprefix("torch."),
        "peft": peft_info(actor), "config": trainer.config.to_dict(),
    }
    (temporary / "trainer.json").write_text(json.dumps(state, indent=1))
    save_hf_metadata(actor, parts.tokenizer, temporary / "hf")
    write_marker(temporary, trainer.step_count)
    final = root / name
    if final.exists():  # re-saving a step after resuming from an earlier one: replace only now
        trash = root / f".old-{name}-{os.getpid()}"
        os.rename(final, trash)
        os.rename(temporary, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(temporary, final)
    fsync_directory(root)
    write_latest(root, name)
    prune(root, keep_last_n)
    return final


def peft_info(model: torch.nn.Module) -> dict[str, Any] | None:
    """The LoRA adapter config of a peft model (to rebuild it on export), else None."""
    config = getattr(model, "peft_config", None)
    if not config:
        return None
    adapter = config.get("default") or next(iter(config.values()))
    return json.loads(json.dumps(adapter.to_dict(), default=lambda value: sorted(value)
                                 if isinstance(value, set) else str(value)))


def save_hf_metadata(model: torch.nn.Module, tokenizer: Any, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def write_marker(directory: Path, step: int) -> None:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
        files[str(path.relative_to(directory))] = {"size": path.stat().st_size, "sha256": sha256(path)}
    marker = directory / MARKER
    marker.write_text(json.dumps({"step": step, "files": files}, indent=1))
    with marker.open("rb") as handle:
        os.fsync(handle.fileno())
    fsync_directory(directory)


def write_latest(root: Path, name: str) -> None:
    temporary = root / ".latest.tmp"
    temporary.write_text(name + "\n")
    os.replace(temporary, root / "latest")


def prune(root: Path, keep_last_n: int) -> None:
    if keep_last_n <= 0:
        return
    for old in step_directories(root)[keep_last_n:]:
        shutil.rmtree(old, ignore_errors=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_directory(path: Path) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some filesystems cannot fsync a directory
    finally:
        os.close(descriptor)


# ----------------------------------------------------------------------------------------------
# Finding and validating


def step_directories(root: Path) -> list[Path]:
    """`step_*` directories under root, newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)
             and p.name[len(STEP_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]), reverse=True)


def check_checkpoint(directory: Path) -> str | None:
    """None if the checkpoint is complete and intact, else why not."""
    marker = directory / MARKER
    if not marker.is_file():
        return f"it has no {MARKER} marker (its write was cut short)"
    try:
        listed = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError):
        return f"its {MARKER} marker is unreadable"
    for relative, expected in listed.items():
        path = directory / relative
        if not path.is_file():
            return f"{relative} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{relative} has {path.stat().st_size} bytes, expected {expected['size']}"
        if sha256(path) != expected["sha256"]:
            return f"{relative} does not match its checksum"
    return None


def find_checkpoint(root: str | Path, log: Any = print) -> Path | None:
    """The newest intact checkpoint under `root`; damaged ones are reported through `log` and skipped."""
    for directory in step_directories(Path(root)):
        problem = check_checkpoint(directory)
        if problem is None:
            return directory
        log(f"checkpoint {directory} is damaged and is skipped: {problem}")
    return None


def resolve_resume(setting: str, root: Path, log: Any = print, key: str = "trainer.resume") -> Path | None:
    """`off` -> None; `auto` -> newest intact checkpoint under root, if any; a path -> that checkpoint
    (a directory of checkpoints means its newest intact one)."""
    if setting == "off":
        return None
    if setting == "auto":
        return find_checkpoint(root, log)
    path = Path(setting)
    if (path / MARKER).exists() or path.name.startswith(STEP_PREFIX):
        problem = check_checkpoint(path) if path.is_dir() else "it does not exist"
        if problem is not None:
            raise CheckpointError(f"{key}={setting!r} cannot be used: {problem}. "
                                  "Point it at another checkpoint or use trainer.resume=auto.")
        return path
    for candidate in (path, path / "checkpoints"):
        if step_directories(candidate):
            found = find_checkpoint(candidate, log)
            if found is None:
                raise CheckpointError(f"{key}={setting!r}: no intact checkpoint under {candidate}.")
            return found
    raise CheckpointError(f"{key}={setting!r} is not a checkpoint (no {MARKER} marker) nor a directory "
                          "of checkpoints; give a step_* directory, a run's output_dir, auto or off.")


# ----------------------------------------------------------------------------------------------
# Loading


def read_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "trainer.json").read_text())


def load_checkpoint(trainer: Any, directory: str | Path) -> float:
    """Restore the trainer to the checkpoint in `directory`; returns the seconds it took."""
    start = time.perf_counter()
    directory = Path(directory)
    state = read_trainer_state(directory)
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {directory} has format {state.get('format_version')}, "
                              f"this hybridrl reads format {FORMAT_VERSION}.")
    parts = trainer.parts
    for role, present in (("critic", parts.critic is not None),):
        if present != (role in state["optimizer_groups"]):
            raise CheckpointError(f"checkpoint {directory} was saved {'with' if not present else 'without'} a "
                                  f"{role} but this run has {'one' if present else 'none'}; resume with the same "
                                  "algorithm.name.")
    tensors, _ = tensor_state(parts)
    dcp_load(tensors, directory / "state")
    load_tensor_state(parts, tensors, state["optimizer_groups"])
    for role, scheduler in (("actor", parts.actor_scheduler), ("critic", parts.critic_scheduler)):
        if scheduler is not None and role in state["schedulers"]:
            scheduler.load_state_dict(state["schedulers"][role])
    trainer.sampler.load_state_dict(state["sampler"])
    trainer.step_count = state["step"]
    trainer.logger.rewind(state["step"], state["history"])
    set_rng_state(load_file(directory / "rng.safetensors"), state["rng"])
    return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------
# Stopping cleanly on SIGINT/SIGTERM


class StopRequest:
    """Set by SIGINT/SIGTERM; the trainer finishes its step, saves, and returns."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def __bool__(self) -> bool:
        return self.signal_name is not None


@contextmanager
def stop_on_signals(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[StopRequest]:
    """Within the block, the first SIGINT/SIGTERM only sets the flag; a second one acts as usual
    (KeyboardInterrupt / termination), so an impatient user can still stop at once."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request  # signal handlers can only be installed from the main thread
        return
    previous = {number: signal.getsignal(number) for number in signals}

    def handler(number: int, frame: Any) -> None:
        request.signal_name = signal.Signals(number).name
        print(f"received {request.signal_name}: finishing this step, then saving a checkpoint "
              "(send it again to stop at once)", flush=True)
        for other, action in previous.items():
            signal.signal(other, action)

    for number in signals:
        signal.signal(number, handler)
    try:
        yield request
    finally:
        for number, action in previous.items():
            signal.signal(number, action)


def resume_from_config(trainer: Any) -> Path | None:
    """Apply `trainer.resume` (auto|off|PATH): restore the newest usable checkpoint, report the time."""
    setting = trainer.config.trainer.resume
    root = Path(trainer.config.trainer.output_dir) / "checkpoints"
    directory = resolve_resume(setting, root)
    if directory is None:
        if trainer.step_count == 0:
            trainer.logger.rewind(0, [])  # a fresh run: metrics files describe this run only
        return None
    seconds = load_checkpoint(trainer, directory)
    print(f"resumed from {directory} at step {trainer.step_count} in {seconds:.2f} s", flush=True)
    trainer.logger.add_once({"perf/resume_s": seconds})
    return directory
