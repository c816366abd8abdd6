"""A run over two hosts through Monarch's own job API, on this one machine: two worker processes on loopback ports
stand in for two hosts (`python -m meshrl.controller.worker`), the controller attaches to them
(`--placement hosts`), the trainer runs on one and the generator and reward process on the other, and weights
cross between them through torchstore. Checked: every process runs under its host's worker, trainer and
generator logprobs agree after every sync, a run stopped and resumed equals the straight one, and a run whose
generator host dies (the worker and every process on it SIGKILLed) ends promptly with the resume command, which
finishes the run on fresh workers with the straight run's records."""

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from procs import ENV, TWO_HOST_FLAGS, ancestors, descendants, free_port


def _records(run_dir):
    """metrics.jsonl without the measurements that differ from run to run: wall-clock times and memory readings."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    drop = ("time_", "tokens_per_s", "memory/")
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


@contextlib.contextmanager
def _workers(n: int = 2):
    """`n` Monarch workers on loopback ports: `n` hosts, as far as the controller can tell."""
    procs, addresses = [], []
    try:
        for _ in range(n):
            address = f"tcp://127.0.0.1:{free_port()}"
            cmd = [sys.executable, "-m", "meshrl.controller.worker", "--address", address]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV))
            addresses.append(address)
        for p in procs:
            assert "worker listening on" in p.stdout.readline()
        yield procs, addresses
    finally:
        for p in procs:
            for pid in [p.pid, *descendants(p.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def workers():
    with _workers(2) as w:
        yield w


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("multihost")


def _command(out, name, addresses, *extra) -> list[str]:
    placement = ["--placement", "hosts", "--placement.workers", ",".join(addresses)]
    placement += ["--placement.trainer-host", "0", "--placement.generator-host", "1", "--placement.reward-host", "1"]
    # One trainer rank: what crosses hosts is the point here (several ranks over hosts: test_placement_jobs).
    flags = [*TWO_HOST_FLAGS, "--trainer.num-procs", "1", *placement, "--run.output-dir", str(out), "--run.name", name]
    flags += extra
    return [sys.executable, "-m", "meshrl.controller.grpo", *flags]


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*args), capture_output=True, text=True, timeout=600, env=ENV)


@pytest.fixture(scope="module")
def straight(out, workers):
    """The run over the two workers, start to end; checked while it lives: each role's processes descend from its
    host's worker."""
    procs, addresses = workers
    proc = subprocess.Popen(
        _command(out, "a", addresses), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    host = {"trainer": procs[0].pid, "generator": procs[1].pid, "reward": procs[1].pid}
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if m := re.search(r"(trainer|generator|reward) processes \(pids\): \[([\d, ]+)\]", line):
            role, pids = m.group(1), [int(p) for p in m.group(2).split(",")]
            assert all(host[role] in ancestors(pid) for pid in pids), (role, pids, host)
        if "placement:" in line:
            assert "trainers on " + addresses[0] in line and "generators on " + addresses[1] in line, line
            break
    rest, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, rest[-3000:] + err[-3000:]
    output = "".join(seen) + rest
    assert "weight sync: torchstore" in output and sum("processes (pids)" in line for line in seen) == 3, output
    return _records(out / "a")


def test_grpo_over_two_worker_hosts_with_parity(straight):
    """Exact resume across hosts is checked by the next test, whose run is resumed on fresh workers."""
    rl = [r for r in straight if r["phase"] == "rl"]
    # Trainer and generator on different hosts compute the same logprobs after every sync.
    assert len(rl) == 4 and all(r["logprob_diff_max"] < 1e-4 for r in rl), [r["logprob_diff_max"] for r in rl]


def test_a_killed_worker_host_ends_the_run_with_the_resume_command_which_finishes_it(out, straight, workers):
    """The generator's host dies mid-run: its worker and every process on it (generator, reward) SIGKILLed. The
    generator is found dead within the heartbeat, its replacement is asked of the same host, which starts nothing
    within --placement.spawn-timeout-s: the run ends (no hang) naming the lost host and role, with the resume
    command. That command, pointed at two live workers (the trainer's host, which served the run, and another),
    finishes the run with the straight run's records. (Steps take a fraction of a second: the controller is paused
    while the host is killed, so that it dies mid-run.) The trainer's host and the resume's are the module's
    workers, which the straight run has finished with: three worker processes fewer to start."""
    live = workers[1]
    with _workers(1) as ([doomed], [doomed_address]):
        addresses = [live[0], doomed_address]  # the trainer's host lives on; the generator's dies
        cmd = _command(out, "k", addresses, "--run.heartbeat-s", "5", "--placement.spawn-timeout-s", "10")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            checkpoint, deadline = out / "k" / "checkpoints" / "step_00000002", time.time() + 300
            while not checkpoint.exists() and time.time() < deadline and proc.poll() is None:
                time.sleep(0.01)
            assert checkpoint.exists(), "the run wrote no checkpoint at step 2"
            os.kill(proc.pid, signal.SIGSTOP)
            try:  # the host dies: its worker and everything on it
                for pid in [doomed.pid, *descendants(doomed.pid)]:
                    os.kill(pid, signal.SIGKILL)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            killed_at = time.time()
            _, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
        ended_after = time.time() - killed_at
    assert proc.returncode != 0, err[-3000:]
    lost = re.escape(addresses[1])
    assert re.search(rf"run failed \(an actor process died\): the generator host {lost} is lost", err), err[-3000:]
    assert "last good checkpoint: " in err and str(out / "k" / "checkpoints" / "step_") in err, err[-3000:]
    print(f"the run ended {ended_after:.1f}s after its generator host was killed")
    assert ended_after < 90, ended_after  # heartbeat (5 s) + spawn timeout (10 s) + shutdown, not call timeouts

    command = shlex.split(re.search(r"resume with: (.*)", err).group(1))
    assert command[:3] == [sys.executable, "-m", "meshrl.controller.grpo"] and "--placement.workers" in command
    assert command[command.index("--placement.workers") + 1] == ",".join(addresses)
    command[command.index("--placement.workers") + 1] = ",".join(live)  # the run's hosts now: two live ones
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert re.search(r"resumed from .*step_0000000[24] at step [24]", resumed.stdout), resumed.stdout[-3000:]
    assert _records(out / "k") == straight


def test_a_host_lost_while_the_run_starts_ends_it_with_the_resume_hint(out):
    """The trainer's host is not there at all (nothing listens at its address): the run ends within
    --placement.spawn-timeout-s naming the host, with the resume hint, and no traceback."""
    cmd = _command(out, "gone", [f"tcp://127.0.0.1:{free_port()}"] * 2, "--placement.spawn-timeout-s", "3")
    ended = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert ended.returncode != 0
    assert re.search(r"run failed \(an actor process died\): the trainer host tcp://\S+ is lost", ended.stderr), (
        ended.stderr[-3000:]
    )
    assert "resume with: " in ended.stderr and "Traceback" not in ended.stderr, ended.stderr[-3000:]
