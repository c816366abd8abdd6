"""Environments and reward functions that kill or hold their process, as a user's buggy code would: importable as
`user_faults:Name` by the environment and reward processes (the tests directory is on the path the controller
passes them). FaultEnv: each row's `info["kind"]` says what its episodes do: "ok" (reward 1 at the first step),
"gil" (a regex that backtracks for hours inside the C regex engine, never releasing the interpreter), "segv" (reads
address 0), "abort" (os.abort), "bad_reset" (reset raises), "sleep" (a 60 s sleep: slow but releasing the
interpreter)."""

from __future__ import annotations

import os
import re
import time

from meshrl.envs import Environment, StepResult
from meshrl.tasks.base import Row

# 2**40 backtracking steps on this input, all inside re's C matcher, which never releases the GIL.
_CATASTROPHIC = re.compile(r"(a+)+$")


def hold_the_interpreter() -> None:
    _CATASTROPHIC.match("a" * 40 + "b")


def segfault() -> None:
    import ctypes

    ctypes.string_at(0)


class FaultEnv(Environment):
    def reset(self, row: Row, seed: int):
        self.kind = row.info.get("kind", "ok")
        if self.kind == "bad_reset":
            raise RuntimeError("no such puzzle")
        return None

    def step(self, message: str) -> StepResult:
        if self.kind == "gil":
            hold_the_interpreter()
        elif self.kind == "segv":
            segfault()
        elif self.kind == "abort":
            os.abort()
        elif self.kind == "sleep":
            time.sleep(60)
        return StepResult(reward=1.0, done=True, correct=True)

    def demonstration(self, row: Row) -> list[str]:
        return ["1"]

    @classmethod
    def rows(cls, split: str, size: int, seed: int) -> list[dict]:
        kinds = ["ok", "gil", "ok", "segv"]
        return [{"prompt": f"say {i}", "answer": "1", "kind": kinds[i % len(kinds)]} for i in range(size)]


def holds_the_interpreter_on_poison(completion: str, row: dict) -> float:
    """A verifier that never returns on one sample — the completion holding 'POISON' — stuck in C code that keeps the
    interpreter (its GIL), so nothing else in its process runs; the others score as contains_answer does (issue 31
    item 15)."""
    if "POISON" in completion:
        hold_the_interpreter()
    return float(str(row["answer"]) in completion)
