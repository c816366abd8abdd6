"""Procedural tasks of the `reasoning-gym` package (countdown, basic_arithmetic, chain_sum, ...), generated in
process — no download — and scored by the package's own verifier for each task.

    --task reasoning_gym:countdown --reasoning-gym.size 2000 --reward task=1.0
    --task reasoning_gym:countdown --reasoning-gym.options '{"min_numbers": 3, "max_numbers": 4}'
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshrl.errors import ConfigError
from meshrl.tasks.base import Row, Task

VERIFIER = "meshrl.tasks.reasoning_gym:score"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass
class ReasoningGymConfig:
    """Procedural reasoning-gym tasks (--task reasoning_gym:NAME)."""

    size: int = 2000
    """Training rows generated."""
    eval_size: int = 200
    """Held-out rows, generated past the training rows (questions that also occur in training removed)."""
    seed: int = 42
    """Seed of the rows (reasoning-gym draws item i from seed + i: training items are seed .. seed + size - 1, held-out
    items the next eval_size)."""
    options: str = ""
    """The task's own dataset options, as a JSON object passed to reasoning-gym's dataset factory, e.g.
    '{"min_numbers": 3, "max_numbers": 4}' for countdown (from Python, a dict is taken too). '': its defaults."""

    def __post_init__(self) -> None:
        if self.size < 1 or self.eval_size < 1:
            raise ConfigError(f"reasoning_gym.size={self.size} and eval_size={self.eval_size} must be >= 1")
        if isinstance(self.options, Mapping):  # from Python; kept as JSON, as the command line gives it
            self.options = json.dumps(dict(self.options))
        self.task_options()  # a bad JSON object fails here, naming the flag

    def task_options(self) -> dict[str, Any]:
        """`options` as the keyword arguments of `reasoning_gym.create_dataset`."""
        if not self.options:
            return {}
        example = '{"min_numbers": 3, "max_numbers": 4}'
        try:
            value = json.loads(self.options)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--reasoning-gym.options {self.options!r} is not JSON ({e}); give an object, e.g. '{example}'"
            ) from None
        if not isinstance(value, dict):
            raise ConfigError(
                f"--reasoning-gym.options {self.options!r} must be a JSON object of the task's options, e.g. "
                f"'{example}'"
            )
        return value


def extract_answer(completion: str) -> str:
    """reasoning-gym's convention: the answer inside the last <answer>...</answer>; without tags, the whole text."""
    tagged = _ANSWER_TAG.findall(completion)
    return (tagged[-1] if tagged else completion).strip()


def score(completion: str, row: dict) -> float:
    """The reward function of every reasoning-gym task: the package's own scorer of the row's source task."""
    import reasoning_gym

    entry = {"question": row["prompt"], "answer": row["answer"], "metadata": row["metadata"]}
    fn = reasoning_gym.get_score_answer_fn(row["metadata"]["source_dataset"])
    return float(fn(answer=extract_answer(completion), entry=entry))


def build_reasoning_gym_task(name: str, cfg: ReasoningGymConfig) -> Task:
    import reasoning_gym

    options = cfg.task_options()

    def rows(size: int, seed: int) -> list[Row]:
        try:
            data = reasoning_gym.create_dataset(name, size=size, seed=seed, **options)
        except Exception as e:  # noqa: BLE001 - unknown name or bad options: say which, and what exists
            from reasoning_gym.factory import DATASETS

            given = f" with --reasoning-gym.options {cfg.options}" if options else ""
            known = f"tasks: {', '.join(sorted(DATASETS))}"
            if name in DATASETS:  # the task exists: its options are what failed
                known = f"its options are the fields of {DATASETS[name][1].__name__} in reasoning-gym"
            raise ConfigError(
                f"--task reasoning_gym:{name}{given} could not be built ({type(e).__name__}: {e}); {known}"
            ) from None
        return [Row(prompt=e["question"], answer=str(e["answer"]), info={"metadata": e["metadata"]}) for e in data]

    train = rows(cfg.size, cfg.seed)
    seen = {r.prompt for r in train}
    # reasoning-gym seeds item i with seed + i: held-out rows start where the training rows end.
    held_out = [r for r in rows(cfg.eval_size, cfg.seed + cfg.size) if r.prompt not in seen]
    if not held_out:
        raise ConfigError(f"reasoning_gym:{name}: every held-out question is also a training question")
    return Task(f"reasoning_gym:{name}", train, held_out, reward=f"{VERIFIER}=1.0", verifier=VERIFIER)
