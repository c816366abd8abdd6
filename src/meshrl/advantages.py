"""Advantage estimators: rewards of G completions per prompt -> one advantage per completion."""

from __future__ import annotations

import torch


def group_advantages(
    rewards: list[float], group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO: (r - mean of its group) / (std of its group + eps); Dr.GRPO-style without the std.

    `rewards` is laid out group by group: rewards[g * group_size + i] is completion i of prompt g.
    """
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (r.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centred.flatten().tolist()
