"""Guess the number: a game that takes several turns to win, for testing multi-turn RL.

Single-turn tasks cannot tell whether credit flows across turns; this game can. The environment thinks of a
secret in [1, high] (the row's answer), the model guesses, the environment says "Higher." or "Lower." until the
guess is right. Reading the feedback pays: binary search wins within floor(log2(high)) + 1 guesses, a policy that
ignores it takes about high / 2. The rules are trivial, so a tiny model can learn them, and the episode length
(not the reward alone) shows whether it did.

    user:       I am thinking of a number between 1 and 16. Guess it; I will say higher or lower.
    assistant:  8          user: Higher.
    assistant:  12         user: Lower.
    assistant:  10         user: Higher.
    assistant:  11                                  -> reward 1.0, correct, metrics {"guesses": 4}

The episode's turn limit is the caller's (EnvConfig), not the game's: an episode that runs out of turns ends with
the rewards it has (0 unless won).
"""

from __future__ import annotations

import math
import random
import re

from meshrl.errors import ConfigError
from meshrl.rollout.environment import Environment, StepResult
from meshrl.rollout.row import Row

DEFAULT_HIGH = 16
"""The range of the built-in rows (`rows` is a classmethod and does not see the environment's kwargs)."""

_INTEGER = re.compile(r"(?<!\d)-?\d+")


def opening(high: int) -> str:
    """The game's first message (also the built-in rows' prompt): short, since a tiny model reads it."""
    return f"I am thinking of a number between 1 and {high}. Guess it; I will say higher or lower."


def binary_search_guesses(secret: int, high: int) -> list[int]:
    """The guesses of binary search on [1, high] until it hits `secret`: the midpoint (rounded down) of the range
    still possible after each reply. At most floor(log2(high)) + 1 guesses."""
    if not 1 <= secret <= high:
        raise ValueError(f"secret {secret} is not in [1, {high}]")
    lo, hi, guesses = 1, high, []
    while True:
        guess = (lo + hi) // 2
        guesses.append(guess)
        if guess == secret:
            return guesses
        if guess < secret:
            lo = guess + 1
        else:
            hi = guess - 1


class GuessNumberEnv(Environment):
    """Guess a secret number in [1, high] with higher / lower feedback (see the module docstring).

    kwargs (a JSON object on the command line):
      high: the top of the range (default 16; at least 2). Rows whose secret lies outside [1, high] are refused at
        reset. When it differs from the range a row was made for (`info["high"]`), the environment opens the
        episode with its own message instead of the row's prompt, so the model is told the real range.
      turn_penalty: subtracted from the reward of every turn that does not win (wrong, out-of-range or missing
        guesses alike), so a shorter win scores more; 0 (default) rewards any win equally."""

    def __init__(self, high: int = DEFAULT_HIGH, turn_penalty: float = 0.0) -> None:
        if isinstance(high, bool) or not isinstance(high, int) or not 2 <= high <= 1_000_000:
            raise ConfigError(f"GuessNumberEnv kwarg high={high!r}: give an integer between 2 and 1000000")
        if (
            isinstance(turn_penalty, bool)
            or not isinstance(turn_penalty, int | float)
            or not math.isfinite(turn_penalty)
            or turn_penalty < 0
        ):
            raise ConfigError(
                f"GuessNumberEnv kwarg turn_penalty={turn_penalty!r}: give a number >= 0 (e.g. 0.05); it is "
                "subtracted from each turn that does not win"
            )
        self.high = high
        self.turn_penalty = float(turn_penalty)
        self.secret: int | None = None
        self.guesses = 0

    def reset(self, row: Row, seed: int) -> str | None:
        """The secret is the row's answer. Opens with the row's prompt, unless the row was made for another range
        (then with this game's own opening)."""
        try:
            secret = int(str(row.answer).strip())
        except ValueError:
            raise ValueError(f"GuessNumberEnv: row answer {row.answer!r} is not an integer secret") from None
        if not 1 <= secret <= self.high:
            raise ConfigError(
                f"GuessNumberEnv: the row's secret {secret} is outside [1, {self.high}]; raise the kwarg high or "
                "give rows with secrets in range"
            )
        self.secret = secret
        self.guesses = 0
        row_high = row.info.get("high")
        return None if row_high is None or row_high == self.high else opening(self.high)

    def step(self, message: str) -> StepResult:
        if self.secret is None:
            raise RuntimeError("GuessNumberEnv.step called before reset")
        found = _INTEGER.findall(message)
        guess = int(found[-1]) if found else None
        miss = -self.turn_penalty
        if guess is None or not 1 <= guess <= self.high:
            return StepResult(f"Say a number between 1 and {self.high}.", reward=miss, metrics={"invalid_guesses": 1})
        self.guesses += 1
        if guess < self.secret:
            return StepResult("Higher.", reward=miss)
        if guess > self.secret:
            return StepResult("Lower.", reward=miss)
        return StepResult(reward=1.0, done=True, correct=True, metrics={"guesses": self.guesses})

    @classmethod
    def rows(cls, split: str, size: int, seed: int, high: int = DEFAULT_HIGH) -> list[Row]:
        """`size` games: secrets in [1, high], every value once per round of `high` rows (shuffled), so each
        secret is equally represented. The same (split, size, seed) gives the same rows; the splits use different
        streams of the seed. Train and eval share secrets (the game has only `high` of them): what a held-out game
        tests is playing by the feedback, which no secret can be memorised into."""
        if split not in ("train", "eval"):
            raise ConfigError(f"GuessNumberEnv.rows: split={split!r}; give 'train' or 'eval'")
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"GuessNumberEnv.rows: size={size!r}; give at least 1")
        if isinstance(high, bool) or not isinstance(high, int) or high < 2:
            raise ConfigError(f"GuessNumberEnv.rows: high={high!r}; give an integer >= 2")
        rng = random.Random(f"guess_number-{split}-{seed}")
        secrets: list[int] = []
        while len(secrets) < size:
            round_ = list(range(1, high + 1))
            rng.shuffle(round_)
            secrets += round_
        return [Row(prompt=opening(high), answer=str(s), info={"high": high}) for s in secrets[:size]]

    def demonstration(self, row: Row) -> list[str] | None:
        """Binary search on this environment's range: the shortest sure win (the replies follow from the secret)."""
        try:
            secret = int(str(row.answer).strip())
        except ValueError:
            return None
        if not 1 <= secret <= self.high:
            return None
        return [str(g) for g in binary_search_guesses(secret, self.high)]


__all__ = ["DEFAULT_HIGH", "GuessNumberEnv", "binary_search_guesses", "opening"]
