"""Optimizer and learning-rate schedule for actor, critic and SFT: AdamW with warm-up then decay.

`LeanAdamW` is AdamW for bf16 training without a float32 master copy: float32 moments (8 bytes per
parameter, optionally in CPU memory), and the update written back to the bf16 weight with stochastic
rounding. Trade-off against float32 master weights (12 bytes more per parameter for bf16+fp32 copies,
4 more than here): rounding is unbiased but adds noise of half a bf16 ulp per step; nearest rounding
without a master copy would instead drop every update below half an ulp (most of them at lr 1e-6).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from hybridrl.config import MissingExtra

SCHEDULES = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def build_optimizer(parameters: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), state_dtype: str = "float32",
                    offload: bool | float = False, eight_bit: bool = False, seed: int = 0) -> torch.optim.Optimizer:
    """AdamW: torch's fused one for float32 parameters; `LeanAdamW` for bf16 parameters (float32 state,
    no float32 weight copy) or CPU-offloaded state (`offload`: True, or the share offloaded);
    bitsandbytes' 8-bit AdamW when `eight_bit`."""
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
        return LeanAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, offload=offload, seed=seed)
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
    """Random low 16 bits for `round_with_noise`, drawn apart so the rounding itself can be compiled."""
    return torch.randint(0, 1 << 16, shape, generator=generator, dtype=torch.int32, device=device)


def round_with_noise(values: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16, rounding up with probability equal to the dropped fraction (unbiased)."""
    bits = values.view(torch.int32)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: low 16 bits are zero


def stochastic_round_to_bf16(values: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 -> bfloat16, rounding up with probability equal to the dropped fraction (unbiased)."""
    return round_with_noise(values, rounding_noise(values.shape, generator, values.device))


def adamw_chunk(weights: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                noise: torch.Tensor | None, hyper: torch.Tensor) -> torch.Tensor:
    """AdamW on one flat chunk, in float32: updates the moments `m`, `v` in place and returns the new
    weights in the weights' dtype (stochastically rounded with `noise` when given). `hyper` holds
    (lr, beta1, beta2, eps, weight decay, bias correction 1, bias correction 2) as a float32 tensor on
    the weights' device, so that compiled code sees the step-dependent values as data, not constants
    (no recompilation per step), and compiled, the whole update is one kernel."""
    lr, beta1, beta2, eps, decay, correction1, correction2 = hyper.unbind()
    grad = grad.float()
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).add_((1 - beta2) * grad * grad)
    updated = weights.float() * (1 - lr * decay)
    updated = updated - (lr / correction1) * m / (v.sqrt() / correction2.sqrt() + eps)
    if noise is not None:
        return round_with_noise(updated, noise)
    return updated.to(weights.dtype)


_COMPILED_CHUNK = None


def chunk_update_function(device: torch.device):
    """`adamw_chunk` compiled (one kernel per chunk instead of ~15) on CUDA with triton; eager elsewhere."""
    global _COMPILED_CHUNK
    if device.type != "cuda":
        return adamw_chunk
    try:
        import triton  # noqa: F401
    except ImportError:
        return adamw_chunk
    if _COMPILED_CHUNK is None:
        _COMPILED_CHUNK = torch.compile(adamw_chunk, dynamic=True)
    return _COMPILED_CHUNK


