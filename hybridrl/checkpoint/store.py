"""Step checkpoints that resume exactly: weights, optimizer, schedulers, RNG, data position, metrics.

What is saved is what the trainer says its state is (`state_dict()`, restored by `load_state_dict()`, the
`Checkpointable` protocol): live models with their optimizers, whose tensors this module gathers and fills
back in place, and plain JSON (step, data position, schedulers, metric history, config). RNG states are
per process and are saved here.

Layout of `output_dir/checkpoints/`:

    step_000010/
        state/            actor, critic and optimizer tensors: plain safetensors files of <= 2 GiB
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
- Tensors are full (unsharded) and written with safetensors directly; the state dicts come from
  `torch.distributed.checkpoint.state_dict` (`get_state_dict`/`set_state_dict`), which also
  handles FSDP2. DCP's own Hugging Face storage writer is not used: files it wrote from GPUs did not
  read back, and plain safetensors files are readable by any safetensors reader (`export.py`).
- QLoRA (`model.load_in_4bit`): only the trainable tensors (the adapter) and their optimizer state are
  saved; the frozen 4-bit base is rebuilt from `model.path` on resume and on export.
- Several processes (FSDP2): the shards are gathered into full tensors on rank 0's CPU
  (`StateDictOptions(full_state_dict=True, cpu_offload=True)`), rank 0 writes them as one process
  would, and on resume every rank reads them and `set_state_dict` keeps its own shard. So a
  checkpoint does not depend on the number of processes (saved on 2 GPUs, resumed on 1 or 4). Each
  rank writes its own RNG state (`rng_rank<r>.safetensors`). The cost: rank 0's CPU must hold the
  whole model and optimizer state while saving (about 16 bytes per parameter with AdamW). Offloaded
  optimizer moments (per-rank CPU shards) are gathered and cut back by `sharded_offload.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from hybridrl.checkpoint.sharded_offload import gather_optimizer_state, offloaded_shards, scatter_optimizer_state
from hybridrl.models.loading import write_failure
from hybridrl.models.qlora import holds_4bit_weights
from hybridrl.parallel import process_group
from hybridrl.parallel.process_group import DistributedSetup

STEP_PREFIX = "step_"
MARKER = "COMPLETE"
FORMAT_VERSION = 1

Models = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
"""Role ("actor", "critic") -> (model, its optimizer): the live objects whose tensors a checkpoint holds."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked (missing, damaged, or from another setup)."""


class Checkpointable(Protocol):
    """What a checkpoint saves and restores (the trainer).

    `state_dict()` returns `{"step": int, "models": Models, ...}`: the rest of its entries are plain JSON and
    are written as they are. `load_state_dict(saved)` gets those JSON entries back (with "step"), after the
    tensors of its `models` have been filled in place."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ----------------------------------------------------------------------------------------------
# Flat tensor state of models and optimizers (what the state/ files hold)


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without the second name of tied tensors (safetensors refuses aliases)."""
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            state[name] = tensor
    return state


def trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of `state` that train (a QLoRA adapter): a 4-bit base never changes and is rebuilt from
    `model.path`, so its packed weights and quantization state are not saved (about 4 GiB for a 7B model)."""
    names = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    return {name: tensor for name, tensor in state.items() if name in names}


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{second name: first name} of parameters registered twice (tied embeddings)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases


def _state_options(setup: DistributedSetup):
    """Full tensors on rank 0's CPU when the models are sharded over processes, else the live tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if setup.is_distributed:
        return StateDictOptions(full_state_dict=True, cpu_offload=True)
    return None


