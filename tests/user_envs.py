"""Environments as a user would write them, importable as `user_envs:Class` by the tests (and by actor processes:
the tests directory is on sys.path when pytest runs)."""

from __future__ import annotations

import asyncio
import time

from meshrl.envs import Environment, StepResult
from meshrl.tasks.base import Row


class EchoEnv(Environment):
    """Answers every message with a fixed observation; never done (the turn and token limits end it)."""

    def __init__(self, reply: str = "again") -> None:
        self.reply = reply

    def step(self, message: str) -> StepResult:
        return StepResult([{"role": "user", "content": self.reply}], reward=0.25)

    @classmethod
    def rows(cls, split: str, size: int, seed: int) -> list[Row]:
        return [Row(f"say something {i}", answer="x") for i in range(size)]


class FlakyEnv(Environment):
    """Raises in step() on rows whose info says so, hangs (sync sleep) or stalls (async sleep) on others: a user's
    buggy or slow environment. The other rows get one observation, then reward 1 at the second turn."""

    def reset(self, row: Row, seed: int):
        self.kind, self.turn = row.info.get("kind", "ok"), 0
        return None

    def step(self, message: str) -> StepResult:
        self.turn += 1
        if self.kind == "raise":
            raise RuntimeError("environment bug")
        if self.kind == "hang":
            time.sleep(5)
        if self.turn == 2:
            return StepResult(reward=1.0, done=True)
        return StepResult("go on")

    def demonstration(self, row: Row) -> list[str]:
        return ["1", "1"]


class AsyncStallEnv(Environment):
    """An async environment that stalls on rows marked 'stall' (the event loop must not wait on it)."""

    async def reset(self, row: Row, seed: int):
        self.stall = row.info.get("kind") == "stall"
        return [{"role": "user", "content": f"opening {seed % 7}"}]

    async def step(self, message: str) -> StepResult:
        if self.stall:
            await asyncio.sleep(5)
        await asyncio.sleep(0.01)
        return StepResult(reward=1.0, done=True)


class JitterEnv(Environment):
    """Answers after a random delay (wall-clock jitter): which episodes wait together changes from run to run, what
    they sample must not."""

    def reset(self, row: Row, seed: int):
        self.turn = 0
        return None

    async def step(self, message: str) -> StepResult:
        import random

        self.turn += 1
        await asyncio.sleep(random.random() * 0.03)
        return StepResult(f"turn {self.turn}", reward=float(len(message) % 2))


class HangsForAMinute(Environment):
    """A step that never comes back in time (a blocking call with no timeout of its own)."""

    def step(self, message: str) -> StepResult:
        time.sleep(60)
        return StepResult(done=True)

    def demonstration(self, row: Row) -> list[str]:
        return ["1"]
