"""A row: one prompt of an RL task or environment, and everything its verifier needs. The leaf of the rollout
seam: tasks, environments, data loading and rendering all speak in rows, and import them from here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Message = Mapping[str, Any]  # {"role": "system" | "user" | "assistant" | ..., "content": str}
Prompt = str | Sequence[Message]


@dataclass(frozen=True, eq=True)
class Row:
    """One prompt of an RL task, and everything its verifier needs.

    `prompt` is plain text (rendered through the chat template as one user turn when the model has one, or fed
    as is) or a list of chat messages. `answer` is the reference answer (also the demonstration text of a
    supervised warm-up). `info` holds the row's other fields — test cases, metadata — passed to the verifiers."""

    prompt: Prompt
    answer: str | None = None
    info: Mapping[str, Any] = field(default_factory=dict)

    def verifier_view(self) -> dict[str, Any]:
        """The dict a reward function `fn(completion, row)` receives: the row's own fields, plus `prompt` and
        `answer`."""
        return {**self.info, "prompt": self.prompt, "answer": self.answer}

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)
