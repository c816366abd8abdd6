"""RL tasks behind one seam (meshrl.tasks.base): rows in, scores out.

--task reverse                    the built-in string reversal (a tiny model learns it on a CPU)
--task arithmetic                 built-in procedural arithmetic, scored by math-verify
--task shapes                     built-in questions about drawn shapes, for vision-language models
--task data                       prompt rows from --data.train / --data.eval files, or Python lists
--task reasoning_gym:countdown    a procedural reasoning-gym task, scored by its own verifier
--task my_pkg.my_mod:make_task    your own: a function returning a meshrl.tasks.Task
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Sequence
from typing import Any

from meshrl.errors import ConfigError
from meshrl.tasks.base import Row, Task

BUILT_IN = ("reverse", "arithmetic", "shapes", "data", "reasoning_gym:NAME")


def task_name(cfg: Any) -> str:
    """The task a run config names: `cfg.task`, or 'data' when data files are given, else 'reverse'."""
    if cfg.task is not None:
        return cfg.task
    return "data" if getattr(cfg, "data", None) is not None and cfg.data.train is not None else "reverse"


def build_task(cfg: Any, *, train_rows: Sequence[Any] | None = None, eval_rows: Sequence[Any] | None = None) -> Task:
    """The run's task. `cfg` is a run config (GRPORunConfig / SFTRunConfig / EvalRunConfig): its `task` names the
    task and its `reverse` / `arithmetic` / `shapes` / `reasoning_gym` / `data` sections configure it. `train_rows` /
    `eval_rows` (Python lists of row dicts or `Row`s) stand in for --data.train / --data.eval."""
    env = getattr(cfg, "env", None)
    if env is not None and env.name and cfg.task is None and train_rows is None and cfg.data.train is None:
        from meshrl.envs.tasks import build_env_task

        return build_env_task(env, corpus=cfg.model.path is None)  # a new model's tokenizer learns from it
    name = "data" if train_rows is not None and cfg.task is None else task_name(cfg)
    if name == "reverse":
        from meshrl.tasks.reverse import build_reverse_task

        return build_reverse_task(cfg.reverse)
    if name == "arithmetic":
        from meshrl.tasks.arithmetic import build_arithmetic_task

        return build_arithmetic_task(cfg.arithmetic)
    if name == "shapes":
        from meshrl.tasks.shapes import build_shapes_task

        return build_shapes_task(cfg.shapes)
    if name.startswith("reasoning_gym:"):
        from meshrl.tasks.reasoning_gym import build_reasoning_gym_task

        return build_reasoning_gym_task(name.split(":", 1)[1], cfg.reasoning_gym)
    if name == "data":
        from meshrl.data.roles import accepted_roles

        roles = accepted_roles(cfg.model.path)  # the chat roles the model's template knows
        return build_data_task(cfg.data, train_rows=train_rows, eval_rows=eval_rows, roles=roles)
    if ":" in name:
        return _user_task(name)
    raise ConfigError(f"--task {name!r} is unknown; use one of {', '.join(BUILT_IN)}, or package.module:function")


def build_data_task(
    data: Any,
    *,
    train_rows: Sequence[Any] | None,
    eval_rows: Sequence[Any] | None,
    roles: Collection[str] | None = None,
) -> Task:
    """Prompt rows from files (--data.train / --data.eval) or Python lists, judged by the run's reward spec. `roles`:
    the chat roles their messages may have (default: meshrl.data.roles.CHAT_ROLES)."""
    from meshrl.data.prompts import load_prompt_rows
    from meshrl.data.roles import CHAT_ROLES

    def load(source: Any, what: str, limit: int | None = None) -> tuple[list[Row], dict[str, int]]:
        if not isinstance(source, str) and source and all(isinstance(r, Row) for r in source):
            return list(source)[:limit], {}
        # Stops reading once `limit` rows are usable.
        loaded = load_prompt_rows(source, data, limit=limit, roles=CHAT_ROLES if roles is None else roles)
        return loaded.rows, {f"{what}: {k}": v for k, v in loaded.skipped.items()}

    train_source = train_rows if train_rows is not None else data.train
    if train_source is None:
        raise ConfigError("--task data needs prompt rows: --data.train FILE (JSONL, Parquet, a datasets dir)")
    eval_source = eval_rows if eval_rows is not None else data.eval
    if eval_source is None:
        raise ConfigError(
            "--task data needs held-out rows to evaluate on: --data.eval FILE (evaluation is how a run is judged)"
        )
    train, skipped = load(train_source, "train")
    held_out, eval_skipped = load(eval_source, "eval", data.max_eval_rows)
    # Rewards default to math-verify: the common case (GSM8K / MATH-style answers); --reward names others.
    return Task("data", train, held_out, reward="math_verify=1.0", verifier="", skipped={**skipped, **eval_skipped})


def _user_task(spec: str) -> Task:
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"--task {spec}: cannot import it ({e}); name a function returning a meshrl.tasks.Task as "
            "package.module:function, with its directory on PYTHONPATH"
        ) from None
    task = fn()
    if not isinstance(task, Task):
        raise ConfigError(f"--task {spec} returned {type(task).__name__}, not a meshrl.tasks.Task")
    return task


__all__ = ["Row", "Task", "build_data_task", "build_task", "task_name"]