def _noise(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor | None:
    """The stochastic-rounding bits of one chunk (None: the parameter is not bf16)."""
    return None if generator is None else rounding_noise(weights.shape, generator, weights.device)


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

    bf16 parameters are updated in float32 chunk by chunk and stored back with stochastic rounding
    (fp16 with nearest rounding); float32 parameters match `torch.optim.AdamW`. `offload=True` keeps
    the moments in pinned CPU memory and copies each chunk in and out around its update; a fraction
    offloads that share of the parameter elements (the last parameters in order) and keeps the first
    ones' moments on the device, where they are updated while the first offloaded chunk is in flight.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, offload: bool | float = False, chunk_elements: int = 2**24,
                 seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        fraction = float(offload)
        if not 0 <= fraction <= 1:
            raise ValueError(f"offload must be a bool or a fraction in [0, 1]; got {offload!r}.")
        self.offload, self.chunk_elements, self.seed = fraction > 0, chunk_elements, seed
        self._offloaded_ids = offloaded_parameters([p for g in self.param_groups for p in g["params"]], fraction)
        self._copy_streams = None

    def is_offloaded(self, param: torch.Tensor) -> bool:
        """Whether `param`'s moments live in CPU memory (this rank's shard, as a plain tensor)."""
        return id(param) in self._offloaded_ids

    def _rounding_generator(self, param: torch.Tensor, index: int, step: int, device: torch.device) -> torch.Generator:
        """The stochastic-rounding noise of one parameter at one step: seeded by (seed, step, parameter,
        shard), so replicas of a shard (several GPUs with fsdp_shard_size < num_gpus) round identically
        and stay equal, different shards get different noise, and a resumed run rounds as the original."""
        shard = 0
        if hasattr(param, "device_mesh"):
            coordinate = param.device_mesh.get_coordinate() or []
            for dim, placement in enumerate(param.placements):
                if placement.is_shard():
                    shard = shard * param.device_mesh.size(dim) + coordinate[dim]
        generator = torch.Generator(device=device)
        generator.manual_seed(((self.seed * 1_000_003 + step) * 100_003 + index) * 1_009 + shard)
        return generator

    def _moments(self, param: torch.Tensor, local: torch.Tensor) -> dict:
        """The state of `param`; moments shaped like it. An FSDP2 (DTensor) parameter gets DTensor moments
        sharded the same way, so `get_state_dict` can gather them for a checkpoint; offloaded moments
        are this rank's shard in pinned CPU memory."""
        state = self.state[param]
        if not state:
            state["step"] = 0
            for key in ("exp_avg", "exp_avg_sq"):
                if self.is_offloaded(param):
                    state[key] = torch.zeros(local.shape, dtype=torch.float32, device="cpu", pin_memory=local.is_cuda)
                else:
                    state[key] = torch.zeros_like(param.detach(), dtype=torch.float32)
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
                if self.is_offloaded(param):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    self.state[param][key] = local.to("cpu", torch.float32).pin_memory() if param.is_cuda \
                        else local.to("cpu", torch.float32, copy=True)
                else:
                    self.state[param][key] = value.to(device=home.device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        # (weights, grads, exp_avg, exp_avg_sq, noise generator or None, hyper), flat views; moments in CPU
        # memory (streamed through the device) or on it (resident)
        streamed, resident = [], []
        index, hypers = -1, {}
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                data, grad_full = param.data, param.grad
                if hasattr(data, "to_local"):  # an FSDP2 DTensor: the update is elementwise, so each rank does its shard
                    data, grad_full = data.to_local(), grad_full.to_local()
                state = self._moments(param, data)
                state["step"] += 1
                key = (lr, beta1, beta2, eps, decay, state["step"], data.device)
                if key not in hypers:  # one small host-to-device copy per distinct setting, not one per parameter
                    hypers[key] = torch.tensor([lr, beta1, beta2, eps, decay, 1 - beta1 ** state["step"],
                                                1 - beta2 ** state["step"]], dtype=torch.float32).to(data.device)
                hyper = hypers[key]
                noise = self._rounding_generator(param, index, state["step"], data.device) \
                    if param.dtype == torch.bfloat16 else None
                weights, grads = data.view(-1), grad_full.view(-1)
                for start in range(0, weights.numel(), self.chunk_elements):
                    chunk = slice(start, start + self.chunk_elements)
                    (streamed if self.is_offloaded(param) else resident).append(
                        (weights[chunk], grads[chunk], _flat(state["exp_avg"])[chunk],
                         _flat(state["exp_avg_sq"])[chunk], noise, hyper))
        if not (streamed or resident):
            return loss
        update = chunk_update_function((streamed or resident)[0][0].device)
        if streamed and streamed[0][0].is_cuda:
            self._streamed(streamed, update, resident)
        else:  # on CPU the "offloaded" moments are already where they are used
            for weights, grads, m, v, noise, hyper in resident + streamed:
                weights.copy_(update(weights, grads, m.to(weights.device), v.to(weights.device),
                                     _noise(weights, noise), hyper))
        return loss

    def _streamed(self, chunks, update, resident=()) -> None:
        """Offloaded moments through a pipeline: chunk i+1's moments are copied in on one stream and
        chunk i-1's copied back on another while chunk i is updated, so the two PCIe directions and the
        arithmetic overlap instead of running one after another. At most three chunks' moments are on
        the GPU at once. The `resident` chunks (moments on the GPU) are updated while the first offloaded
        chunk is copied in."""
        main = torch.cuda.current_stream()
        if self._copy_streams is None:  # made once, not per step
            self._copy_streams = (torch.cuda.Stream(), torch.cuda.Stream())
        inbound, outbound = self._copy_streams
        inbound.wait_stream(main)  # gradients and weights are final before anything reads them

        def fetch(i: int):
            with torch.cuda.stream(inbound):
                m_home, v_home = chunks[i][2], chunks[i][3]
                fetched = (m_home.to(main.device, non_blocking=True), v_home.to(main.device, non_blocking=True))
            return fetched, inbound.record_event()

        upcoming = fetch(0)
        for weights, grads, m, v, noise, hyper in resident:
            weights.copy_(update(weights, grads, m, v, _noise(weights, noise), hyper))
        for i, (weights, grads, m_home, v_home, noise, hyper) in enumerate(chunks):
            (m, v), ready = upcoming
            if i + 1 < len(chunks):
                upcoming = fetch(i + 1)
            main.wait_event(ready)
            weights.copy_(update(weights, grads, m, v, _noise(weights, noise), hyper))
            outbound.wait_stream(main)
            with torch.cuda.stream(outbound):
                m_home.copy_(m, non_blocking=True)
                v_home.copy_(v, non_blocking=True)
            for tensor in (m, v):  # allocated on `inbound`, read on main and outbound: not reused before both finish
                tensor.record_stream(main)
                tensor.record_stream(outbound)
        main.wait_stream(outbound)
        torch.cuda.current_stream().synchronize()  # the moments are complete on the host before anyone reads them
