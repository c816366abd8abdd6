"""Procedural tasks of the `reasoning-gym` package (countdown, basic_arithmetic, chain_sum, ...), generated in
process — no download — and scored by the package's own verifier for each task.

    --task reasoning_gym:countdown --reasoning-gym.size 2000 --reward task=1.0
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
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
    options: dict[str, Any] = field(default_factory=dict)
    """The task's own generator options (e.g. {"min_numbers": 3, "max_numbers": 4} for countdown)."""

    def __post_init__(self) -> None:
        if self.size < 1 or self.eval_size < 1:
            raise ConfigError(f"reasoning_gym.size={self.size} and eval_size={self.eval_size} must be >= 1")


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

    def rows(size: int, seed: int) -> list[Row]:
        try:
            data = reasoning_gym.create_dataset(name, size=size, seed=seed, **cfg.options)
        except Exception as e:  # noqa: BLE001 - unknown name or bad options: say which, and what exists
            from reasoning_gym.factory import DATASETS

            raise ConfigError(
                f"--task reasoning_gym:{name} could not be built ({type(e).__name__}: {e}); tasks: "
                f"{', '.join(sorted(DATASETS))}"
            ) from None
        return [Row(prompt=e["question"], answer=str(e["answer"]), info={"metadata": e["metadata"]}) for e in data]

    train = rows(cfg.size, cfg.seed)
    seen = {r.prompt for r in train}
    # reasoning-gym seeds item i with seed + i: held-out rows start where the training rows end.
    held_out = [r for r in rows(cfg.eval_size, cfg.seed + cfg.size) if r.prompt not in seen]
    if not held_out:
        raise ConfigError(f"reasoning_gym:{name}: every held-out question is also a training question")
    return Task(f"reasoning_gym:{name}", train, held_out, reward=f"{VERIFIER}=1.0", verifier=VERIFIER)
