"""Issue 31 item 11, the long pause: a controller stopped for 40 s (SIGSTOP, then SIGCONT) while a reward
request is under way finishes the request with no replacement. Monarch's 30 s delivery timeout used to close the
reward process's link to the stopped controller, so on waking its heartbeat was never answered and the healthy
process was declared frozen (controller/pauses.py). The pause outlasts that default timeout by 10 s. ~60 s: a real
pause of a real controller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PAUSE_S = 40.0  # > Monarch's default message_delivery_timeout (30 s), which pauses.py raises

_CONTROLLER = """
import time
from meshrl.config import PlacementConfig
from meshrl.controller.process import prepare_process
from meshrl.controller.provision import Provisioner
from meshrl.controller.replicas import RestartBudget
from meshrl.controller.reward_pool import RewardPool
from meshrl.rewards import Rubric, ScoringConfig


def slow(completion, row):
    time.sleep(1.0)
    return 1.0


if __name__ == "__main__":
    prepare_process()
    rubric = Rubric({"slow": 1.0}, ScoringConfig(num_threads=1), fns={"slow": slow})
    pool = RewardPool(Provisioner(PlacementConfig()), rubric, budget=RestartBudget(0), timeout_s=300, heartbeat_s=3)
    pool.start()
    print("READY", pool.pids[0], flush=True)
    first = pool.score(["a"] * 4, [{"prompt": "p", "answer": "a"}], group_size=4).result()
    again = pool.score(["a"] * 2, [{"prompt": "p", "answer": "a"}], group_size=2).result()  # the link still works
    print("DONE", [s.reward for s in first + again], "restarts", pool.budget.used, flush=True)
    for f in pool.stop():
        try:
            f.get(timeout=10)
        except Exception:
            pass
"""


def test_a_controller_paused_past_monarchs_delivery_timeout_finishes_its_request_without_a_replacement(tmp_path):
    script = tmp_path / "paused_controller.py"
    script.write_text(_CONTROLLER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPERACTOR_")}  # the program sets its own
    proc = subprocess.Popen(
        [sys.executable, "-u", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line + proc.stderr.read()[-3000:]
        time.sleep(1.0)  # the request is under way: its answer and heartbeats reach a stopped controller
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(PAUSE_S)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (out + err)[-3000:]
    assert "DONE [1.0, 1.0, 1.0, 1.0, 1.0, 1.0] restarts 0" in out, (out + err)[-3000:]
