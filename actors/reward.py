"""RewardActor: scores completions with the task's weighted reward functions."""

from __future__ import annotations

from dataclasses import dataclass

from monarch.actor import Actor, endpoint

from meshrl.rewards import check_reward_weights, combined_reward


@dataclass
class Scored:
    reward: float
    parts: dict[str, float]  # each reward function's raw value
    text: str  # the decoded completion


class RewardActor(Actor):
    def __init__(self, tokenizer, reward_weights: dict[str, float]) -> None:
        check_reward_weights(reward_weights)
        self.tokenizer, self.reward_weights = tokenizer, dict(reward_weights)

    @endpoint
    def score(self, completion_ids: list[list[int]], answers: list[str]) -> list[Scored]:
        if len(completion_ids) != len(answers):
            raise ValueError(f"{len(completion_ids)} completions but {len(answers)} reference answers")
        out = []
        for ids, answer in zip(completion_ids, answers, strict=True):
            text = self.tokenizer.decode(ids)
            reward, parts = combined_reward(text, answer, self.reward_weights)
            out.append(Scored(reward, parts, text))
        return out
