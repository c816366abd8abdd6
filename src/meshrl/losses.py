"""Policy losses, token-level, as sums over loss tokens (the trainer divides by the global token count).

A loss takes the trainer's logprobs of the target tokens `[B, T]` (with grad) and a `LossBatch` of aligned
tensors, and returns `(loss_sum, metric_sums)`. Register your own with `@register_loss("name")`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class LossBatch:
    mask: torch.Tensor  # [B, T] float weights, 0 on prompt / padding
    old_logprobs: torch.Tensor  # [B, T] generator's logprobs of the targets (0 where mask is 0)
    advantages: torch.Tensor  # [B]


LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    def deco(fn: LossFn) -> LossFn:
        LOSSES[name] = fn
        return fn

    return deco


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; registered losses: {sorted(LOSSES)}")
    return LOSSES[name]


@register_loss("grpo")
def grpo_loss(
    logprobs: torch.Tensor, batch: LossBatch, *, clip_low: float = 0.2, clip_high: float = 0.2
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-style clipped importance-ratio policy gradient against the generator's logprobs, per token:
    -min(r·A, clip(r, 1-clip_low, 1+clip_high)·A) with r = exp(logp - logp_old)."""
    mask = batch.mask
    log_ratio = (logprobs - batch.old_logprobs) * (mask > 0)
    ratio = torch.exp(log_ratio)
    adv = batch.advantages[:, None].to(logprobs.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        is_clipped = (clipped < unclipped).to(mask.dtype)
        metrics = {
            "clip_frac": (is_clipped * mask).sum(),
            "ratio": (ratio * mask).sum(),
            # k3 estimator of KL(generator || trainer), a cheap drift monitor.
            "kl_k3": ((torch.exp(-log_ratio) - 1 + log_ratio) * mask).sum(),
        }
    return (per_token * mask).sum(), metrics


@register_loss("cross_entropy")
def cross_entropy_loss(logprobs: torch.Tensor, batch: LossBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised negative log-likelihood of the (masked) target tokens."""
    nll = -(logprobs * batch.mask).sum()
    return nll, {"nll": nll.detach()}
