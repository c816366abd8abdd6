"""A run over two hosts through Monarch's own job API, on this one machine: two worker processes on loopback ports
stand in for two hosts (`python -m meshrl.controller.worker`), the controller attaches to them
(`--placement hosts`), the trainer runs on one and the generator and reward process on the other, and weights
cross between them through torchstore. Checked: every process runs under its host's worker, trainer and
generator logprobs agree after every sync, and a run stopped and resumed equals the straight one."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
FLAGS = [
    "--preset", "tiny-reverse", "--warmup.steps", "2", "--warmup.batch-size", "16", "--grpo.steps", "4",
    "--grpo.prompts-per-step", "4", "--generator.engine", "transformers", "--trainer.micro-batch-size", "16",
    "--reverse.num-train", "18", "--reverse.num-eval", "4", "--generator.weight-sync", "torchstore",
    "--run.call-timeout-s", "120", "--run.save-every", "2",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ancestors(pid: int) -> set[int]:
    out = set()
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        out.add(pid)
    return out


def _records(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k != "tokens_per_s"} for r in rows]


@pytest.fixture(scope="module")
def workers():
    procs, addresses = [], []
    for _ in range(2):
        address = f"tcp://127.0.0.1:{_free_port()}"
        cmd = [sys.executable, "-m", "meshrl.controller.worker", "--address", address]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV))
        addresses.append(address)
    for p in procs:
        assert "worker listening on" in p.stdout.readline()
    yield procs, addresses
    for p in procs:
        p.kill()
        p.wait()


def _command(out, name, workers, *extra) -> list[str]:
    _, addresses = workers
    placement = ["--placement", "hosts", "--placement.workers", ",".join(addresses)]
    placement += ["--placement.trainer-host", "0", "--placement.generator-host", "1", "--placement.reward-host", "1"]
    flags = [*FLAGS, *placement, "--run.output-dir", str(out), "--run.name", name, *extra]
    return [sys.executable, "-m", "meshrl.controller.grpo", *flags]


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*args), capture_output=True, text=True, timeout=600, env=ENV)


def test_grpo_over_two_worker_hosts_with_parity_and_exact_resume(tmp_path, workers):
    proc = subprocess.Popen(
        _command(tmp_path, "a", workers), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    host = {"trainer": workers[0][0].pid, "generator": workers[0][1].pid, "reward": workers[0][1].pid}
    seen = []
    for line in proc.stdout:  # while the run lives: each role's processes descend from its host's worker
        seen.append(line)
        if m := re.search(r"(trainer|generator|reward) processes \(pids\): \[([\d, ]+)\]", line):
            role, pids = m.group(1), [int(p) for p in m.group(2).split(",")]
            assert all(host[role] in _ancestors(pid) for pid in pids), (role, pids, host)
        if "placement:" in line:
            assert "trainers on " + workers[1][0] in line and "generators on " + workers[1][1] in line, line
            break
    rest, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, rest[-3000:] + err[-3000:]
    out = "".join(seen) + rest
    assert "weight sync: torchstore" in out and sum("processes (pids)" in line for line in seen) == 3, out[-3000:]
    records = _records(tmp_path / "a")
    rl = [r for r in records if r["phase"] == "rl"]
    # Trainer and generator on different hosts compute the same logprobs after every sync.
    assert len(rl) == 4 and all(r["logprob_diff_max"] < 1e-4 for r in rl), [r["logprob_diff_max"] for r in rl]

    stopped = _run(tmp_path, "b", workers, "--run.stop-at-step", "2")
    assert stopped.returncode == 0 and "stopped at step 2" in stopped.stdout, stopped.stderr[-3000:]
    resumed = _run(tmp_path, "b", workers, "--run.resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"resumed from .*step_00000002 at step 2", resumed.stdout), resumed.stdout[-3000:]
    assert _records(tmp_path / "b") == records  # bitwise, across hosts
