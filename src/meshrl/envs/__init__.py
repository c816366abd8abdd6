"""Multi-turn and tool-use environments (meshrl.rollout.environment), run as token-in / token-out episodes.

--env calculator                 arithmetic word problems with a calculator tool (<tool>17*23</tool>)
--env guess_number               guess a secret number from higher / lower feedback (needs several turns)
--env my_pkg.my_mod:MyEnv        your own meshrl.envs.Environment subclass
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshrl.errors import ConfigError
from meshrl.rollout.env_pool import EnvWorkers
from meshrl.rollout.environment import Environment, EpisodeOutcome, StepResult, play

__all__ = ["BUILT_IN", "EnvConfig", "Environment", "EpisodeOutcome", "StepResult", "play", "resolve_env"]

BUILT_IN = {
    "calculator": "meshrl.envs.calculator:CalculatorEnv",
    "guess_number": "meshrl.envs.guess_number:GuessNumberEnv",
}


@dataclass
class EnvConfig:
    """A multi-turn environment: the rollout of each prompt is an episode of up to max_turns model turns."""

    name: str | None = None
    """The environment ('--env NAME' for short): calculator, guess_number, or package.module:Class (an
    meshrl.envs.Environment subclass). None: single-turn RL on the task's rows."""
    max_turns: int = 4
    """Model turns per episode at most; the episode ends there (finish reason max_turns)."""
    max_tokens: int | None = None
    """Tokens per episode at most: the prompt, every model turn and every observation (each turn's own budget is
    generator.max_tokens). Default: generator.max_model_len."""
    timeout_s: float = 30.0
    """Seconds one environment call (construction, reset or step) may take; past it the episode ends with reward
    0 (finish reason env_timeout), counted in the metrics."""
    kwargs: str = ""
    """Keyword arguments of the environment class, as a JSON object, e.g. '{"high": 32}'."""
    batches: int = 1
    """Cohorts the episodes of a step are split into, each sent to the generators on its own: while one cohort's
    environments step, another's generate. 1: every turn of every episode in one generator call. Any value is
    reproducible (the seeds never depend on timing)."""
    workers: int | None = None
    """Environment processes the episodes' environments live in (each episode's in one of them, constructed there
    from its class, imported by name): a step that hangs holding the interpreter (past --env.timeout-s) or crashes
    its process costs that process's episodes (env_timeout / env_error), and the process is replaced; the run goes
    on. None: one per CPU core, between 2 and 8. 0: on the controller's own threads instead (for an environment that
    cannot be imported by name in a fresh process; a hung or crashing step then stops the run)."""
    max_threads: int = 32
    """Threads per environment process (with --env.workers 0: in the controller) for environments whose methods
    are plain (not async) functions: the most plain calls running at once."""
    num_train: int = 2000
    """Training rows of an environment's own dataset (used when no --task / --data is given)."""
    num_eval: int = 200
    """Held-out rows of an environment's own dataset."""
    seed: int = 1234
    """Seed of an environment's own dataset."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"env.max_turns={self.max_turns} must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ConfigError(f"env.max_tokens={self.max_tokens} must be >= 2")
        if not self.timeout_s > 0:
            raise ConfigError(f"env.timeout_s={self.timeout_s} must be > 0")
        if self.workers is not None and self.workers < 0:
            raise ConfigError(
                f"--env.workers {self.workers} must be >= 0 (0: environments on the controller's threads; unset: "
                "one process per CPU core, 2 to 8)"
            )
        if self.batches < 1 or self.max_threads < 1:
            raise ConfigError(f"env.batches={self.batches} and env.max_threads={self.max_threads} must be >= 1")
        if self.num_train < 1 or self.num_eval < 1:
            raise ConfigError(f"env.num_train={self.num_train} and env.num_eval={self.num_eval} must be >= 1")
        self.env_kwargs()  # a bad JSON object fails here, naming the flag

    def env_kwargs(self) -> dict[str, Any]:
        if not self.kwargs:
            return {}
        try:
            value = json.loads(self.kwargs)
        except json.JSONDecodeError as e:
            example = '{"high": 32}'
            raise ConfigError(
                f"--env.kwargs {self.kwargs!r} is not JSON ({e}); give an object, e.g. '{example}'"
            ) from e
        if not isinstance(value, dict):
            raise ConfigError(f"--env.kwargs {self.kwargs!r} must be a JSON object, e.g. '{{\"high\": 32}}'")
        return value

    def num_workers(self) -> int:
        """Environment processes to run (0: none, the controller's threads)."""
        if self.workers is not None:
            return self.workers
        return min(8, max(2, os.cpu_count() or 1))

    def processes(self) -> EnvWorkers | None:
        """The environment processes this config asks for (started at the first episode), or None (threads)."""
        n = self.num_workers()
        if n == 0:
            return None
        cls = resolve_env(self.name)
        return EnvWorkers(
            cls, self.env_kwargs(), n, timeout_s=self.timeout_s, max_threads=self.max_threads, name=self.name
        )

    def factory(self) -> tuple[type[Environment], Callable[[], Environment]]:
        """(the environment class, a function making one environment per episode), checked now: a bad name or bad
        keyword arguments fail before any process starts."""
        cls = resolve_env(self.name)
        kwargs = self.env_kwargs()
        try:
            cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--env {self.name} with --env.kwargs {self.kwargs or '{}'}: {e}") from e
        return cls, lambda: cls(**kwargs)


def resolve_env(name: str | None) -> type[Environment]:
    """An environment class from a built-in name or `package.module:Class`."""
    if not name:
        raise ConfigError("no environment named; use --env calculator, guess_number or package.module:Class")
    spec = BUILT_IN.get(name, name)
    if ":" not in spec:
        raise ConfigError(
            f"--env {name!r} is unknown; use one of {', '.join(BUILT_IN)}, or package.module:Class (an "
            "meshrl.envs.Environment subclass)"
        )
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--env {name}: cannot import {spec} ({type(e).__name__}: {e})") from e
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"--env {name}: {spec} is not a meshrl.envs.Environment subclass")
    return cls
