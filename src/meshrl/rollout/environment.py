"""The environment seam: multi-turn and tool-use episodes.

An `Environment` is one episode's state. It is reset from a task `Row` (the same rows single-turn tasks use), then
receives the model's message each turn and answers with a `StepResult`: the next observation (messages the chat
template renders: a tool result, the game's feedback), a reward for the turn, and whether the episode is over.

    class Countdown(Environment):
        def reset(self, row, seed):             # -> the opening messages (None: the row's prompt)
            self.target = int(row.answer)
            return None
        def step(self, message):                # the model's text for this turn
            if message.strip() == str(self.target):
                return StepResult(reward=1.0, done=True, correct=True)
            return StepResult([{"role": "user", "content": "no, try again"}])

Both methods may be `async def` (an environment that calls a sandbox or a service awaits it; many episodes run
concurrently) or plain functions (run in a thread, so a slow one never blocks the others). Environments live in
environment processes (`--env.workers`, meshrl.rollout.env_pool), constructed there from their class by name. An
environment that raises or outlives `EnvConfig.timeout_s` ends its episode with reward 0, counted in the step's
metrics; one that holds its process's interpreter or crashes it costs that process's episodes, and the process is
replaced; the run goes on.

Environments never see token ids: the controller renders their messages with the model's chat template and keeps
the episode token-in / token-out (meshrl.rollout.episode). No Monarch imports here.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from meshrl.rollout.row import Message, Row


@dataclass
class StepResult:
    """What an environment answers to one model message."""

    observation: Sequence[Message] | str | None = None
    """Messages appended after the model's message (a str is one user message); ignored when `done`."""
    reward: float = 0.0
    """This turn's reward. An episode's reward is the sum of its turns' rewards (+ the optional group rewards)."""
    done: bool = False
    correct: bool | None = None
    """The verdict on the episode, given on its last step (held-out accuracy counts it). None: correct means an
    episode reward >= 1."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Counts summed over the episode and averaged per episode in the step's metrics, e.g. {"tool_calls": 1}."""


class Environment:
    """One episode of a multi-turn task; subclass it (see the module docstring). Constructed with no arguments
    other than `EnvConfig.kwargs` (a JSON object on the command line), once per episode."""

    default_reward_name: ClassVar[str] = "env"

    def reset(self, row: Row, seed: int) -> Sequence[Message] | str | None:
        """Start an episode from `row`; `seed` is the episode's own (derived from the run's seed: reproducible).
        Returns the opening messages (a str: one user message; None: the row's prompt)."""
        return None

    def step(self, message: str) -> StepResult:
        """The model's message for this turn (its text, stop token removed) -> the environment's answer."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(message) -> StepResult")

    @classmethod
    def rows(cls, split: str, size: int, seed: int) -> list[Row | dict]:
        """The environment's own dataset, used when the run names no --task / --data.train: `size` rows of `split`
        ('train' or 'eval'; --env.num-train / --env.num-eval) made from `seed` (--env.seed). A classmethod (no
        environment exists yet); keyword arguments of the environment (--env.kwargs) that it also names are passed
        to it. Returns `Row`s, or dicts read as a data file's rows: 'prompt' (text) or 'messages' (chat), an
        optional 'answer', other fields into `Row.info`. Checked at launch (meshrl.envs.tasks.env_rows).
        Environments that need rows from a dataset leave this as is.

            @classmethod
            def rows(cls, split, size, seed):
                rng = random.Random(f"{split}-{seed}")
                return [{"prompt": f"Count to {n}.", "answer": n} for n in (rng.randint(1, 9) for _ in range(size))]
        """
        raise NotImplementedError(f"{cls.__name__} has no built-in rows; give them with --data.train / --task")

    def demonstration(self, row: Row) -> list[str] | None:
        """What a good policy says, turn by turn, on `row` (the supervised warm-up trains on these messages, the
        environment's own answers filling the turns between); a function of the row alone. None: no demonstration
        for this row."""
        return None

    @classmethod
    def group_rewards(cls, episodes: Sequence[EpisodeOutcome]) -> Sequence[float] | None:
        """Optional group-level scoring: given the G episodes of one prompt, extra rewards added to each (e.g. a
        bonus for the shortest correct one). None: none."""
        return None


@dataclass
class EpisodeOutcome:
    """An episode as its environment and the advantage functions see it (text, not tokens)."""

    row: Row
    messages: list[dict[str, Any]]  # the whole conversation, the model's messages as the model wrote them
    turn_rewards: list[float]  # one per model turn
    reward: float  # the sum of turn_rewards, plus group rewards; 0 after a failure
    correct: bool
    num_turns: int
    finish_reason: str  # "done" | "max_turns" | "max_tokens" | "env_error" | "env_timeout"
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)  # the rubric's functions' values (in `reward`)
    reward_failures: dict[str, str] = field(default_factory=dict)  # rubric function -> "timeout" / "error: ...": 0


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def as_messages(observation: Sequence[Message] | str | None) -> list[dict[str, Any]]:
    """An environment's observation as a list of message dicts (a str is one user message)."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    out = []
    for m in observation:
        if not isinstance(m, dict | Mapping) or "role" not in m or "content" not in m:
            raise TypeError(f"an observation message must be a dict with 'role' and 'content', got {m!r}")
        out.append(dict(m))
    return out


def play(env: Environment, row: Row, policy: Sequence[str] | Any, *, seed: int = 0, max_turns: int = 8) -> dict:
    """Run one episode on text, without a model: `policy` is the list of the model's messages, or a function
    (conversation so far -> next message). For tests and demonstrations; returns {"messages", "turn_rewards",
    "done", "correct", "metrics"}."""
    import asyncio

    async def run() -> dict:
        opening = await maybe_await(env.reset(row, seed))
        messages = as_messages(row.prompt) if opening is None else as_messages(opening)
        rewards: list[float] = []
        metrics: dict[str, float] = {}
        done, correct = False, None
        for turn in range(max_turns):
            if callable(policy):
                text = policy(messages)
            elif turn < len(policy):
                text = policy[turn]
            else:
                break
            messages.append({"role": "assistant", "content": text})
            result = await maybe_await(env.step(text))
            rewards.append(float(result.reward))
            for k, v in result.metrics.items():
                metrics[k] = metrics.get(k, 0.0) + float(v)
            if result.done:
                done, correct = True, result.correct
                break
            messages += as_messages(result.observation)
        if correct is None:
            correct = sum(rewards) >= 1.0
        return {"messages": messages, "turn_rewards": rewards, "done": done, "correct": correct, "metrics": metrics}

    return asyncio.run(run())
