"""An environment's own dataset as a task (used when a run names --env but no --task / --data)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from meshrl.envs import EnvConfig
from meshrl.errors import ConfigError
from meshrl.rollout.env_pool import START_TIMEOUT_S, EnvWorkers
from meshrl.rollout.environment import Environment, as_messages, play
from meshrl.rollout.row import Row
from meshrl.tasks.base import Task

# Demonstrations played to collect the texts a new model's tokenizer learns from (its chat roles included).
CORPUS_EPISODES = 500

_HOOK = "@classmethod def rows(cls, split, size, seed) -> list of Row or dicts (see docs/environments.md)"


def build_env_task(cfg: EnvConfig, *, corpus: bool = True) -> Task:
    """The environment's own rows as a task. `corpus`: also play demonstrations for a new model's tokenizer (only
    when the run makes one: a user's environment may call a service on every step)."""
    cls, make = cfg.factory()
    train = env_rows(cls, "train", cfg.num_train, cfg.seed, cfg.env_kwargs(), name=cfg.name)
    held_out = env_rows(cls, "eval", cfg.num_eval, cfg.seed, cfg.env_kwargs(), name=cfg.name)
    texts: list[str] = []
    corpus = corpus and cls.demonstration is not Environment.demonstration  # no demonstrations: nothing to play
    envs = cfg.processes() if corpus else None
    try:
        for row in train[:CORPUS_EPISODES] if corpus else []:
            messages = _demonstrated(envs, row, cfg) if envs is not None else _demonstrated_here(make(), row, cfg)
            texts += [f"{m['role']}\n{m['content']}" for m in messages or []]
    finally:
        if envs is not None:
            envs.close()
    return Task(f"env:{cfg.name}", train, held_out, reward="", verifier="env", corpus=texts)


def _demonstrated_here(env: Environment, row: Row, cfg: EnvConfig) -> list[dict] | None:
    demo = env.demonstration(row)
    return play(env, row, demo, max_turns=cfg.max_turns)["messages"] if demo else None


def _demonstrated(envs: EnvWorkers, row: Row, cfg: EnvConfig) -> list[dict] | None:
    """`play` of the row's demonstration in an environment process, each call under --env.timeout-s: a call that
    fails, hangs or kills its process leaves this row out of the corpus (the process is replaced), never stops the
    launch."""
    env = envs.open().result(timeout=START_TIMEOUT_S)

    def call(method: str, *args: Any) -> Any:
        try:
            return envs.call(env, method, *args).result(timeout=cfg.timeout_s)
        except TimeoutError:
            envs.timed_out(env, method)
            raise

    try:
        call("__init__")
        demo = call("demonstration", row)
        if not demo:
            return None
        opening = call("reset", row, 0)
        messages = as_messages(row.prompt) if opening is None else as_messages(opening)
        for text in demo[: cfg.max_turns]:
            messages.append({"role": "assistant", "content": text})
            result = call("step", text)
            if result.done:
                break
            messages += as_messages(result.observation)
        return messages
    except Exception:  # noqa: BLE001 - the episode rules: the environment's failure costs this row only
        return None
    finally:
        envs.release(env)


def env_rows(
    cls: type[Environment], split: str, size: int, seed: int, env_kwargs: Mapping, *, name: str | None = None
) -> list[Row]:
    """`cls.rows(split, size, seed, **the env kwargs it names)` as `Row`s (dicts read as a data file's rows), or a
    ConfigError naming the class and what to change: an instance method, a signature that does not take the three
    arguments, a return that is not a non-empty list of rows, a dict that is not a row."""
    from meshrl.data.prompts import as_row
    from meshrl.data.rows import BadRowError

    flag = f"--env {name or cls.__name__}"
    hook = f"{cls.__name__}.rows"
    call = f"{hook}({split!r}, {size}, {seed})"
    if not isinstance(inspect.getattr_static(cls, "rows"), classmethod | staticmethod):
        # Called on the class, an instance method takes `split` for `self` and misses `seed`.
        raise ConfigError(
            f"{flag}: {hook} is an instance method, but it is called on the class (no environment exists yet when "
            f"the dataset is made); declare it {_HOOK}"
        )
    params = inspect.signature(cls.rows).parameters
    # The environment's keyword arguments its `rows` also takes (e.g. guess_number's range `high`).
    kwargs = {k: v for k, v in env_kwargs.items() if k in params}
    try:
        inspect.signature(cls.rows).bind(split, size, seed, **kwargs)
    except TypeError as e:
        raise ConfigError(
            f"{flag}: {hook}{inspect.signature(cls.rows)} cannot be called as rows({split!r}, {size}, {seed}) ({e}); "
            f"declare it {_HOOK}"
        ) from None
    try:
        values = cls.rows(split, size, seed, **kwargs)
    except NotImplementedError as e:
        raise ConfigError(f"{flag}: {e}") from e
    if not isinstance(values, Sequence) or isinstance(values, str | bytes):
        raise ConfigError(f"{flag}: {call} returned {type(values).__name__}, not a list of rows; declare it {_HOOK}")
    if not values:
        raise ConfigError(f"{flag}: {call} returned no rows; it must return `size` rows ({_HOOK})")
    rows = []
    for i, value in enumerate(values, start=1):
        if not isinstance(value, Row | Mapping):
            raise ConfigError(
                f"{flag}: {call}, row {i}: a {type(value).__name__}, expected a meshrl Row or a dict; {_HOOK}"
            )
        try:
            rows.append(as_row(value))
        except BadRowError as e:
            raise ConfigError(
                f"{flag}: {call}, row {i}: {e}; a dict row is read as a data file's row: 'prompt' (text) or "
                f"'messages' (chat), an optional 'answer', other fields into Row.info ({_HOOK})"
            ) from None
    return rows
