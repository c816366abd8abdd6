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
    default_preset: str = "default",
) -> T:
    """tyro over `cls`, starting from `--preset NAME` (the last one given wins; default: `default_preset`, the
    dataclasses' own defaults). `--help` lists the presets."""
    if presets is None:
        from meshrl.configs import presets_for

        presets = presets_for(cls)

    args = _env_shorthand(list(sys.argv[1:] if argv is None else argv), cls)
    preset = default_preset
    while "--preset" in args:
        i = args.index("--preset")
        if i + 1 >= len(args):
            sys.exit(f"--preset needs a name: {sorted(presets)}")
        preset = args[i + 1]
        del args[i : i + 2]
    if preset not in presets:
        sys.exit(f"unknown preset {preset!r}; presets: {sorted(presets)}")
    listing = "\n".join(f"  {name}: {_first_line(fn)}" for name, fn in presets.items())
    try:
        return tyro.cli(
            cls,
            default=presets[preset](),
            args=args,
            description=f"{description or ''}\nPresets (--preset NAME; flags after it override it):\n{listing}\n\n"
            f"Starting from preset {preset!r}.",
        )
    except ConfigError as e:
        sys.exit(f"config error: {e}")


# `--NAME VALUE` is `--NAME.FIELD VALUE` for these sections (their other fields keep their dotted flags).
_SHORTHANDS = {"env": "name", "placement": "kind"}


def _env_shorthand(args: list[str], cls: type) -> list[str]:
    """`--env NAME` is `--env.name NAME`, `--placement hosts` is `--placement.kind hosts`."""
    fields = getattr(cls, "__dataclass_fields__", {})
    out = []
    for i, a in enumerate(args):
        section = a.removeprefix("--").split("=", 1)[0]
        if a.startswith("--") and section in _SHORTHANDS and section in fields:
            flag = f"--{section}.{_SHORTHANDS[section]}"
            if "=" in a:
                out += [flag, a.split("=", 1)[1]]
                continue
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                out.append(flag)
                continue
        out.append(a)
    return out


def _first_line(fn: object) -> str:
    doc = (getattr(fn, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""


def stop_on_sigterm() -> None:
    """A scheduler's SIGTERM (preemption, `kill`) ends the run as Ctrl-C does — actor processes stopped, shared
    weight files removed, the last checkpoint and the resume command printed — instead of Python's default of
    dying on the spot and leaving them behind."""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
