"""Reward functions as a user writes them in their own module, named 'user_rewards:<fn>' in a reward spec
(tests/ is on PYTHONPATH; see conftest.py)."""

from __future__ import annotations

import asyncio

from meshrl.rewards import group_reward

NOT_A_FUNCTION = 42


def contains_answer(completion: str, row: dict) -> float:
    return float(str(row["answer"]) in completion)


async def async_contains_answer(completion: str, row: dict) -> float:
    await asyncio.sleep(0.01)  # e.g. an HTTP call to a judge
    return float(str(row["answer"]) in completion)


def long_enough(completion: str, row: dict, *, cfg) -> float:
    """A keyword-only `cfg` receives the run's ScoringConfig."""
    return float(len(completion) >= cfg.length_target)


class Judges:
    @staticmethod
    def strict(completion: str, row: dict) -> float:
        return float(completion == row["answer"])


def raises(completion: str, row: dict) -> float:
    """A buggy verifier: every sample it scores fails (scored 0 and counted; the run goes on)."""
    raise KeyError("test_cases")


def hangs(completion: str, row: dict) -> float:
    """A verifier stuck on every sample (e.g. a sandbox that never answers): past scoring.timeout_s it scores 0."""
    import time

    time.sleep(3600)
    return 1.0


@group_reward
def shortest_wins(completions: list[str], row: dict) -> list[float]:
    """A group reward: 1 for the shortest completion(s) of the group, 0 for the others."""
    shortest = min(len(c) for c in completions)
    return [float(len(c) == shortest) for c in completions]


def old_contract(completion: str, answer: str) -> float:
    """Written for the earlier contract (the answer string, not the row dict)."""
    return float(completion.strip() == answer)


def segfaults_on_poison(completion: str, row: dict) -> float:
    """A verifier that crashes its process (a segfault in C code) on one sample — the completion holding 'POISON' —
    and scores the others as contains_answer does (issue 31 item 15)."""
    if "POISON" in completion:
        import ctypes

        ctypes.string_at(0)  # reads address 0: a real segfault, as a buggy C extension has
    return float(str(row["answer"]) in completion)
