"""Learning-rate schedules, computed in the controller and passed to `optim_step` on every call."""

from __future__ import annotations

import math


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
