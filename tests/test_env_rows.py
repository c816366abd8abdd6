"""An environment's own dataset (`Environment.rows`, used when a run names --env but no --task / --data), as a user
writes it: through the real command-line parser and `build_task`, in process (issue 31, item 2)."""

from __future__ import annotations

import pytest

from controller.cli import parse_run_config
from meshrl.config import GRPORunConfig
from meshrl.envs import Environment, StepResult
from meshrl.errors import ConfigError
from meshrl.rollout.render import Renderer
from meshrl.tasks import build_task
from meshrl.tasks.base import Row
from meshrl.tasks.setup import PromptSet
from meshrl.tokenizer import CharTokenizer


class _Countdown(Environment):
    def reset(self, row, seed):
        self.target = row.answer

    def step(self, message):
        return StepResult(reward=float(message.strip() == self.target), done=True)


class InstanceRows(_Countdown):
    """`rows` written as an instance method: the environment is never constructed for it."""

    def rows(self, split, size, seed):
        return [Row(f"count {i}", str(i)) for i in range(size)]


class DictRows(_Countdown):
    """Rows as dicts, the shape of a data file's rows (prompt or messages, answer, any other field: info)."""

    @classmethod
    def rows(cls, split, size, seed):
        plain = [{"prompt": f"count to {i}", "answer": i, "level": i % 3} for i in range(size - 1)]
        chat = {"messages": [{"role": "user", "content": "count to 9"}], "answer": "9"}
        return plain + [chat]


class NoAnswerRows(_Countdown):
    @classmethod
    def rows(cls, split, size, seed):
        return [{"prompt": f"say {i}"} for i in range(size)]


class WrongArgsRows(_Countdown):
    @classmethod
    def rows(cls, split):
        return [Row("x", "1")]


class NotAListRows(_Countdown):
    @classmethod
    def rows(cls, split, size, seed):
        return Row("x", "1")


class BadDictRows(_Countdown):
    @classmethod
    def rows(cls, split, size, seed):
        return [{"question": "x", "answer": "1"}]


class EmptyRows(_Countdown):
    @classmethod
    def rows(cls, split, size, seed):
        return [] if split == "eval" else [Row("x", "1")]


def _task(env: str, *flags: str):
    cfg = parse_run_config(GRPORunConfig, argv=["--env", f"test_env_rows:{env}", "--env.num-train", "4", *flags])
    return build_task(cfg)


def test_an_instance_method_rows_is_refused_naming_the_class_and_the_signature():
    with pytest.raises(ConfigError) as e:
        _task("InstanceRows")
    message = str(e.value)
    assert "InstanceRows.rows" in message and "@classmethod" in message, message
    assert "def rows(cls, split, size, seed)" in message, message


def test_dict_rows_are_read_as_data_file_rows_and_render():
    task = _task("DictRows")
    assert all(isinstance(r, Row) for r in [*task.train, *task.eval])
    assert task.train[1] == Row("count to 1", "1", {"level": 1})  # the integer answer -> "1", the rest -> info
    assert task.train[-1].prompt == [{"role": "user", "content": "count to 9"}] and task.train[-1].answer == "9"
    renderer = Renderer(CharTokenizer("abcdefghijklmnopqrstuvwxyz 0123456789").to_hf())
    prompts = PromptSet.render(task.train[:-1], renderer, 100, "train")  # the plain rows (no chat template here)
    assert len(prompts) == 3 and prompts.views[1]["level"] == 1


def test_dict_rows_need_no_answer():
    assert [r.answer for r in _task("NoAnswerRows").train] == [None] * 4


@pytest.mark.parametrize(
    "env, says",
    [
        ("WrongArgsRows", r"WrongArgsRows.rows\(split\) cannot be called as rows\('train', 4, 1234\)"),
        ("NotAListRows", r"NotAListRows.rows\('train', 4, 1234\) returned Row, not a list"),
        ("BadDictRows", r"BadDictRows.rows\('train', 4, 1234\), row 1: missing field 'prompt'"),
        ("EmptyRows", r"EmptyRows.rows\('eval', 200, 1234\) returned no rows"),
    ],
)
def test_bad_rows_hooks_are_refused_at_launch_naming_the_class(env, says):
    with pytest.raises(ConfigError, match=says) as e:
        _task(env)
    assert "docs/environments.md" in str(e.value)


def test_an_environment_without_rows_says_to_give_data():
    with pytest.raises(ConfigError, match="_Countdown has no built-in rows; give them with --data.train"):
        _task("_Countdown")
