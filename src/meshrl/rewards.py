"""Reward functions: (completion text, reference answer) -> float, combined by weights.

Pure functions so they can be unit-tested and run in any process (the RewardActor calls `combined_reward`).
Register your own with `@register_reward("name")` in a module the reward actor imports.
"""

from __future__ import annotations

from collections.abc import Callable

RewardFn = Callable[[str, str], float]
REWARD_FNS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        REWARD_FNS[name] = fn
        return fn

    return deco


@register_reward("exact_match")
def exact_match(completion: str, answer: str) -> float:
    return float(completion == answer)


@register_reward("char_match")
def char_match(completion: str, answer: str) -> float:
    """Fraction of positions right, over the longer of the two strings: dense partial credit that also
    penalises answers that are too long or too short."""
    if not completion and not answer:
        return 1.0
    hits = sum(a == b for a, b in zip(completion, answer, strict=False))
    return hits / max(len(completion), len(answer))


def check_reward_weights(weights: dict[str, float]) -> None:
    unknown = sorted(set(weights) - set(REWARD_FNS))
    if unknown:
        raise ValueError(f"unknown reward function(s) {unknown}; registered: {sorted(REWARD_FNS)}")


def combined_reward(completion: str, answer: str, weights: dict[str, float]) -> tuple[float, dict[str, float]]:
    """Weighted sum of the named reward functions, and each one's raw value (for logging)."""
    check_reward_weights(weights)
    parts = {name: REWARD_FNS[name](completion, answer) for name in weights}
    return sum(weights[n] * v for n, v in parts.items()), parts
