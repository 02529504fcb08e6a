"""Optimizer and learning-rate schedule for actor, critic and SFT: AdamW with warm-up then decay.

`LeanAdamW` is AdamW for bf16 training without a float32 master copy: float32 moments (8 bytes per
parameter, optionally in CPU memory), and the update written back to the bf16 weight with stochastic
rounding. Trade-off against float32 master weights (12 bytes more per parameter for bf16+fp32 copies,
4 more than here): rounding is unbiased but adds noise of half a bf16 ulp per step; nearest rounding
without a master copy would instead drop every update below half an ulp (most of them at lr 1e-6).
`master_weights=True` is the conventional mixed precision instead: a float32 copy of each bf16 parameter in
the optimizer state (on the parameter's device, 4 bytes per parameter), updated in float32, and the bf16
weight the model computes with set to it rounded to nearest after each step.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Iterable, NamedTuple

import torch

from hybridrl.config.schema import MissingExtra
from hybridrl.devices import host_to_device
from hybridrl.training.adamw_kernel import available as adamw_kernel_available, triton_adamw_chunk

SCHEDULES = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def build_optimizer(parameters: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), state_dtype: str = "float32",
                    offload: bool | float = False, eight_bit: bool = False, seed: int = 0,
                    master_weights: bool = False) -> torch.optim.Optimizer:
    """AdamW: torch's fused one for float32 parameters; `LeanAdamW` for bf16 parameters (float32 state,
    no float32 weight copy unless `master_weights`) or CPU-offloaded state (`offload`: True, or the share
    offloaded); bitsandbytes' 8-bit AdamW when `eight_bit`."""
    params = [p for p in parameters if p.requires_grad]
    if eight_bit:
        try:
            import bitsandbytes
        except ImportError:
            raise MissingExtra("actor.optimizer_8bit needs bitsandbytes, which is not installed: pip install "
                              "bitsandbytes (CUDA only), or set actor.optimizer_8bit=false.") from None
        return bitsandbytes.optim.AdamW8bit(params, lr=lr, betas=betas, weight_decay=weight_decay)
    low_precision = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    if offload or (low_precision and state_dtype == "float32"):
        return LeanAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, offload=offload, seed=seed,
                         master_weights=master_weights)
    fused = bool(params) and params[0].is_cuda  # one kernel for the whole update on GPU
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    decay = SCHEDULES[schedule]

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return max(0.0, decay(min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _flat(moment: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a moment as one flat view (a DTensor's local shard)."""
    return (moment.to_local() if hasattr(moment, "to_local") else moment).view(-1)


def rounding_noise(shape: torch.Size, generator: torch.Generator | None, device) -> torch.Tensor:
    """Random low 16 bits for `round_with_noise` from a torch generator (`stochastic_round_to_bf16`)."""
    return torch.randint(0, 1 << 16, shape, generator=generator, dtype=torch.int32, device=device)


def round_with_noise(values: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16, rounding up with probability equal to the dropped fraction (unbiased)."""
    bits = values.view(torch.int32)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: low 16 bits are zero


def stochastic_round_to_bf16(values: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 -> bfloat16, rounding up with probability equal to the dropped fraction (unbiased)."""
    return round_with_noise(values, rounding_noise(values.shape, generator, values.device))


_MASK32 = 0xFFFFFFFF


def hash32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer hash (lowbias32) on int64 tensors or Python ints holding values below 2**32;
    every product is masked back to 32 bits, so int64 tensors and Python ints agree."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def counter_noise(base: torch.Tensor, numel: int) -> torch.Tensor:
    """The rounding bits of `numel` consecutive elements whose counter starts at `base` (a one-element
    int64 tensor): the high 16 bits of `hash32(base + i)`. A counter-based draw has no generator state,
    so the CUDA update kernel computes it per element, and the bits of an element do not depend on how the update
    is split into chunks or which moments are offloaded."""
    counters = (base + torch.arange(numel, device=base.device, dtype=torch.int64)) & _MASK32
    return (hash32(counters) >> 16).to(torch.int32)


def adamw_chunk(weights: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                noise_base: torch.Tensor | None, hyper: torch.Tensor) -> torch.Tensor:
    """AdamW on one flat chunk, in float32: updates the moments `m`, `v` in place and returns the new
    weights in the weights' dtype (stochastically rounded with `counter_noise(noise_base)` when given). `hyper` holds
    (lr, beta1, beta2, eps, weight decay, bias correction 1, bias correction 2, apply, gradient scale) as a float32 tensor
    on the weights' device, so that the CUDA kernel (`adamw_kernel.py`, this function's arithmetic in one pass) sees
    the step-dependent values as data, not constants. `apply` 0 leaves weights
    and moments exactly as they were, even with non-finite gradients: the step's skip decided on the device."""
    lr, beta1, beta2, eps, decay, correction1, correction2, apply, scale = hyper.unbind()
    grad = (grad.float() * scale).to(grad.dtype)  # gradient clipping's `grad.mul_(scale)`, rounded as it rounds
    grad = torch.where(apply > 0, grad.float(), 0.0)
    m.lerp_(grad, (1 - beta1) * apply)
    v.mul_(1 - (1 - beta2) * apply).add_((1 - beta2) * apply * grad * grad)
    updated = weights.float() * (1 - lr * decay * apply)
    updated = updated - (lr * apply / correction1) * m / (v.sqrt() / correction2.sqrt() + eps)
    if noise_base is not None:
        return round_with_noise(updated, counter_noise(noise_base, updated.numel()))
    return updated.to(weights.dtype)


def chunk_update_function(device: torch.device):
    """`adamw_chunk` as one Triton kernel on CUDA (`adamw_kernel.py`: Triton compiles it once per machine and keeps
    it on disk, so a new process pays no tracing or code generation); eager elsewhere."""
    return kernel_update if adamw_kernel_available(device) else adamw_chunk


_FALLBACK: list = []  # the update used instead of the kernel after the kernel failed to build on this machine


def kernel_update(*args) -> torch.Tensor:
    """`triton_adamw_chunk`; should the kernel fail to build here (a Triton or driver this code has not met), a
    warning and the same arithmetic through `torch.compile` from then on. A build fails before anything is
    written, so the update it was asked for is still whole."""
    if not _FALLBACK:
        try:
            return triton_adamw_chunk(*args)
        except Exception as error:  # noqa: BLE001 - any build failure; the fallback computes the same update
            warnings.warn(f"LeanAdamW's Triton update kernel failed to build ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); using torch.compile of the same "
                          "update instead (slower to start).", RuntimeWarning, stacklevel=2)
            _FALLBACK.append(fallback_update())
    return _FALLBACK[0](*args)


def fallback_update():
    return torch.compile(adamw_chunk, dynamic=True)


def offloaded_parameters(params: list[torch.Tensor], fraction: float) -> set[int]:
    """The ids of the parameters whose moments live in CPU memory: the last ones in order, covering `fraction`
    of all elements (whole parameters, global sizes, so every rank of a sharded model picks the same ones)."""
    resident_budget, used, resident = (1 - fraction) * sum(p.numel() for p in params), 0, set()
    for param in params:
        if used + param.numel() > resident_budget:
            break
        resident.add(id(param))
        used += param.numel()
    return {id(p) for p in params if id(p) not in resident}


class LeanAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected) with float32 moments for parameters of any dtype.

    Parameters are updated in float32 bucket by bucket (small consecutive parameters concatenated, large
    ones cut into chunks: `_Bucket`), bf16 ones stored back with stochastic rounding (fp16 with nearest
    rounding); float32 parameters match `torch.optim.AdamW`. `offload=True` keeps the moments in pinned
    CPU memory and copies each bucket in and out around its update; a fraction offloads that share of
    the parameter elements (the last parameters in order) and keeps the first ones' moments on the
    device, where they are updated while the first offloaded bucket is in flight. `master_weights=True` keeps a
    float32 copy of each bf16/fp16 parameter (state slot `master`, always on the device): the update reads and
    writes it, and the parameter is then set to it rounded to nearest (no stochastic rounding).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, offload: bool | float = False, chunk_elements: int = 2**24,
                 seed: int = 0, master_weights: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master_weights = master_weights
        fraction = float(offload)
        if not 0 <= fraction <= 1:
            raise ValueError(f"offload must be a bool or a fraction in [0, 1]; got {offload!r}.")
        self.offload, self.chunk_elements, self.seed = fraction > 0, chunk_elements, seed
        self._offloaded_ids = offloaded_parameters([p for g in self.param_groups for p in g["params"]], fraction)
        self._copy_streams = None
        self._fresh_moments: dict[int, dict[str, torch.Tensor]] = {}  # see `_allocate_moments_together`

    def _allocate_moments_together(self) -> None:
        """The moments of the parameters about to get their first step, resident and plain (not DTensors), as views
        into one flat float32 buffer per slot and device, laid out in parameter order: a bucket of consecutive
        parameters then updates its moments in place through one view (`_Bucket.gather_moments`) instead of
        concatenating them and copying them back. Moments replaced later (a checkpoint load) are merely
        concatenated again."""
        new = [p for g in self.param_groups for p in g["params"] if p.grad is not None and not self.state[p]
               and not self.is_offloaded(p) and not hasattr(p.data, "to_local") and p.numel()]
        for device in {p.device for p in new}:
            params = [p for p in new if p.device == device]
            sizes = [p.numel() for p in params]
            for key in ("exp_avg", "exp_avg_sq"):
                flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
                for param, view in zip(params, flat.split(sizes)):
                    self._fresh_moments.setdefault(id(param), {})[key] = view.view(param.shape)

    def is_offloaded(self, param: torch.Tensor) -> bool:
        """Whether `param`'s moments live in CPU memory (this rank's shard, as a plain tensor)."""
        return id(param) in self._offloaded_ids

    def slot_on_host(self, param: torch.Tensor, slot: str) -> bool:
        """Whether state `slot` of `param` lives in CPU memory: offloaded moments do; a master copy never does."""
        return slot != "master" and self.is_offloaded(param)

    def has_master(self, param: torch.Tensor) -> bool:
        return self.master_weights and param.dtype in (torch.bfloat16, torch.float16)

    def _noise_key(self, param: torch.Tensor, step: int) -> int:
        """The 32-bit start of one step's rounding counters, from (seed, step, shard): replicas of a shard
        (several GPUs with fsdp_shard_size < num_gpus) round identically and stay equal, different shards
        get different noise, and a resumed run rounds as the original. Each element adds its offset in
        this rank's parameters laid end to end."""
        shard = 0
        if hasattr(param, "device_mesh"):
            coordinate = param.device_mesh.get_coordinate() or []
            for dim, placement in enumerate(param.placements):
                if placement.is_shard():
                    shard = shard * param.device_mesh.size(dim) + coordinate[dim]
        return _step_noise_key(self.seed, step, shard)

    def _moments(self, param: torch.Tensor, local: torch.Tensor) -> dict:
        """The state of `param`; moments shaped like it. An FSDP2 (DTensor) parameter gets DTensor moments
        sharded the same way, so `get_state_dict` can gather them for a checkpoint; offloaded moments
        are this rank's shard in pinned CPU memory."""
        state = self.state[param]
        if not state:
            state["step"] = 0
            for key in ("exp_avg", "exp_avg_sq"):
                if key in self._fresh_moments.get(id(param), {}):
                    state[key] = self._fresh_moments[id(param)][key]
                elif self.is_offloaded(param):
                    state[key] = torch.zeros(local.shape, dtype=torch.float32, device="cpu", pin_memory=local.is_cuda)
                else:
                    state[key] = torch.zeros_like(param.detach(), dtype=torch.float32)
            if self.has_master(param):  # shaped (and, under FSDP2, sharded) like the parameter
                state["master"] = torch.zeros_like(param.detach(), dtype=torch.float32).copy_(param.detach())
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the moments stay float32 (torch casts floating state to the parameter's dtype,
        which would round them to bf16) and offloaded ones go back to pinned CPU memory."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        moments = {i: {key: value for key, value in state_dict["state"].get(i, {}).items() if key != "step"}
                   for i in saved_ids}
        super().load_state_dict(state_dict)
        for saved_id, param in zip(saved_ids, params):
            for key, value in moments[saved_id].items():
                home = self.state[param][key]
                if self.slot_on_host(param, key):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    self.state[param][key] = local.to("cpu", torch.float32).pin_memory() if param.is_cuda \
                        else local.to("cpu", torch.float32, copy=True)
                else:
                    self.state[param][key] = value.to(device=home.device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure=None, apply: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None):
        """One AdamW step; `apply` (a boolean tensor on the device) 0 makes it a no-op without the host
        waiting to find out, so the caller can queue the step behind the backward pass and check later
        (`uncount_step` then takes back the step count). `grad_scale` (a float32 scalar tensor on the device)
        multiplies every gradient first, as `grad.mul_(grad_scale)` would: gradient clipping's coefficient applied
        inside the update instead of by a pass of its own over the gradients."""
        loss = closure() if closure is not None else None
        self._allocate_moments_together()
        streamed, resident = [], []  # buckets whose moments are in CPU memory (streamed through the device) or on it
        offset, hypers, rounded = 0, {}, []  # rounded: (bf16 parameter, its float32 master), both local
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for param in group["params"]:  # host work per parameter: kept to a few lookups (hundreds of them)
                data = param.data
                data = data.to_local() if hasattr(data, "to_local") else data  # FSDP2: this rank's shard
                numel = data.numel()
                start, offset = offset, offset + numel  # every parameter counts, so offsets are fixed
                grad = param.grad
                if grad is None or numel == 0:
                    continue
                grad = grad.to_local() if hasattr(grad, "to_local") else grad
                state = self._moments(param, data)
                step = state["step"] = state["step"] + 1
                key = (lr, beta1, beta2, eps, decay, step, data.device)
                hyper = hypers.get(key)
                if hyper is None:  # one small host-to-device copy per distinct setting, not one per parameter
                    hyper = hypers[key] = _hyper_tensor([lr, beta1, beta2, eps, decay, 1 - beta1 ** step,
                                                         1 - beta2 ** step], apply, grad_scale, data.device)
                noise_key = self._noise_key(param, step) if param.dtype == torch.bfloat16 else None
                weights, grads = data.view(-1), grad.view(-1)
                if "master" in state:  # the update runs on the float32 copy, as for a float32 parameter
                    weights, noise_key = _flat(state["master"]), None
                    rounded.append((data, weights.view(data.shape)))
                m, v = _flat(state["exp_avg"]), _flat(state["exp_avg_sq"])
                buckets = streamed if id(param) in self._offloaded_ids else resident
                if numel <= self.chunk_elements:
                    _add_piece(buckets, _Piece(weights, grads, m, v, start), hyper, noise_key, self.chunk_elements)
                    continue
                for first in range(0, numel, self.chunk_elements):
                    piece = slice(first, first + self.chunk_elements)
                    _add_piece(buckets, _Piece(weights[piece], grads[piece], m[piece], v[piece], start + first),
                               hyper, noise_key, self.chunk_elements)
        self._fresh_moments.clear()
        if not (streamed or resident):
            return loss
        device = (streamed or resident)[0].pieces[0].weights.device
        _attach_noise_bases(streamed + resident, device)
        update = chunk_update_function(device)
        if streamed and device.type == "cuda":
            self._streamed(streamed, update, resident)
        else:  # on CPU the "offloaded" moments are already where they are used
            for bucket in resident + streamed:
                m, v = bucket.gather_moments(device)
                bucket.scatter(update(bucket.gather_weights(), bucket.gather_grads(), m, v, bucket.noise_base,
                                      bucket.hyper), m, v)
        if rounded:  # the weights the model computes with: the float32 masters rounded to nearest
            torch._foreach_copy_([weights for weights, _ in rounded], [master for _, master in rounded])
        return loss

    def uncount_step(self) -> None:
        """Take back the step count of a step that `apply` turned into a no-op (its bias corrections)."""
        for state in self.state.values():
            if "step" in state:
                state["step"] -= 1

    def _streamed(self, buckets, update, resident=()) -> None:
        """Offloaded moments through a pipeline: bucket i+1's moments are copied in on one stream and
        bucket i-1's copied back on another while bucket i is updated, so the two PCIe directions and the
        arithmetic overlap instead of running one after another. At most three buckets' moments are on
        the GPU at once (the host waits for bucket i-2's copy back before fetching bucket i+1). The `resident` buckets (moments on the GPU) are updated while the first offloaded
        bucket is copied in."""
        main = torch.cuda.current_stream()
        if self._copy_streams is None:  # made once, not per step
            self._copy_streams = (torch.cuda.Stream(), torch.cuda.Stream())
        inbound, outbound = self._copy_streams
        inbound.wait_stream(main)  # gradients and weights are final before anything reads them

        def fetch(i: int):
            with torch.cuda.stream(inbound):
                fetched = buckets[i].gather_moments(main.device)
            return fetched, inbound.record_event()

        upcoming = fetch(0)
        for bucket in resident:
            m, v = bucket.gather_moments(main.device)
            bucket.scatter(update(bucket.gather_weights(), bucket.gather_grads(), m, v, bucket.noise_base,
                                  bucket.hyper), m, v)
        written = []  # per bucket: its moments are back in CPU memory
        for i, bucket in enumerate(buckets):
            (m, v), ready = upcoming
            if i >= 2:  # the host waits, not the copies: without it, it queues every fetch at once and the
                written[i - 2].synchronize()  # allocator, unable to reuse blocks still in use, reserves GiBs more
            if i + 1 < len(buckets):
                upcoming = fetch(i + 1)
            weights, grads = bucket.gather_weights(), bucket.gather_grads()  # before the wait: not in the copy's way
            main.wait_event(ready)
            bucket.write_weights(update(weights, grads, m, v, bucket.noise_base, bucket.hyper))
            outbound.wait_stream(main)
            with torch.cuda.stream(outbound):
                bucket.write_moments(m, v)
            written.append(outbound.record_event())
            for tensor in (m, v):  # allocated on `inbound`, read on main and outbound: not reused before both finish
                tensor.record_stream(main)
                tensor.record_stream(outbound)
        main.wait_stream(outbound)
        torch.cuda.current_stream().synchronize()  # the moments are complete on the host before anyone reads them


@functools.lru_cache(maxsize=64)
def _step_noise_key(seed: int, step: int, shard: int) -> int:
    """`LeanAdamW._noise_key`'s hash, computed once per step and shard rather than once per parameter."""
    return hash32((hash32((hash32(seed & _MASK32) + step) & _MASK32) + shard) & _MASK32)


class _Piece(NamedTuple):
    """One parameter's flat elements (or a chunk of them) with their gradient and moments; `offset` is the
    first element's place in this rank's parameters laid end to end (the rounding counter)."""
    weights: torch.Tensor
    grads: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    offset: int


class _Bucket:
    """Consecutive pieces updated by one call of the update kernel: small parameters (biases, norms,
    attention projections) are concatenated, so a step costs a few dozen kernel launches and copies
    instead of several per parameter, which left the GPU waiting on the host between tiny updates."""

    def __init__(self, piece: _Piece, hyper: torch.Tensor, noise_key: int | None):
        self.pieces, self.hyper, self.noise_key, self.noise_base = [piece], hyper, noise_key, None
        self.numel = piece.weights.numel()

    def accepts(self, piece: _Piece, hyper: torch.Tensor, noise_key: int | None, capacity: int) -> bool:
        last = self.pieces[-1]
        return (hyper is self.hyper and noise_key == self.noise_key and self.numel + piece.weights.numel() <= capacity
                and last.offset + last.weights.numel() == piece.offset  # counters stay consecutive
                and (piece.weights.dtype, piece.grads.dtype, piece.m.device) == (last.weights.dtype, last.grads.dtype,
                                                                               last.m.device))

    def _joined(self, field: str) -> torch.Tensor:
        """The pieces' `field` as one flat tensor: a view where they lie end to end in one storage, else a copy."""
        tensors = [getattr(piece, field) for piece in self.pieces]
        if len(tensors) == 1:
            return tensors[0]
        view = _end_to_end_view(tensors)
        return torch.cat(tensors) if view is None else view

    def gather_weights(self) -> torch.Tensor:
        return self._joined("weights")

    def gather_grads(self) -> torch.Tensor:
        return self._joined("grads")

    def gather_moments(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's moments on `device`: a view of resident ones when they lie end to end (a single piece, or
        moments allocated together: updated in place), else copies (from CPU memory without blocking when
        offloaded)."""
        if self.pieces[0].m.device == device:
            return self._joined("m"), self._joined("v")
        moments = []
        for field in ("m", "v"):
            flat, start = torch.empty(self.numel, dtype=torch.float32, device=device), 0
            for piece in self.pieces:
                size = piece.weights.numel()
                flat[start:start + size].copy_(getattr(piece, field), non_blocking=True)
                start += size
            moments.append(flat)
        return moments[0], moments[1]

    def write_weights(self, updated: torch.Tensor) -> None:
        self._write("weights", updated)

    def write_moments(self, m: torch.Tensor, v: torch.Tensor) -> None:
        self._write("m", m)
        self._write("v", v)

    def scatter(self, updated: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """After an update on the device where the moments live: weights back, and moments unless they were
        updated in place."""
        self.write_weights(updated)
        if m.data_ptr() != self.pieces[0].m.data_ptr():  # a copy, not a view updated in place
            self.write_moments(m, v)

    def _write(self, field: str, flat: torch.Tensor) -> None:
        targets = [getattr(piece, field) for piece in self.pieces]
        sizes = [target.numel() for target in targets]
        if targets[0].device != flat.device:  # offloaded moments: back to pinned CPU memory
            for target, part in zip(targets, flat.split(sizes)):
                target.copy_(part, non_blocking=True)
        elif len(targets) == 1:
            targets[0].copy_(flat)
        else:
            torch._foreach_copy_(targets, list(flat.split(sizes)))


def _end_to_end_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over contiguous `tensors` that follow each other in one storage, or None if they do not."""
    first, end = tensors[0], tensors[0].storage_offset()
    for tensor in tensors:
        if (not tensor.is_contiguous() or tensor.storage_offset() != end
                or tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        end += tensor.numel()
    return first.as_strided((end - first.storage_offset(),), (1,), first.storage_offset())


def _hyper_tensor(values: list[float], apply: torch.Tensor | None, scale: torch.Tensor | None,
                  device: torch.device) -> torch.Tensor:
    """`adamw_chunk`'s hyper-parameters on the device, without a stream sync (pinned, non-blocking), with
    the apply flag and the gradient scale appended (1 when not given)."""
    hyper = host_to_device(torch.tensor([*values, 1.0, 1.0], dtype=torch.float32), device)
    if apply is None and scale is None:
        return hyper
    apply = hyper[-2:-1] if apply is None else apply.to(device=device, dtype=torch.float32).reshape(1)
    scale = hyper[-1:] if scale is None else scale.to(device=device, dtype=torch.float32).reshape(1)
    return torch.cat([hyper[:-2], apply, scale])


def _add_piece(buckets: list[_Bucket], piece: _Piece, hyper: torch.Tensor, noise_key: int | None,
               capacity: int) -> None:
    if buckets and buckets[-1].accepts(piece, hyper, noise_key, capacity):
        buckets[-1].pieces.append(piece)
        buckets[-1].numel += piece.weights.numel()
    else:
        buckets.append(_Bucket(piece, hyper, noise_key))


def _attach_noise_bases(buckets: list[_Bucket], device: torch.device) -> None:
    """Each rounded bucket's first counter, (step key + offset) mod 2**32, as a one-element tensor on the
    device: all of them in one host-to-device copy, each 16 bytes from the last (Triton builds a kernel per
    alignment of its pointers: one-element slices 8 bytes apart took two builds of the same update kernel)."""
    rounded = [bucket for bucket in buckets if bucket.noise_key is not None]
    if not rounded:
        return
    starts = torch.tensor([[(b.noise_key + b.pieces[0].offset) & _MASK32, 0] for b in rounded], dtype=torch.int64)
    if device.type == "cuda":
        starts = starts.pin_memory().to(device, non_blocking=True)
    for i, bucket in enumerate(rounded):
        bucket.noise_base = starts[i, :1]
