"""String reversal: prompt 'abc=' → answer 'cba'. Verifiable, needs no data download, and a tiny model can
learn it in minutes on a CPU."""

from __future__ import annotations

import random
from dataclasses import dataclass

from meshrl.errors import ConfigError
from meshrl.tasks.base import Row, Task
from meshrl.tokenizer import CharTokenizer


@dataclass
class ReverseTaskConfig:
    """The built-in string-reversal task (--task reverse)."""

    num_train: int = 2000
    """Training prompts."""
    num_eval: int = 100
    """Held-out prompts (none of them in the training set)."""
    min_len: int = 2
    """Shortest string to reverse (letters)."""
    max_len: int = 5
    """Longest string to reverse (letters)."""
    alphabet: str = "abcdefgh"
    """Letters the strings are made of."""
    seed: int = 1234
    """Seed of the generated prompts."""

    def __post_init__(self) -> None:
        if self.num_train < 1:
            raise ConfigError(f"reverse.num_train={self.num_train}: the training set is empty")
        if self.num_eval < 1:
            raise ConfigError(f"reverse.num_eval={self.num_eval}: the held-out set is empty")
        if not 1 <= self.min_len <= self.max_len:
            raise ConfigError(f"reverse: need 1 <= min_len ({self.min_len}) <= max_len ({self.max_len})")
        if len(set(self.alphabet)) != len(self.alphabet) or not self.alphabet.isalpha():
            raise ConfigError(f"reverse.alphabet={self.alphabet!r} must be distinct letters")

    def tokenizer(self) -> CharTokenizer:
        """The character tokenizer a randomly initialised model of this task is made with."""
        return CharTokenizer(self.alphabet + "=")


def make_reverse_rows(n: int, *, alphabet: str, min_len: int, max_len: int, rng: random.Random) -> list[Row]:
    out = []
    for _ in range(n):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
        out.append(Row(prompt=s + "=", answer=s[::-1]))
    return out


def build_reverse_task(cfg: ReverseTaskConfig) -> Task:
    rng = random.Random(cfg.seed)
    kw = dict(alphabet=cfg.alphabet, min_len=cfg.min_len, max_len=cfg.max_len, rng=rng)
    train = make_reverse_rows(cfg.num_train, **kw)
    seen = {r.prompt for r in train}
    eval_: list[Row] = []
    # Held-out means held out: no eval prompt appears in the training set (when the space allows it).
    for _ in range(50 * cfg.num_eval):
        if len(eval_) == cfg.num_eval:
            break
        (row,) = make_reverse_rows(1, **kw)
        if row.prompt not in seen:
            seen.add(row.prompt)
            eval_.append(row)
    if len(eval_) < cfg.num_eval:
        raise ConfigError(
            f"task 'reverse' could only find {len(eval_)} held-out prompts not in the {cfg.num_train} training "
            f"prompts; lower --reverse.num-train or raise --reverse.max-len / enlarge --reverse.alphabet"
        )
    # Half per-position credit (dense), half exact match (what held-out accuracy counts).
    return Task("reverse", train, eval_, reward="char_match=0.5,exact_match=0.5", verifier="exact_match")
