"""Actor processes forked from a warm process (meshrl.proc_zygote, MESHRL_PROC_ZYGOTE=1; the test suite runs with
it, tests/conftest.py): the process Monarch starts (the client) ends as its forked child ends, passes its
environment, directory and streams on, forwards signals, and takes its child with it when it is killed; and an
actor mesh started that way runs actors in the zygote's children."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from meshrl import proc_zygote

HERE = os.path.dirname(os.path.abspath(__file__))


def _client(tmp_path, *args: str) -> subprocess.Popen:
    program, argv = proc_zygote.bootstrap_args(["-m", "zygote_child", *args])
    env = {**os.environ, "ZYGOTE_TEST": "passed on", "PYTHONPATH": HERE}
    return subprocess.Popen([program, *argv], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("code", [0, 3])
def test_the_client_ends_as_its_child_ends_with_its_environment_and_directory(tmp_path, code):
    client = _client(tmp_path, str(code))
    pid, ppid, value, cwd = client.stdout.readline().split(maxsplit=3)
    assert client.wait(timeout=60) == code
    assert int(ppid) == proc_zygote._zygote[0].pid != client.pid  # forked by the zygote, not started by the client
    assert value == "passed" and cwd.strip().endswith(tmp_path.name)  # ZYGOTE_TEST="passed on": first word


def test_a_killed_child_ends_its_client_by_the_same_signal_and_signals_reach_the_child(tmp_path):
    client = _client(tmp_path, "sleep")
    child = int(client.stdout.readline().split()[0])
    os.kill(child, signal.SIGKILL)
    assert client.wait(timeout=60) == -signal.SIGKILL

    client = _client(tmp_path, "sleep")
    child = int(client.stdout.readline().split()[0])
    client.send_signal(signal.SIGTERM)  # forwarded: the child ends by it, and the client as the child did
    assert client.wait(timeout=60) == -signal.SIGTERM and not _alive(child)


def test_a_killed_client_takes_its_child_with_it(tmp_path):
    client = _client(tmp_path, "sleep")
    child = int(client.stdout.readline().split()[0])
    client.kill()
    client.wait(timeout=60)
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_an_actor_mesh_runs_in_the_zygotes_children(monkeypatch):
    from monarch.actor import Actor, endpoint, this_host

    from meshrl.controller.provision import _local_bootstrap

    class Where(Actor):
        @endpoint
        def where(self) -> tuple[int, int]:
            return os.getpid(), os.getppid()

    monkeypatch.setenv(proc_zygote.ENV_FLAG, "1")
    procs = this_host().spawn_procs(per_host={"procs": 2}, bootstrap_command=_local_bootstrap())
    try:
        answers = [value for _, value in procs.spawn("where", Where).where.call().get(timeout=120)]
    finally:
        procs.stop().get(timeout=60)
    assert len({pid for pid, _ in answers}) == 2
    assert {ppid for _, ppid in answers} == {proc_zygote._zygote[0].pid}
