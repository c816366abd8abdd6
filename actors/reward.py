"""RewardActor: scores completion texts with a Rubric (meshrl.rewards) built in the controller.

The Rubric arrives whole (cloudpickle): the functions a user registered or defined in the controller's own
script reach this process with it, and names were resolved at launch, so a bad name never fails a step."""

from __future__ import annotations

from monarch.actor import Actor, current_rank, endpoint

from meshrl.rewards import Rubric, ScoredSample
from meshrl.timeline import BusyLog


class RewardActor(Actor):
    def __init__(self, rewards: Rubric, index: int | None = None) -> None:
        self.rewards = rewards
        # `index`: this process's place among the run's reward processes (each is a mesh of its own).
        index = current_rank().rank if index is None else index
        self.busy_log = BusyLog(f"reward:{index}")  # the run's timeline (meshrl.timeline)

    @endpoint
    def score(
        self, completions: list[str], rows: list[dict], group_size: int = 1, only: str | None = None
    ) -> list[ScoredSample]:
        """Score `completions`, `group_size` consecutive ones per row (a GRPO group shares its row). `only`: with
        that one reward function (Rubric.score)."""
        if group_size < 1 or len(completions) != len(rows) * group_size:
            raise ValueError(
                f"{len(completions)} completions for {len(rows)} rows of group_size={group_size}: expected "
                f"{len(rows) * group_size}"
            )
        with self.busy_log.busy("score"):
            rows = [row for row in rows for _ in range(group_size)]
            return self.rewards.score(completions, rows, group_size, only=only)

    @endpoint
    def timeline(self) -> list[dict]:
        """This process's busy intervals since the last call (meshrl.timeline)."""
        return self.busy_log.take()
