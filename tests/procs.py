"""What the multi-process tests share: the environment for the programs they start, the tiny two-host GRPO job,
and reading the process tree from /proc."""

from __future__ import annotations

import contextlib
import os
import socket
import time

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
TWO_HOST_FLAGS = [
    "--preset", "tiny-reverse", "--warmup.steps", "2", "--warmup.batch-size", "16", "--grpo.steps", "4",
    "--grpo.prompts-per-step", "4", "--generator.engine", "transformers", "--trainer.micro-batch-size", "16",
    "--reverse.num-train", "18", "--reverse.num-eval", "4", "--generator.weight-sync", "torchstore",
    "--run.call-timeout-s", "120", "--run.save-every", "2",
]  # fmt: skip
"""A GRPO job small enough to run over two hosts on this machine in well under a minute."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world: int, *args, timeout_s: float) -> None:
    """`world` spawned processes running `target(rank, *args)` (gloo ranks of a test), joined; each must exit 0."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def ancestors(pid: int) -> set[int]:
    out = set()
    while pid > 1:
        pid = parent(pid)
        out.add(pid)
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                parents[int(entry)] = parent(int(entry))
    below, frontier = [], [pid]
    while frontier:
        frontier = [child for child, p in parents.items() if p in frontier]
        below += frontier
    return below


def gone(pid: int, timeout_s: float) -> bool:
    """Whether `pid` exits within `timeout_s`."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
