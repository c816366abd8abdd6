"""An environment's own dataset as a task (used when a run names --env but no --task / --data)."""

from __future__ import annotations

import inspect

from meshrl.envs import EnvConfig
from meshrl.rollout.environment import play
from meshrl.tasks.base import Task

# Demonstrations played to collect the texts a new model's tokenizer learns from (its chat roles included).
CORPUS_EPISODES = 500


def build_env_task(cfg: EnvConfig, *, corpus: bool = True) -> Task:
    """The environment's own rows as a task. `corpus`: also play demonstrations for a new model's tokenizer (only
    when the run makes one: a user's environment may call a service on every step)."""
    cls, make = cfg.factory()
    # The environment's keyword arguments its `rows` also takes (e.g. guess_number's range `high`).
    accepted = inspect.signature(cls.rows).parameters
    kwargs = {k: v for k, v in cfg.env_kwargs().items() if k in accepted}
    try:
        train = cls.rows("train", cfg.num_train, cfg.seed, **kwargs)
        held_out = cls.rows("eval", cfg.num_eval, cfg.seed, **kwargs)
    except NotImplementedError as e:
        from meshrl.errors import ConfigError

        raise ConfigError(f"--env {cfg.name}: {e}") from e
    texts: list[str] = []
    for row in train[:CORPUS_EPISODES] if corpus else []:
        env = make()
        demo = env.demonstration(row)
        if not demo:
            continue
        played = play(env, row, demo, max_turns=cfg.max_turns)
        texts += [f"{m['role']}\n{m['content']}" for m in played["messages"]]
    return Task(f"env:{cfg.name}", train, held_out, reward="", verifier="env", corpus=texts)
