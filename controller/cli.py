"""tyro over the run-config dataclasses, starting from a named preset (`--preset NAME`)."""

from __future__ import annotations

import signal
import sys
from typing import TypeVar

import tyro

from meshrl.config import ConfigError

T = TypeVar("T")


def parse_run_config(
    cls: type[T],
    *,
    description: str | None = None,
    argv: list[str] | None = None,
    presets: dict | None = None,
    default_preset: str = "tiny-reverse",
) -> T:
    if presets is None:
        from meshrl.configs import PRESETS as presets

    args = list(sys.argv[1:] if argv is None else argv)
    preset = default_preset
    if "--preset" in args:
        i = args.index("--preset")
        if i + 1 >= len(args):
            sys.exit(f"--preset needs a name: {sorted(presets)}")
        preset = args[i + 1]
        del args[i : i + 2]
    if preset not in presets:
        sys.exit(f"unknown preset {preset!r}; presets: {sorted(presets)}")
    try:
        return tyro.cli(
            cls,
            default=presets[preset](),
            args=args,
            description=f"{description or ''}\nStarting from preset {preset!r}.",
        )
    except ConfigError as e:
        sys.exit(f"config error: {e}")


def stop_on_sigterm() -> None:
    """A scheduler's SIGTERM (preemption, `kill`) ends the run as Ctrl-C does — actor processes stopped, shared
    weight files removed, the last checkpoint and the resume command printed — instead of Python's default of
    dying on the spot and leaving them behind."""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
