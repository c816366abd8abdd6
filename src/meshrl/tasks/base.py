"""What a task is: examples with a prompt and a checkable answer, plus a tokenizer to speak it."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.tokenizer import CharTokenizer


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str  # the reference answer (also the demonstration for supervised warm-up)


@dataclass
class Task:
    name: str
    tokenizer: CharTokenizer
    train: list[Example]
    eval: list[Example]
    reward_weights: dict[str, float]

    def prompt_ids(self, examples: list[Example]) -> list[list[int]]:
        return [self.tokenizer.encode(e.prompt) for e in examples]

    def demonstration_ids(self, example: Example) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids ending in EOS) for supervised warm-up."""
        return self.tokenizer.encode(example.prompt), self.tokenizer.encode(example.answer) + [self.tokenizer.eos_id]
