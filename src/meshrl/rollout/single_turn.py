"""A single-turn task as a one-turn episode.

`SingleTurnEnv` is the environment every `meshrl.tasks.Task` runs through: the row's prompt opens the episode, the
model answers once, and the episode ends. It gives no reward of its own — the run's rubric (its reward functions,
in the reward processes) scores the answer, as it scores an environment's last answer when `--reward` is given
with `--env`. So a single-turn run and a multi-turn run produce the same thing: `Episode`s, grouped by row.

The controller rolls single-turn groups out in one generator call per round (`n = G` samples per prompt, one seed
per round) rather than turn by turn through `EpisodeRunner`: the same episodes, fewer calls, and the seed rule
the runs before this seam were sampled with (so they stay bitwise what they were). `episode_of` builds the
episode from that call's completion.
"""

from __future__ import annotations

from meshrl.rollout.environment import Environment, EpisodeOutcome, StepResult
from meshrl.rollout.episode import Episode, EpisodeTokens
from meshrl.rollout.row import Row
from meshrl.types import Completion


class SingleTurnEnv(Environment):
    """One model turn, no reward of its own (the rubric scores it)."""

    default_reward_name = "rubric"

    def step(self, message: str) -> StepResult:
        return StepResult(done=True)

    @staticmethod
    def episode_of(row: Row, completion: Completion, text: str, images: tuple[bytes, ...] = ()) -> Episode:
        """The one-turn episode of `completion` (sampled from the rendered `row`, with its `images`) whose decoded
        answer is `text`; unscored (reward 0 until the rubric scores it)."""
        tokens = EpisodeTokens(images=images)
        tokens.add_context(completion.prompt_ids)
        tokens.add_completion(completion)
        outcome = EpisodeOutcome(
            row=row,
            messages=[{"role": "assistant", "content": text}],  # the prompt is the row's
            turn_rewards=[0.0],
            reward=0.0,
            correct=False,
            num_turns=1,
            finish_reason=completion.finish_reason,  # "stop" | "length", as the generator said
        )
        return Episode(tokens, outcome)
