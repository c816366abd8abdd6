"""The task seam: what every RL task is to the controller.

A task is rows in, scores out:

    task.train, task.eval        -> Row(prompt, answer, info)       prompt: plain text or chat messages
    renderer (meshrl.rollout.render)      -> prompt token ids                 the MODEL's tokenizer and chat template
    generator                     -> completions (token ids)
    Rubric (meshrl.rewards)    -> reward per completion            fn(completion_text, row.verifier_view())

A task never tokenizes: rendering happens once, in the controller, with the model directory's tokenizer, so the
same task trains any checkpoint. Scoring runs in the reward processes through named reward functions (built-in,
registered, or `package.module:function`), so everything a verifier needs travels in the row.

Single-turn tasks are one-turn episodes: the multi-turn environments of a later issue are reset from the same
`Row`, and the rollout seam grows from here (a task that returns an episode instead of one completion).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshrl.rollout.row import Message, Prompt, Row  # noqa: F401 - re-exported: tasks are rows in, scores out


@dataclass
class Task:
    """A named set of train / held-out rows and how they are judged.

    `reward` is the default reward spec (`"name=weight,..."`, meshrl.rewards) used when the run names none;
    `verifier` is the reward function that decides whether a completion is *correct* (value >= 1): held-out
    accuracy, mean@k and pass@k count with it, and the reward name `task` means it."""

    name: str
    train: Sequence[Row]
    eval: Sequence[Row]
    reward: str
    verifier: str
    skipped: dict[str, int] = field(default_factory=dict)  # bad rows skipped at load (reason -> count)
    corpus: Sequence[str] = ()  # more texts a new model's tokenizer learns from (an environment's messages)

    def demonstration(self, row: Row) -> str:
        """The response a supervised warm-up trains on for `row`."""
        if row.answer is None:
            raise ValueError(f"task {self.name!r}: a supervised warm-up needs rows with an answer")
        return row.answer
