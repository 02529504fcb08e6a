"""Optimizer and learning-rate schedule for actor, critic and SFT: AdamW with warm-up then decay."""

from __future__ import annotations

import math
from typing import Iterable

import torch

SCHEDULES = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def build_optimizer(parameters: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    params = [p for p in parameters if p.requires_grad]
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
