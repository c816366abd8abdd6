"""The rollout seam: rows in, scored episodes out — one seam for single-turn tasks and multi-turn environments.

    Row              one prompt and everything its verifier needs              (rollout/row.py)
    Environment      one episode's state: reset(row) -> step(message) -> ...   (rollout/environment.py)
    SingleTurnEnv    a task's row as a one-turn episode, scored by the rubric  (rollout/single_turn.py)
    Episode          an episode's tokens (token-in/token-out) and its outcome  (rollout/episode.py)
    Group            the G episodes of one row, with their rewards             (rollout/group.py)
    EpisodeRunner    many episodes at once against a generate function         (rollout/runner.py)

A single-turn task is a one-turn episode: its rows are rolled out as `Episode`s of one model turn and scored by
the run's reward functions (`meshrl.rewards.Rubric`), exactly as an environment's episodes are — an environment
adds its own turn rewards to the rubric's. The controller's side (sampling rounds, dynamic sampling, evaluation,
the asynchronous schedule) is one file, `controller/rollouts.py`. No Monarch imports here.
"""

from meshrl.rollout.environment import Environment, EpisodeOutcome, StepResult, as_messages, maybe_await, play
from meshrl.rollout.episode import Episode, EpisodeRenderer, EpisodeTokens
from meshrl.rollout.group import Group
from meshrl.rollout.row import Message, Prompt, Row
from meshrl.rollout.single_turn import SingleTurnEnv

__all__ = [
    "Environment",
    "Episode",
    "EpisodeOutcome",
    "EpisodeRenderer",
    "EpisodeTokens",
    "Group",
    "Message",
    "Prompt",
    "Row",
    "SingleTurnEnv",
    "StepResult",
    "as_messages",
    "maybe_await",
    "play",
]
