"""Built-in verifiable tasks: prompts, demonstrations, a tokenizer and reward functions."""

from meshrl.tasks.base import Example, Task
from meshrl.tasks.reverse import build_reverse_task


def build_task(cfg) -> Task:  # cfg: meshrl.config.TaskConfig
    if cfg.name == "reverse":
        return build_reverse_task(cfg)
    raise ValueError(f"unknown task {cfg.name!r}; built-in tasks: 'reverse'")


__all__ = ["Example", "Task", "build_task"]
