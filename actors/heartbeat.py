"""Heartbeat: a tiny actor beside each generator and reward process, answering while the process lives.

It is a synchronous actor, so Monarch runs it on a driver thread of its own: it answers while the process's
other actor is busy (a long generation, a slow reward function). A process that stops answering it is frozen
(SIGSTOP, swapped out, stuck holding the interpreter), not merely busy."""

from __future__ import annotations

import os
import socket

from monarch.actor import Actor, endpoint


class Heartbeat(Actor):
    @endpoint
    def beat(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname()}
