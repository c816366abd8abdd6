"""One environment process (`python -m meshrl.rollout.env_worker FD PARENT_PID`): the far end of `EnvWorkers`.

It holds the environments of the episodes routed to it and runs their calls as the controller's threads used to:
a plain method on a daemon thread of its own (at most `max_threads` at once), an `async def` one on the process's
event loop, so a slow step never holds up the other episodes here. The pipe's reader — the main thread — answers
pings: a process whose reader cannot answer is held by a step that keeps the interpreter (a C loop that never
releases the GIL), and the controller kills it (meshrl.rollout.env_pool).

Messages, pickled over the socket the controller passed (`multiprocessing.connection.Connection`):
    controller -> here   ("spec", sys_path, pickled (env class, kwargs), max_threads)   once, first
                         ("call", call_id, env_id, method, args)       method "__init__" constructs the environment
                         ("drop", env_id)                              the episode is over
                         ("ping", n)
    here -> controller   ("ready", pid) once; ("done", call_id, ok, value or (type name, message)); ("pong", n)

It dies with the controller (PR_SET_PDEATHSIG) even while a step holds its interpreter, and exits when the pipe
closes. No Monarch imports.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the controller died before the line above
        os._exit(0)


def _error(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


class _Worker:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()
        self.envs: dict[int, Any] = {}
        self.make: Any = None
        self.spec_error: tuple[str, str] | None = None
        self.slots = threading.BoundedSemaphore(32)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="meshrl-env-loop").start()

    def send(self, message: tuple) -> None:
        try:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - a value the controller cannot receive is the environment's error
            if message[0] != "done":
                raise
            why = f"returned a value that cannot be sent to the controller ({type(e).__name__}: {e})"
            data = pickle.dumps(("done", message[1], False, ("TypeError", why)))
        with self.send_lock:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the controller is gone
                os._exit(0)

    def load_spec(self, sys_path: list[str], spec: bytes, max_threads: int) -> None:
        for p in reversed(sys_path):
            if p not in sys.path:
                sys.path.insert(0, p)
        self.slots = threading.BoundedSemaphore(max(1, max_threads))
        try:
            cls, kwargs = pickle.loads(spec)
            self.make = lambda: cls(**kwargs)
        except Exception as e:  # noqa: BLE001 - every construction then answers with it
            self.spec_error = ("ImportError", f"the environment process cannot load the environment class: {_error(e)}")

    def call(self, call_id: int, env_id: int, method: str, args: tuple) -> None:
        if method == "__init__":
            if self.spec_error is not None:
                self.send(("done", call_id, False, self.spec_error))
                return
            fn = self.make
        else:
            env = self.envs.get(env_id)
            if env is None:
                self.send(("done", call_id, False, ("RuntimeError", f"no environment {env_id} in this process")))
                return
            fn = getattr(env, method)

        def settle(value: Any, error: BaseException | None) -> None:
            if error is not None:
                self.send(("done", call_id, False, _error(error)))
                return
            if method == "__init__":
                self.envs[env_id] = value
                value = None
            self.send(("done", call_id, True, value))

        if inspect.iscoroutinefunction(fn):

            def settled(future: Any) -> None:
                error = future.exception()
                settle(None if error else future.result(), error)

            asyncio.run_coroutine_threadsafe(fn(*args), self.loop).add_done_callback(settled)
            return

        def target() -> None:
            with self.slots:
                try:
                    value, error = fn(*args), None
                except BaseException as e:  # noqa: BLE001 - handed back to the episode
                    value, error = None, e
            settle(value, error)

        threading.Thread(target=target, daemon=True, name="meshrl-env").start()

    def serve(self) -> None:
        self.send(("ready", os.getpid()))
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the controller closed the pipe or died
                os._exit(0)
            kind = message[0]
            if kind == "ping":
                self.send(("pong", message[1]))
            elif kind == "call":
                self.call(*message[1:])
            elif kind == "drop":
                self.envs.pop(message[1], None)
            elif kind == "spec":
                self.load_spec(*message[1:])
            elif kind == "close":
                os._exit(0)


def main(argv: list[str]) -> None:
    fd, parent_pid = int(argv[0]), int(argv[1])
    _die_with_parent(parent_pid)
    try:
        _Worker(Connection(fd)).serve()
    except Exception:  # noqa: BLE001 - a bug here: say it, and let the controller see the pipe close
        traceback.print_exc()
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
