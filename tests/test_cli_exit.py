"""At exit, Monarch's own shutdown (an atexit callback with a 1 s limit) can time out after a host was lost or on a
busy machine: the programs say so in one line instead of a traceback under the run's last words; any other error
raised at exit is printed as Python prints it. The TimeoutError is raised by a stand-in callback named as Monarch's
(a fake: a real timeout needs a host to vanish at the moment of exit)."""

import subprocess
import sys

CHILD = """
import atexit
from meshrl.controller.cli import quiet_monarch_exit_timeout

def monarch_shutdown():
    raise TimeoutError()

monarch_shutdown.__module__ = "monarch._src.actor.actor_mesh"  # the module whose lambda Monarch registers

def ours():
    raise ValueError("an error of our own at exit")

atexit.register(ours)
atexit.register(monarch_shutdown)
quiet_monarch_exit_timeout()
"""


def test_monarchs_shutdown_timeout_at_exit_is_one_line_and_other_errors_still_show():
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0
    assert "[meshrl] Monarch's shutdown did not finish within its 1 s at exit" in child.stderr
    assert "TimeoutError" not in child.stderr
    assert "ValueError: an error of our own at exit" in child.stderr  # not swallowed