def tensor_state(models: Models, setup: DistributedSetup) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(flat tensors for the state/ files, plain optimizer hyper-parameters) of the models and their optimizers.

    With one process the tensors are the live ones (or, for a fresh optimizer, its just-initialised
    state), so `load_tensors_into` restores them in place. With several, every rank must call this (the
    shards are gathered); rank 0 gets full CPU copies and the other ranks get nothing.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    tensors, plain = {}, {}
    for role, (model, optimizer) in models.items():
        options = _state_options(setup)
        if offloaded_shards(optimizer, setup.is_distributed):  # moments are plain per-rank shards
            model_sd = get_model_state_dict(model, options=options)
            optim_state = gather_optimizer_state(model, optimizer, setup.is_main)
        else:
            model_sd, optim_state = get_state_dict(model, optimizer, options=options)
        if options is None:
            model_sd = model_state(model)
        if holds_4bit_weights(model):
            model_sd = trainable_state(model, model_sd)
        aliases = tied_aliases(model)
        tensors.update({f"{role}.{name}": tensor for name, tensor in model_sd.items() if name not in aliases})
        for name, slots in optim_state.get("state", {}).items():
            tensors.update({f"{role}_optim.{name}.{slot}": value for slot, value in slots.items()})
        plain[role] = optim_state.get("param_groups", [])
    return tensors, plain


def load_tensor_state(models: Models, tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    """One process: `tensors` are the live ones, filled by `load_tensors_into`; put the optimizer slots back."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for role, (model, optimizer) in models.items():
        model_full, optim_state = get_state_dict(model, optimizer)
        if holds_4bit_weights(model):  # the adapter is already filled in place; nothing of the 4-bit base loads
            model_full = {}
        for name, slots in optim_state["state"].items():
            for slot in slots:
                slots[slot] = tensors[f"{role}_optim.{name}.{slot}"]
        optim_state["param_groups"] = _param_groups(plain[role])
        set_state_dict(model, optimizer, model_state_dict=model_full, optim_state_dict=optim_state)


def load_full_state(models: Models, directory: Path, plain: dict[str, Any]) -> None:
    """Several processes: every rank reads the full tensors from the files and keeps its own shard.

    Every rank holds the same full dicts, so the collectives inside `set_state_dict` match on every
    rank (with rank 0 reading and broadcasting while the other ranks pass empty dicts, they can hang)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    full = read_tensors(directory)
    for role, (model, optimizer) in models.items():
        aliases = tied_aliases(model)
        model_sd = {name: full[f"{role}.{aliases.get(name, name)}"] for name in model.state_dict()}
        slots: dict[str, dict[str, torch.Tensor]] = {}
        for name, _ in model.named_parameters():
            prefix = f"{role}_optim.{name}."
            found = {key[len(prefix):]: value for key, value in full.items()
                     if key.startswith(prefix) and "." not in key[len(prefix):]}
            if found:
                slots[name] = found
        if offloaded_shards(optimizer, True):  # moments are plain per-rank shards: cut them out here
            set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True))
            scatter_optimizer_state(model, optimizer, slots, _param_groups(plain[role]))
            continue
        optim_sd = {"state": slots, "param_groups": _param_groups(plain[role])}
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(full_state_dict=True))


def _param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON turned the betas tuple into a list; the optimizers want it back."""
    return [{**group, **({"betas": tuple(group["betas"])} if "betas" in group else {})} for group in groups]


FILE_BYTES = 2 * 2**30
"""Tensor files are cut at about this size, so saving copies at most one file's worth to the CPU at once."""


def save_tensors(tensors: dict[str, Any], directory: Path) -> None:
    """Write full tensors as plain safetensors files (`part-00001.safetensors`, ...) under `directory`;
    plain numbers among them (LeanAdamW's integer `step`) go to `numbers.json`."""
    directory.mkdir(parents=True, exist_ok=True)
    numbers = {name: value for name, value in tensors.items() if not isinstance(value, torch.Tensor)}
    (directory / "numbers.json").write_text(json.dumps(numbers))
    shard: dict[str, torch.Tensor] = {}
    size = index = 0
    for name, tensor in tensors.items():
        if name in numbers:
            continue
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= FILE_BYTES:
            index += 1
            save_file(shard, directory / f"part-{index:05d}.safetensors")
            shard, size = {}, 0
    if shard or index == 0:
        save_file(shard, directory / f"part-{index + 1:05d}.safetensors")


def read_tensors(directory: Path) -> dict[str, Any]:
    """Every tensor under `directory`, on the CPU, and the plain numbers saved beside them."""
    saved: dict[str, Any] = {}
    for path in sorted(directory.glob("*.safetensors")):
        saved.update(load_file(path))
    if (directory / "numbers.json").is_file():
        saved.update(json.loads((directory / "numbers.json").read_text()))
    return saved


