"""A full /dev/shm through the real CLI (issue 31 item 12): the run used to die at its first weight push with
`push_weights failed because an actor process died: ... Killed(sig=7)` (a SIGBUS: tmpfs could not give a page of the
shared weight buffer). Now it ends at launch, before any training, saying how much is free, how much the weights
need and what to do. The small /dev/shm is a real 1 MiB tmpfs in a private mount namespace (`unshare -rm`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from procs import ENV


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_one_megabyte_shm_ends_the_run_at_launch_saying_what_to_do(tmp_path):
    if not _unshare_works():
        pytest.skip("needs a private mount namespace (unshare -rm) to give /dev/shm 1 MiB")
    flags = [
        "--preset", "tiny-reverse",  # weight_sync='shm': a CPU trainer's buffer of 2 x 1.1 MiB in /dev/shm
        "--generator.engine", "transformers",
        "--warmup.steps", "2", "--warmup.batch-size", "64", "--grpo.steps", "2",
        "--run.output-dir", str(tmp_path), "--run.name", "shm",
    ]  # fmt: skip
    script = 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" -m meshrl.controller.grpo "$@"'
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, *flags],
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert out.returncode != 0, out.stdout[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: generator.weight_sync='shm': /dev/shm has "), out.stderr[-3000:]
    assert "free, the weights need 2.3 MiB (2 slot(s) of 1.1 MiB, and 1.0 MiB kept free)" in last, last
    assert last.endswith("enlarge it (--shm-size for containers) or use --generator.weight-sync torchstore"), last
    assert "sig=7" not in out.stderr and "GRPO" not in out.stderr  # ended at launch: no RL step ran
