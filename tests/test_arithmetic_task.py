"""The procedural arithmetic task (meshrl.tasks.arithmetic): rows, determinism, held-out disjointness, the gold that
math-verify reads from each demonstration, and config validation."""

from __future__ import annotations

import random

import pytest

from meshrl.errors import ConfigError
from meshrl.tasks.arithmetic import ArithmeticConfig, build_arithmetic_task
from meshrl.tasks.base import Task


def _eval_expr(prompt: str) -> int:
    """The true value of 'What is a op b op c?', left to right."""
    assert prompt.startswith("What is ") and prompt.endswith("?"), prompt
    tokens = prompt[len("What is ") : -1].split()
    acc = int(tokens[0])
    for op, v in zip(tokens[1::2], tokens[2::2], strict=True):
        acc = {"+": acc + int(v), "-": acc - int(v), "*": acc * int(v)}[op]
    return acc


def test_rows_and_task_fields():
    task = build_arithmetic_task(ArithmeticConfig(num_train=300, num_eval=50, seed=3))
    assert isinstance(task, Task)
    assert task.name == "arithmetic" and task.reward == "math_verify=1.0" and task.verifier == "math_verify"
    assert len(task.train) == 300 and len(task.eval) == 50
    for row in list(task.train[:20]) + list(task.eval[:20]):
        value = _eval_expr(row.prompt)
        assert row.answer == f"\\boxed{{{value}}}"
        assert row.info == {"solution": str(value)}
        assert task.demonstration(row) == row.answer
        assert value >= 0  # allow_negative=False by default


def test_deterministic_by_seed():
    cfg = dict(num_train=200, num_eval=30, operations="+-*", max_value=30)
    a = build_arithmetic_task(ArithmeticConfig(seed=7, **cfg))
    b = build_arithmetic_task(ArithmeticConfig(seed=7, **cfg))
    c = build_arithmetic_task(ArithmeticConfig(seed=8, **cfg))
    assert a.train == b.train and a.eval == b.eval
    assert a.train != c.train


def test_held_out_disjoint_and_independent_of_train_size():
    small = build_arithmetic_task(ArithmeticConfig(num_train=500, num_eval=200))
    big = build_arithmetic_task(ArithmeticConfig(num_train=4000, num_eval=200))
    for task in (small, big):
        train_q = {r.prompt for r in task.train}
        assert len(train_q) == len(task.train)  # distinct
        assert len({r.prompt for r in task.eval}) == len(task.eval)
        assert not train_q & {r.prompt for r in task.eval}
    assert small.eval == big.eval  # the same held-out questions whatever the training-set size


@pytest.mark.parametrize(
    "cfg",
    [
        ArithmeticConfig(num_train=200, num_eval=40, seed=1),
        ArithmeticConfig(num_train=200, num_eval=40, seed=2, operations="+-*", allow_negative=True),
        ArithmeticConfig(num_train=200, num_eval=40, seed=3, num_operands=3, max_value=30, show_work=True),
        ArithmeticConfig(num_train=200, num_eval=40, seed=4, operations="-", num_operands=3, allow_negative=True),
    ],
    ids=["add_sub", "negative_mul", "three_show_work", "three_negative"],
)
def test_math_verify_reads_the_true_result_from_the_demonstration(cfg):
    from math_verify import parse, verify

    task = build_arithmetic_task(cfg)
    rows = random.Random(0).sample(list(task.train) + list(task.eval), 25)
    for row in rows:
        value = _eval_expr(row.prompt)
        assert row.info["solution"] == str(value)
        if not cfg.allow_negative:
            assert value >= 0
        gold = parse(row.answer)
        assert gold, row.answer
        assert verify(gold, parse(f"\\boxed{{{value}}}")), (row.answer, value)
        assert not verify(gold, parse(f"\\boxed{{{value + 1}}}")), (row.answer, value)
        if cfg.show_work:
            assert row.answer.endswith(f"\\boxed{{{value}}}") and " = " in row.answer


def test_meshrl_math_verify_reward_scores_demonstrations():
    rewards = pytest.importorskip("meshrl.rewards")
    fn = rewards.REWARD_FNS.get("math_verify")
    if fn is None:
        pytest.skip("meshrl.rewards has no math_verify reward")
    task = build_arithmetic_task(
        ArithmeticConfig(num_train=50, num_eval=10, num_operands=3, max_value=30, show_work=True)
    )
    for row in task.train[:10]:
        view = row.verifier_view()
        value = row.info["solution"]
        assert fn(row.answer, view) == 1.0
        assert fn(f"\\boxed{{{value}}}", view) == 1.0
        assert fn(f"\\boxed{{{int(value) + 1}}}", view) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        (dict(num_train=0), "--arithmetic.num-train"),
        (dict(num_eval=0), "--arithmetic.num-eval"),
        (dict(operations="+/"), "--arithmetic.operations"),
        (dict(operations=""), "--arithmetic.operations"),
        (dict(min_value=-1), "--arithmetic.min-value"),
        (dict(min_value=10, max_value=5), "--arithmetic.max-value"),
        (dict(num_operands=1), "--arithmetic.num-operands"),
        (dict(num_train=200, max_value=9), "--arithmetic.num-train"),
    ],
)
def test_config_validation_names_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        ArithmeticConfig(**kwargs)