def load_tensors_into(tensors: dict[str, Any], directory: Path) -> None:
    """Copy the saved values into `tensors`: tensors in place, plain numbers by replacing the entry."""
    saved = read_tensors(directory)
    missing = sorted(set(tensors) - set(saved))
    if missing:
        raise CheckpointError(f"checkpoint {directory.parent} lacks {len(missing)} tensor(s) this run has, e.g. "
                              f"{missing[0]!r}; it was saved by a different model or algorithm.")
    with torch.no_grad():
        for name, tensor in tensors.items():
            if isinstance(tensor, torch.Tensor) and isinstance(saved[name], torch.Tensor):
                tensor.copy_(saved[name])
            else:
                tensors[name] = saved[name]


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


def save_checkpoint(trainer: Checkpointable, root: str | Path, setup: DistributedSetup, keep_last_n: int = 0,
                    tokenizer: Any = None) -> Path:
    """Write `trainer.state_dict()` (and this process's RNG state) under `root`; returns the checkpoint dir.
    `tokenizer` is saved beside the model config for export. With several processes every rank must call it:
    rank 0 writes, the others add their RNG state."""
    state = dict(trainer.state_dict())
    models = state.pop("models")
    root = Path(root)
    name = f"{STEP_PREFIX}{state['step']:06d}"
    temporary = root / f".tmp-{name}-{process_group.broadcast_object(os.getpid(), setup)}"
    if setup.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
    tensors, optimizer_groups = tensor_state(models, setup)  # collective when sharded
    process_group.barrier(setup)  # the directory exists for every rank
    rng_tensors, rng_plain = rng_state()
    failure = None
    try:  # a full disk or an I/O error: every rank learns of it, and nothing half-written is published
        save_file({k: v.contiguous() for k, v in rng_tensors.items()}, temporary / rng_file(setup.rank),
                  metadata={"plain": json.dumps(rng_plain)})
        if setup.is_main:
            save_tensors(tensors, temporary / "state")
            actor = models["actor"][0]
            _write_trainer_json(temporary, state, optimizer_groups, rng_plain, actor, setup.world_size)
            save_hf_metadata(actor, tokenizer, temporary / "hf")
    except (OSError, SafetensorError) as error:
        failure = error
    if not _any_rank_failed(failure, setup):  # (a barrier: every rank's RNG file is written before the marker)
        try:
            if setup.is_main:
                write_marker(temporary, state["step"])
                _publish(root, temporary, name, keep_last_n)
        except (OSError, SafetensorError) as error:
            failure = error
    if _any_rank_failed(failure, setup):  # (a barrier: nobody moves on before the checkpoint is in place)
        if setup.is_main:
            shutil.rmtree(temporary, ignore_errors=True)
        needed = sum(t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor))
        what = failure or "another rank could not write its part; its error is above"
        raise CheckpointError(f"{write_failure(root / name, what, needed)} (the checkpoints saved before it are "
                              "intact: trainer.resume=auto continues from the newest).")
    return root / name


def _any_rank_failed(failure: BaseException | None, setup: DistributedSetup) -> bool:
    if not setup.is_distributed:
        return failure is not None
    flag = torch.tensor(float(failure is not None), device=setup.device)
    return bool(process_group.all_reduce(flag, setup, op="max").item())


def rng_file(rank: int) -> str:
    return "rng.safetensors" if rank == 0 else f"rng_rank{rank}.safetensors"


STORE_KEYS = ("format_version", "optimizer_groups", "rng", "actor_dtype", "peft", "world_size")
"""The entries of trainer.json that this module writes (the rest are the trainer's `state_dict()`)."""


def _write_trainer_json(directory: Path, state: dict[str, Any], optimizer_groups: dict[str, Any],
                        rng_plain: dict[str, Any], actor: torch.nn.Module, world_size: int) -> None:
    clash = sorted(set(state) & set(STORE_KEYS))
    assert not clash, f"state_dict() entries {clash} would overwrite the checkpoint's own"
    record = {"format_version": FORMAT_VERSION, **state, "optimizer_groups": optimizer_groups, "rng": rng_plain,
              "actor_dtype": str(next(actor.parameters()).dtype).removeprefix("torch."), "peft": peft_info(actor),
              "world_size": world_size}
    (directory / "trainer.json").write_text(json.dumps(record, indent=1))


