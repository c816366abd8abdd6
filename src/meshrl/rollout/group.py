"""A group: the G episodes of one row, the unit GRPO-style advantages are computed over."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.rollout.episode import Episode


@dataclass
class Group:
    """The `len(episodes)` episodes rolled out from one row, and the rewards the step trains them on.

    `index` is the row's place in its split (what the sampler drew), `rewards` one per episode: the environment's
    reward plus the rubric's, plus any shaping (DAPO's overlong penalty) — what advantages are computed from."""

    index: int
    episodes: list[Episode]
    rewards: list[float]

    def __post_init__(self) -> None:
        if len(self.rewards) != len(self.episodes):
            raise ValueError(f"{len(self.rewards)} rewards for a group of {len(self.episodes)} episodes")

    def __len__(self) -> int:
        return len(self.episodes)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version that sampled any token of the group (the asynchronous loop's staleness)."""
        return min(min(e.tokens.policy_versions, default=0) for e in self.episodes)
