"""The controller process's own set-up, done once before any process mesh starts.

    prepare_process()                          # fault hook, PYTHONPATH for the actors, stale /dev/shm files
    provision = Provisioner(cfg.placement)     # then the meshes (controller/provision.py)
    ctl = Controller.start(cfg, provision=provision, ...)

Monarch's default reaction to a dead actor process is to exit the controller (KeyboardInterrupt in the main
thread). `prepare_process` records the failure instead, in the `failures` list of every live Controller
(`record_faults`); the waiting call raises ActorDiedError and the program ends with a message naming the last good
checkpoint. A `Controller` built directly calls `prepare_process` itself (it does the same work again, harmlessly).
"""

from __future__ import annotations

import os
import sys

import monarch.actor

from meshrl.controller.pauses import tolerate_pauses
from meshrl.weight_sync.shared_buffer import remove_stale_files

_fault_logs: list[list[str]] = []  # the `failures` lists of the live Controllers


def prepare_process() -> None:
    """Monarch's fault hook records actor failures instead of exiting; PYTHONPATH carries this process's import
    path to the actor processes; shared-buffer files left in /dev/shm by an earlier run whose trainer or controller
    was SIGKILLed are removed."""
    monarch.actor.unhandled_fault_hook = _record_fault
    tolerate_pauses()  # Monarch's delivery and orphan timeouts: a paused controller is not a dead one
    export_import_path()
    remove_stale_files()


def export_import_path() -> None:
    """Actor processes inherit PYTHONPATH: put the controller's script directory and working directory on it, so
    that user code named by import path (rewards, losses, tasks) imports in every process as it does here."""
    extra = [p for p in (os.getcwd(), sys.path[0] if sys.path and sys.path[0] else None) if p]
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(current + extra))


def record_faults(log: list[str]) -> None:
    """From now on, every unhandled actor failure in this process is appended to `log` (until `stop_recording`)."""
    _fault_logs.append(log)


def stop_recording(log: list[str]) -> None:
    if any(entry is log for entry in _fault_logs):
        _fault_logs[:] = [entry for entry in _fault_logs if entry is not log]


def _record_fault(failure: object) -> None:
    for log in _fault_logs:
        log.append(str(failure))
