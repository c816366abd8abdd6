"""Reward functions as a user writes them in their own module, named 'user_rewards:<fn>' in a reward spec
(tests/ is on PYTHONPATH; see conftest.py)."""

from __future__ import annotations

import asyncio

NOT_A_FUNCTION = 42


def contains_answer(completion: str, row: dict) -> float:
    return float(str(row["answer"]) in completion)


async def async_contains_answer(completion: str, row: dict) -> float:
    await asyncio.sleep(0.01)  # e.g. an HTTP call to a judge
    return float(str(row["answer"]) in completion)


class Judges:
    @staticmethod
    def strict(completion: str, row: dict) -> float:
        return float(completion == row["answer"])
