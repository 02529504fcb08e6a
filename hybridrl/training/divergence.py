"""Divergence guard: stop a run that is blowing up before anything of it is saved over the last good checkpoint.

After each step (and before its checkpoint) the step's logged metrics and the trainable weights are
checked against bounds; the first one crossed ends the run with a `TrainingError` of one sentence: the
cause, the step, and what to lower. The trainer then writes neither a checkpoint nor `model/`, so the newest
checkpoint is the last step that passed, and `trainer.resume=auto` with a lower learning rate continues from it.

What counts as blowing up (each bound is a `Limits` field; the trainer's config sets them):
- any non-finite loss, gradient norm or entropy, or a non-finite trainable weight;
- a gradient norm above `max_grad_norm`: the norm `update.py` logs is the one before clipping, so clipping
  does not hide it;
- the policy's entropy more than `entropy_ratio` times and more than `entropy_margin` nats above its value at
  the run's first step (a policy that has collapsed to noise samples near-uniformly);
- the largest trainable weight more than `max_weight_growth` times the largest at the start of the run. A
  relative bound, since models differ in their largest weight (norm gains near 1, some biases in the tens);
  healthy fine-tuning moves weights by a small fraction of their size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.parallel import process_group
from hybridrl.training.update import TrainingError

LOSS_KEYS = ("actor/policy_loss", "critic/value_loss")
GRAD_NORM_KEYS = ("actor/grad_norm", "critic/grad_norm")
ENTROPY_KEY = "actor/entropy"


@dataclass(frozen=True)
class Limits:
    """The bounds of a healthy run; 0 turns a bound off (non-finite values are always refused)."""

    max_grad_norm: float = 1e5
    """Largest gradient norm (before clipping) of the actor or critic."""
    entropy_ratio: float = 3.0
    """The entropy may rise to this many times its first-step value ..."""
    entropy_margin: float = 1.0
    """... and this many nats above it; beyond both, the policy is taken to have collapsed to noise."""
    max_weight_growth: float = 100.0
    """Largest trainable weight, in multiples of the largest at the start of the run."""


def _hint(key: str) -> str:
    role = "critic" if key.startswith("critic/") else "actor"
    if key in GRAD_NORM_KEYS:
        return f"lower {role}.lr or {role}.max_grad_norm"
    return f"lower {role}.lr"


def find_divergence(history: list[dict[str, float]], limits: Limits, max_weight: float | None = None,
                    start_max_weight: float | None = None) -> str | None:
    """Why the newest step of `history` (rows of logged metrics, oldest first, each with its "step") shows a
    run blowing up, or None. `max_weight` is the largest absolute trainable weight after that step and
    `start_max_weight` the largest at the start of the run (either None skips the weight check)."""
    if not history:
        return None
    row = history[-1]
    step = int(row.get("step", len(history)))
    for key in (*LOSS_KEYS, *GRAD_NORM_KEYS, ENTROPY_KEY):
        if key in row and not math.isfinite(row[key]):
            return f"{key} became {row[key]} at step {step}; {_hint(key)}"
    for key in GRAD_NORM_KEYS:
        if limits.max_grad_norm > 0 and row.get(key, 0.0) > limits.max_grad_norm:
            return (f"{key} (before clipping) was {row[key]:.3g} at step {step}, above {limits.max_grad_norm:.3g}; "
                    f"{_hint(key)}")
    start = next((r[ENTROPY_KEY] for r in history if ENTROPY_KEY in r and math.isfinite(r[ENTROPY_KEY])), None)
    if start is not None and ENTROPY_KEY in row and limits.entropy_ratio > 0:
        entropy = row[ENTROPY_KEY]
        if entropy > limits.entropy_ratio * start and entropy > start + limits.entropy_margin:
            return (f"{ENTROPY_KEY} rose from {start:.3g} at the first step to {entropy:.3g} at step {step} "
                    f"(more than {limits.entropy_ratio:g}x and {limits.entropy_margin:g} nat above it): the policy "
                    f"collapsed to noise; {_hint(ENTROPY_KEY)}")
    if max_weight is not None:
        if not math.isfinite(max_weight):
            return f"a trainable weight became {max_weight} at step {step}; {_hint('actor/policy_loss')}"
        if start_max_weight and limits.max_weight_growth > 0 and max_weight > limits.max_weight_growth * start_max_weight:
            return (f"the largest trainable weight grew from {start_max_weight:.3g} at the start to {max_weight:.3g} "
                    f"at step {step} (more than {limits.max_weight_growth:g}x); {_hint('actor/policy_loss')}")
    return None


def max_abs_weight(model: torch.nn.Module, setup: Any = None) -> float:
    """The largest absolute value among the trainable parameters (a frozen 4-bit base is left out), over every
    process's shard when `setup` is distributed (every rank must then call it); NaN if any is NaN."""
    largest = []
    for parameter in model.parameters():
        if not parameter.requires_grad:
            continue
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter  # FSDP2: this rank's shard
        if local.numel():
            largest.append(local.detach().abs().amax().float().reshape(1))
    # NaN compares false under max: count NaNs apart so one is never hidden.
    values = torch.cat(largest) if largest else torch.zeros(1)
    found = torch.stack([values.nan_to_num(nan=0.0).max(), values.isnan().any().float()])
    if setup is not None and setup.is_distributed:
        found = process_group.all_reduce(found.to(setup.device), setup, op="max")
    maximum, any_nan = found.tolist()
    return float("nan") if any_nan else maximum


class DivergenceGuard:
    """Made at the start of the loop (after resuming): it measures the weights it compares against; then
    `check(history)` after each logged step raises a `TrainingError` when the run is blowing up."""

    def __init__(self, model: torch.nn.Module, setup: Any = None, limits: Limits = Limits(), enabled: bool = True):
        self.model, self.setup, self.limits, self.enabled = model, setup, limits, enabled
        self.weights = enabled and limits.max_weight_growth > 0
        self.start_max_weight = max_abs_weight(model, setup) if self.weights else None

    def check(self, history: list[dict[str, float]]) -> None:
        """Raise if the newest step of `history` shows divergence. Every rank calls it with the same (reduced)
        metrics, so all raise together."""
        if not self.enabled:
            return
        max_weight = max_abs_weight(self.model, self.setup) if self.weights else None
        problem = find_divergence(history, self.limits, max_weight, self.start_max_weight)
        if problem:
            raise TrainingError(f"the run is diverging: {problem}; this step was not saved, so the newest checkpoint "
                                "is the last good step (trainer.resume=auto continues from it).")
