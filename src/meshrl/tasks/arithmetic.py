"""Procedurally generated arithmetic: 'What is 23 + 58?' → '\\boxed{81}', scored by math-verify.

A math task a tiny model learns on a CPU in minutes, shaped like the real thing: plain-text questions rendered
through the model's chat template, a demonstration response that ends with the answer in `\\boxed{}` (what
math-verify reads), and the gold number in the row so the `math_verify` reward judges the completion's value,
not its wording (`\\boxed{081}`, `81`, `\\boxed{ 81 }` are all right).

    --task arithmetic --arithmetic.num-train 20000 --arithmetic.max-value 99 --arithmetic.operations +-

Rows: `Row(prompt="What is 23 + 58?", answer="\\boxed{81}", info={"solution": "81"})`, or with `show_work` a
worked line first (`"23 + 58 = 81. \\boxed{81}"`; with three operands one step per operation). math-verify
extracts the *last* `\\boxed{}` of the answer first, so the gold it reads from `answer` is the result either way.
Held-out questions never appear in the training set. Deterministic: the same config gives the same rows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from meshrl.errors import ConfigError
from meshrl.tasks.base import Row, Task

OPERATIONS = "+-*"


@dataclass
class ArithmeticConfig:
    """The built-in procedural arithmetic task (--task arithmetic), scored by math-verify."""

    num_train: int = 14000
    """Training questions, all distinct. The default covers nearly all of the 15,050 distinct questions of the default
    operands and operations (a tiny model then learns the rule instead of memorising a subset)."""
    num_eval: int = 500
    """Held-out questions (distinct, none of them in the training set; drawn first, so the same for any
    num_train)."""
    seed: int = 1234
    """Seed of the generated questions."""
    operations: str = "+-"
    """Operators questions draw from, each equally likely: any of '+', '-', '*'."""
    min_value: int = 0
    """Smallest operand."""
    max_value: int = 99
    """Largest operand (99: numbers of up to two digits, drawn uniformly, so nine in ten have two)."""
    num_operands: int = 2
    """Operands per question (2: 'a + b'; 3: 'a + b - c', evaluated left to right)."""
    allow_negative: bool = False
    """Allow negative results; when False a subtraction never goes below zero (its operands are swapped, or the
    subtrahend redrawn)."""
    show_work: bool = False
    """Demonstrations write the computation before the answer ('23 + 58 = 81. \\boxed{81}'); otherwise the
    answer alone ('\\boxed{81}')."""

    def __post_init__(self) -> None:
        if self.num_train < 1:
            raise ConfigError(f"--arithmetic.num-train={self.num_train}: the training set is empty")
        if self.num_eval < 1:
            raise ConfigError(f"--arithmetic.num-eval={self.num_eval}: the held-out set is empty")
        if not self.operations or any(c not in OPERATIONS for c in self.operations):
            raise ConfigError(
                f"--arithmetic.operations={self.operations!r}: give one or more of {OPERATIONS!r} (e.g. '+-')"
            )
        if self.min_value < 0:
            raise ConfigError(f"--arithmetic.min-value={self.min_value} must be >= 0")
        if self.max_value < self.min_value:
            raise ConfigError(
                f"--arithmetic.max-value={self.max_value} must be >= --arithmetic.min-value={self.min_value}"
            )
        if not 2 <= self.num_operands <= 4:
            raise ConfigError(f"--arithmetic.num-operands={self.num_operands} must be 2, 3 or 4")
        n_ops = len(set(self.operations))
        values = self.max_value - self.min_value + 1
        space = values**self.num_operands * n_ops ** (self.num_operands - 1)
        wanted = self.num_train + self.num_eval
        if wanted > space:
            raise ConfigError(
                f"--arithmetic.num-train={self.num_train} + --arithmetic.num-eval={self.num_eval} = {wanted} "
                f"distinct questions, but operands {self.min_value}..{self.max_value}, {self.num_operands} "
                f"operands and operations {self.operations!r} make at most {space}: raise --arithmetic.max-value "
                "or lower --arithmetic.num-train"
            )


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def make_question(cfg: ArithmeticConfig, rng: random.Random) -> tuple[str, int, list[str]]:
    """One question: (expression, its value, the worked steps). Evaluated left to right (no precedence: every
    step is one operation on the running value, as the worked line writes it)."""
    values = [rng.randint(cfg.min_value, cfg.max_value) for _ in range(cfg.num_operands)]
    ops = [rng.choice(cfg.operations) for _ in range(cfg.num_operands - 1)]
    if not cfg.allow_negative and cfg.num_operands == 2 and ops[0] == "-" and values[0] < values[1]:
        values = [values[1], values[0]]
    acc, steps = values[0], []
    for op, v in zip(ops, values[1:], strict=True):
        if not cfg.allow_negative and op == "-" and v > acc:
            v = rng.randint(min(cfg.min_value, acc), acc)  # a subtrahend that keeps the running value >= 0
        new = _apply(acc, op, v)
        steps.append(f"{acc} {op} {v} = {new}")
        acc = new
        values[len(steps)] = v
    expr = f" {ops[0]} ".join([str(values[0]), str(values[1])])
    for op, v in zip(ops[1:], values[2:], strict=True):
        expr += f" {op} {v}"
    return expr, acc, steps


def make_row(expr: str, value: int, steps: list[str], *, show_work: bool) -> Row:
    answer = f"\\boxed{{{value}}}"
    if show_work:
        answer = ", ".join(steps) + ". " + answer
    return Row(prompt=f"What is {expr}?", answer=answer, info={"solution": str(value)})


def _distinct_rows(cfg: ArithmeticConfig, n: int, rng: random.Random, exclude: set[str]) -> list[Row]:
    out: list[Row] = []
    for _ in range(50 * n):
        if len(out) == n:
            break
        expr, value, steps = make_question(cfg, rng)
        if expr in exclude:
            continue
        exclude.add(expr)
        out.append(make_row(expr, value, steps, show_work=cfg.show_work))
    return out


def build_arithmetic_task(cfg: ArithmeticConfig) -> Task:
    """Distinct held-out questions, then distinct training questions that are not among them.

    The two sets come from two random streams of the seed, so the held-out set does not depend on `num_train`
    (runs with different training-set sizes are evaluated on the same questions)."""
    seen: set[str] = set()
    held_out = _distinct_rows(cfg, cfg.num_eval, random.Random(f"arithmetic-eval-{cfg.seed}"), seen)
    train = _distinct_rows(cfg, cfg.num_train, random.Random(f"arithmetic-train-{cfg.seed}"), seen)
    if len(held_out) < cfg.num_eval or len(train) < cfg.num_train:
        raise ConfigError(
            f"arithmetic: found only {len(train)} + {len(held_out)} distinct questions of the "
            f"{cfg.num_train} + {cfg.num_eval} asked for; raise --arithmetic.max-value or lower "
            "--arithmetic.num-train / --arithmetic.num-eval"
        )
    return Task("arithmetic", train, held_out, reward="math_verify=1.0", verifier="math_verify")


__all__ = ["ArithmeticConfig", "build_arithmetic_task", "make_question"]
