"""The optimiser's section (`--optim.*`): the peak learning rate and its schedule (`meshrl.schedule.lr_at`, computed
in the controller) and the AdamW settings (`meshrl.optim`, in the trainer). Kept apart from optim.py so that reading
a command line never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshrl.errors import ConfigError


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate; the controller computes the per-step value and passes it to `optim_step`."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after the linear warm-up."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""
    min_lr_ratio: float = 0.1
    """Final LR of the cosine / linear decay, as a fraction of `lr`."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Max global grad norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"optim.lr={self.lr} must be > 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas={self.betas} must each be in [0, 1)")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("optim.grad_clip and optim.weight_decay must be >= 0")
