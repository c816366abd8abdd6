"""Advantage estimators: rewards of G completions per prompt -> one advantage per completion.

`rewards` is laid out group by group: rewards[g * group_size + i] is completion i of prompt g.

| name             | advantage of completion i of a group                                   | from        |
| ---------------- | ---------------------------------------------------------------------- | ----------- |
| group_mean_std   | (r_i − mean(group)) / (std(group) + eps)                               | GRPO        |
| group_mean       | r_i − mean(group)                                                      | Dr.GRPO     |
| rloo             | r_i − mean of the other G−1 rewards of the group                       | RLOO        |
| reinforce_pp     | r_i − mean(group), then normalised over the whole batch (mean 0, std 1) | REINFORCE++ |
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

ADVANTAGES: dict[str, Callable[..., list[float]]] = {}


def register_advantage(name: str):
    def deco(fn):
        ADVANTAGES[name] = fn
        return fn

    return deco


def _groups(rewards: list[float], group_size: int) -> torch.Tensor:
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    return torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)


def group_advantages(
    rewards: list[float], group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO: (r - mean of its group) / (std of its group + eps); Dr.GRPO-style without the std."""
    r = _groups(rewards, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (r.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centred.flatten().tolist()


@register_advantage("group_mean_std")
def grpo_advantages(rewards: list[float], group_size: int) -> list[float]:
    return group_advantages(rewards, group_size, normalize_std=True)


@register_advantage("group_mean")
def dr_grpo_advantages(rewards: list[float], group_size: int) -> list[float]:
    return group_advantages(rewards, group_size, normalize_std=False)


@register_advantage("rloo")
def rloo_advantages(rewards: list[float], group_size: int) -> list[float]:
    """Leave-one-out baseline (Ahmadian et al. 2024): r_i − (sum(group) − r_i) / (G − 1)."""
    if group_size < 2:
        raise ValueError("RLOO needs group_size >= 2")
    r = _groups(rewards, group_size)
    baseline = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - baseline).flatten().tolist()


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(rewards: list[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """REINFORCE++ with baseline (Hu et al. 2025): subtract the group mean, then normalise across the whole batch
    ((a − mean(batch)) / (std(batch) + eps)), one value per completion."""
    r = _groups(rewards, group_size)
    a = (r - r.mean(dim=1, keepdim=True)).flatten()
    if a.numel() < 2:
        return a.tolist()
    return ((a - a.mean()) / (a.std(unbiased=True) + eps)).tolist()


def compute_advantages(
    name: str, rewards: list[float], group_size: int, *, turn_rewards: list[list[float]] | None = None
) -> list[float]:
    """One advantage per completion (or episode: every model token of an episode gets the episode's). A
    registered function that takes a `turn_rewards` keyword also gets each episode's per-turn rewards (multi-turn
    runs; None for single completions)."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; use one of {sorted(ADVANTAGES)}")
    fn = ADVANTAGES[name]
    if "turn_rewards" in inspect.signature(fn).parameters:
        return fn(rewards, group_size, turn_rewards=turn_rewards)
    return fn(rewards, group_size)
