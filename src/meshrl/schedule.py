"""Learning-rate schedules, computed in the controller and passed to `optim_step` on every call, and the
`OptimParams` of a step built from the `--optim.*` section (`optim_params`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshrl.types import OptimParams

if TYPE_CHECKING:
    from meshrl.optim_config import OptimConfig


def lr_at(
    step: int,
    *,
    peak_lr: float,
    total_steps: int,
    schedule: str = "constant",
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
) -> float:
    """LR for optimiser step `step` (0-based): linear warm-up, then constant / cosine / linear decay."""
    if warmup_steps and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak_lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    floor = peak_lr * min_lr_ratio
    if schedule == "cosine":
        return floor + (peak_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return peak_lr - (peak_lr - floor) * progress
    raise ValueError(f"unknown LR schedule {schedule!r}; use constant, cosine or linear")


def optim_params(
    cfg: OptimConfig,
    step: int,
    total_steps: int,
    *,
    peak_lr: float | None = None,
    schedule: str | None = None,
    warmup_steps: int | None = None,
    min_lr_ratio: float | None = None,
    weight_decay: float | None = None,
) -> OptimParams:
    """What `optim_step` takes for optimiser step `step` (0-based) of `total_steps`: the learning rate from `cfg`'s
    schedule (`lr_at`) and its AdamW settings. A keyword given overrides `cfg`'s field of that name (the warm-up
    runs its own peak and schedule).

        params = optim_params(cfg.optim, step, cfg.grpo.steps)
    """
    lr = lr_at(
        step,
        peak_lr=cfg.lr if peak_lr is None else peak_lr,
        total_steps=total_steps,
        schedule=cfg.schedule if schedule is None else schedule,
        warmup_steps=cfg.warmup_steps if warmup_steps is None else warmup_steps,
        min_lr_ratio=cfg.min_lr_ratio if min_lr_ratio is None else min_lr_ratio,
    )
    return OptimParams(
        lr=lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay if weight_decay is None else weight_decay,
        grad_clip=cfg.grad_clip,
    )
