"""A step's rollouts: the groups it trains on, and what was scored to get there (the recorder and the metrics read
it; `controller/rollouts.py` fills it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from meshrl.algorithms import informative_groups
from meshrl.rollout.episode import Episode
from meshrl.rollout.group import Group
from meshrl.types import Datum


@dataclass
class RolloutBatch:
    """What one RL step trains on, group by group, and what was scored to get there."""

    groups: list[Group] = field(default_factory=list)  # the groups kept, in draw order
    drawn: list[int] = field(default_factory=list)  # every row drawn this step, in order (kept or dropped)
    task_rewards: list[float] = field(default_factory=list)  # every episode scored this step (kept or dropped)
    correct: list[bool] = field(default_factory=list)  # the verdict on every episode scored this step
    reward_failures: Counter = field(default_factory=Counter)  # "name: timeout" / "env_error" -> episodes (scored 0)
    reward_parts: dict[str, list[float]] = field(default_factory=dict)  # rubric function -> value per episode
    prompts_drawn: int = 0
    rounds: int = 0
    groups_dropped: int = 0  # groups dynamic sampling dropped (all rewards equal)
    time_generate_s: float = 0.0
    time_score_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)  # episode / staleness metrics
    multi_turn: bool = False

    @property
    def empty(self) -> bool:
        return not self.groups

    @property
    def rows(self) -> list[int]:
        """The kept groups' row indices."""
        return [g.index for g in self.groups]

    @property
    def episodes(self) -> list[Episode]:
        return [e for g in self.groups for e in g.episodes]

    @property
    def rewards(self) -> list[float]:
        """Per kept episode: what advantages are computed from (reward + overlong shaping)."""
        return [r for g in self.groups for r in g.rewards]

    def datums(self) -> list[Datum]:
        return [e.tokens.datum() for e in self.episodes]

    def lengths(self) -> list[int]:
        """Model tokens per kept episode."""
        return [e.tokens.num_model_tokens for e in self.episodes]

    def turn_rewards(self) -> list[list[float]] | None:
        """Per kept episode, its environment's reward per turn (None for one-turn episodes: their reward is the
        rubric's, not a turn's)."""
        return [list(e.outcome.turn_rewards) for e in self.episodes] if self.multi_turn else None

    def add_round(self, picks: list[int], episodes: list[Episode], rewards: list[float], cfg: Any, want: int) -> None:
        """One round's groups (`group_size` episodes per pick): those DAPO's dynamic sampling keeps (every group
        without it), up to `want` groups in all, join the batch; the round is counted either way."""
        g = cfg.group_size
        keep = informative_groups(rewards, g) if cfg.dynamic_sampling else list(range(len(picks)))
        keep = keep[: want - len(self.groups)]
        for i in keep:
            self.groups.append(Group(picks[i], episodes[i * g : (i + 1) * g], rewards[i * g : (i + 1) * g]))
        self.drawn += picks
        self.prompts_drawn += len(picks)
        self.rounds += 1
        self.groups_dropped += len(picks) - len(keep)

    def trim(self, dp: int) -> None:
        """Drop whole groups from the end until the batch splits evenly over the `dp` trainer ranks."""
        while sum(len(g) for g in self.groups) % dp:
            self.groups.pop()
