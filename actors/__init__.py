"""Monarch actors. Thin: each endpoint validates its input, calls library code, returns plain data.

The classes are imported on first use: a process hosting two actors (a generator and its heartbeat) imports
their modules from two threads at once, and a package that imported every actor eagerly would make the two
imports wait on each other (Python's import locks then raise a deadlock error in one of them)."""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "Generator": "generator",
    "PolicyTrainer": "policy_trainer",
    "ReferenceModel": "reference",
    "RewardActor": "reward",
    "Heartbeat": "heartbeat",
}
__all__ = list(_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