def _publish(root: Path, temporary: Path, name: str, keep_last_n: int) -> None:
    """Rename the finished `temporary` into place, point `latest` at it and prune old checkpoints."""
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
        found = find_checkpoint(root, log)
        if found is None and step_directories(root):  # starting over would overwrite the run's metrics
            raise CheckpointError(f"every checkpoint under {root} is damaged (each is named above), so "
                                  f"{key}=auto cannot continue the run; pass {key}=off to start again (its "
                                  f"metrics are then replaced) or {key}=PATH to continue from a checkpoint "
                                  "elsewhere.")
        return found
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


def load_checkpoint(trainer: Checkpointable, directory: str | Path, setup: DistributedSetup) -> float:
    """Restore the trainer to the checkpoint in `directory`: the tensors of its `state_dict()["models"]` in
    place, then `load_state_dict` with the saved JSON entries, then this process's RNG state; returns the
    seconds it took. With several processes every rank must call it."""
    start = time.perf_counter()
    directory = Path(directory)
    state = read_trainer_state(directory)
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {directory} has format {state.get('format_version')}, "
                              f"this hybridrl reads format {FORMAT_VERSION}.")
    models = trainer.state_dict()["models"]
    for role in ("critic",):
        present = role in models
        if present != (role in state["optimizer_groups"]):
            raise CheckpointError(f"checkpoint {directory} was saved {'with' if not present else 'without'} a "
                                  f"{role} but this run has {'one' if present else 'none'}; resume with the same "
                                  "algorithm.name.")
    if setup.is_distributed:
        load_full_state(models, directory / "state", state["optimizer_groups"])
    else:
        tensors, _ = tensor_state(models, setup)
        load_tensors_into(tensors, directory / "state")
        load_tensor_state(models, tensors, state["optimizer_groups"])
    trainer.load_state_dict({key: value for key, value in state.items() if key not in STORE_KEYS})
    rng_path = directory / rng_file(setup.rank)
    if rng_path.is_file():  # a rank the saving run did not have keeps its fresh seed
        with safe_open(rng_path, "pt") as file:
            plain = json.loads((file.metadata() or {}).get("plain", "null")) or state["rng"]
        set_rng_state(load_file(rng_path), plain)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------
# Starting: leftovers, and which checkpoint to resume from


def remove_leftovers(root: Path, log: Any = print) -> None:
    """Remove what writes cut short (a kill, a full disk) left under `root`: `.tmp-step_*` directories, and the
    `.old-step_*` copy of a checkpoint being replaced, which is put back where the replacement never landed.
    Only the run that holds the output directory's lock may call this: it deletes directories in the making."""
    if not root.is_dir():
        return
    removed, freed = 0, 0
    for path in sorted(root.iterdir()):
        if path.name.startswith(f".old-{STEP_PREFIX}") and path.is_dir():
            name = path.name[len(".old-"):].rsplit("-", 1)[0]
            if not (root / name).exists():  # cut between `_publish`'s two renames
                os.rename(path, root / name)
                log(f"put back checkpoint {root / name}, whose replacement was cut short")
                continue
        elif not (path.name.startswith(f".tmp-{STEP_PREFIX}") and path.is_dir()) and path.name != ".latest.tmp":
            continue
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        freed += sum(p.stat().st_size for p in files)
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        removed += 1
    if removed:
        log(f"removed {removed} leftover(s) of cut-short checkpoint writes under {root} ({freed / 2**20:.1f} MiB)")


def resume_directory(setting: str, root: Path, setup: DistributedSetup) -> Path | None:
    """`resolve_resume` decided on rank 0 and sent to every rank, so every rank loads the same checkpoint
    (or fails with the same error). Rank 0 first removes the leftovers of cut-short writes (`remove_leftovers`):
    the trainer holds the output directory's lock here, so no other run is writing them."""
    choice: Any = None
    if setup.is_main:
        remove_leftovers(root)
        try:
            choice = resolve_resume(setting, root)
        except CheckpointError as error:
            choice = error
    choice = process_group.broadcast_object(choice, setup)
    if isinstance(choice, CheckpointError):
        raise choice
    return choice
