"""tyro over the run-config dataclasses, starting from a named preset (`--preset NAME`)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any, TypeVar

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
    args = _colocate_when_ranks_fill_the_gpus(args)
    listing = "\n".join(f"  {name}: {_first_line(fn)}" for name, fn in presets.items())
    try:
        cfg = tyro.cli(
            cls,
            default=presets[preset](),
            args=args,
            description=f"{description or ''}\nPresets (--preset NAME; flags after it override it):\n{listing}\n\n"
            f"Starting from preset {preset!r}.",
        )
        return _gpu_defaults(cfg, args, presets[preset], cls)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


def _flag_value(args: list[str], flag: str) -> str | None:
    """The last value given for `flag` (as `--flag V` or `--flag=V`), or None."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _colocate_when_ranks_fill_the_gpus(args: list[str]) -> list[str]:
    """`--placement.gpus N --trainer.num-procs N` asks for a trainer rank on every GPU: the colocated layout. The
    config cannot tell a given `--trainer.num-procs 2` from the CPU default 2 (it would lay 2 GPUs out split), so
    the flags say it here, unless --placement.layout is given."""
    gpus, ranks = _flag_value(args, "--placement.gpus"), _flag_value(args, "--trainer.num-procs")
    if gpus is not None and gpus == ranks and _flag_value(args, "--placement.layout") is None:
        return [*args, "--placement.layout", "colocated"]
    return args


def _gpu_defaults(cfg: T, args: list[str], preset: Callable[[], T], cls: type[T]) -> T:
    """--run.gpu-defaults (meshrl.gpu_defaults): on a machine with GPUs, what the flags and the preset left open
    resolved for them, each setting printed. Here and not in the configs' __post_init__: it needs the flags given,
    and a config built in Python stays as written."""
    from meshrl.gpu_defaults import detect_machine, given_fields, resolve_gpu_defaults, visible_gpus

    if not visible_gpus():  # a CPU machine: the config as tyro made it, and nothing more done
        return cfg
    given = given_fields(args, preset_cfg=preset(), default_cfg=cls())
    cfg, lines = resolve_gpu_defaults(cfg, given, detect_machine(cfg, given))
    for line in lines:
        print(f"[meshrl] gpu defaults: {line}", flush=True)
    return cfg


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


class _StepBoundary:
    """Whether a training loop will look for a stop request at its next step boundary (RunCheckpoints.after_step
    turns this on after a run's first step and off after its last), and the SIGTERM that asked for it."""

    def __init__(self) -> None:
        self.deferring = False
        self.requested: str | None = None


STEP_BOUNDARY = _StepBoundary()


def stop_on_sigterm() -> None:
    """A scheduler's SIGTERM (preemption, `kill`) ends the run as Ctrl-C does — actor processes stopped, shared
    weight files removed, the last checkpoint and the resume command printed — instead of Python's default of
    dying on the spot and leaving them behind. Between a training run's steps (after the first, before the end of
    the last) the step being taken is finished first and checkpointed (RunCheckpoints.after_step), so no step is
    lost; a second SIGTERM, or Ctrl-C, stops at once."""

    def interrupt(signum: int, _frame: object) -> None:
        if STEP_BOUNDARY.deferring and STEP_BOUNDARY.requested is None:
            STEP_BOUNDARY.requested = signal.Signals(signum).name
            # os.write, not print: a handler may run while the main thread is inside a print
            os.write(
                2,
                b"[meshrl] SIGTERM: finishing the current step, then saving a checkpoint of it and stopping "
                b"(send SIGTERM again to stop at once, from the last checkpoint)\n",
            )
            return
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    quiet_monarch_exit_timeout()


def quiet_monarch_exit_timeout() -> None:
    """Monarch shuts its client down at interpreter exit with a 1 s limit; after a host was lost, or on a loaded
    machine, that wait can run out, and Python printed its TimeoutError as a traceback under the run's own last
    words ("Exception ignored in atexit callback"). Said in one line instead; any other unraisable error as before."""
    default = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        where = getattr(unraisable.object, "__module__", "") or ""
        if unraisable.exc_type is TimeoutError and "atexit" in (unraisable.err_msg or "") and "monarch" in where:
            print("[meshrl] Monarch's shutdown did not finish within its 1 s at exit (a host gone, or a busy "
                  "machine); exiting anyway", file=sys.stderr)  # fmt: skip
            return
        default(unraisable)

    sys.unraisablehook = hook
