"""Deterministic shuffled passes over a dataset, with a cursor that checkpoints: used for SFT examples and for
RL prompt draws alike."""

from __future__ import annotations

import random


class EpochSampler:
    """Deterministic shuffled passes over `n` examples. The cursor (epoch, offset) and the seed are the whole
    state: restoring them continues exactly where a run stopped — no example seen twice or skipped. Each epoch is
    its own seeded permutation, so every example is drawn once per epoch; a draw may span an epoch boundary.
    The state does not record `n`: restore with the same number of examples."""

    def __init__(self, n: int, *, seed: int, epoch: int = 0, offset: int = 0) -> None:
        if n < 1:
            raise ValueError("cannot sample from an empty dataset")
        self.n, self.seed, self.epoch, self.offset = n, seed, epoch, offset
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_indices(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.offset == self.n:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(k - len(out), self.n - self.offset)
            out += self._order[self.offset : self.offset + take]
            self.offset += take
        return out

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.offset / self.n

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed}

    @classmethod
    def from_state(cls, n: int, state: dict[str, int]) -> EpochSampler:
        return cls(n, seed=state["seed"], epoch=state["epoch"], offset=state["offset"])
