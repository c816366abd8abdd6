"""Generator and reward processes that are replaced, not fatal.

A `ReplicaPool` holds one single-process actor mesh per replica (so one can be replaced without touching the
others), each with a `Heartbeat` actor beside it. Calls go out as `ReplicaCall`s: waiting on one watches the
replica, and when its process died (Monarch supervision raises on the call) or froze (no heartbeat answer within
`heartbeat_s`, while the call is outstanding), the pool kills what is left of it, spawns a replacement, brings it
to the run's state (`bring_up`: the current weights, asleep or awake) and the call is sent again, to the new
replica, with the same arguments. Requests carry their own seeds, so the re-sent request returns what the lost
one would have: no sample is lost or drawn twice. A run-wide `RestartBudget` bounds the replacements; the one past
it ends the run (with the resume command, as any failure does).

The trainer is not pooled: its ranks hold the only copy of the optimiser state, so a dead trainer ends the run.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

from meshrl.controller.futures import ActorDiedError


class ReplicaFailedError(ActorDiedError):
    """A replica failed and could not be replaced (run.max_restarts spent, or the replacement failed too)."""


@dataclass
class RestartBudget:
    """Replacements left to the whole run (generators and reward processes together), and those made."""

    max_restarts: int
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def used(self) -> int:
        return len(self.events)

    def spend(self, what: str, why: str) -> None:
        if self.used >= self.max_restarts:
            raise ReplicaFailedError(
                f"{what} {why}, and the run's {self.max_restarts} replacement(s) (run.max_restarts) are spent"
            )
        self.events.append({"what": what, "why": why, "time": time.time()})


@dataclass
class Replica:
    procs: Any  # its ProcMesh (one process)
    actor: Any  # the actor mesh of that one process
    heartbeat: Any
    pid: int | None = None
    host: str | None = None
    generation: int = 0  # replacements of this slot so far
    info: Any = None  # what its `setup` returned


class ReplicaPool:
    """`num` replicas of one role. `spawn(i)` -> (procs, actor) starts replica i; `setup`: the endpoint each new
    replica is set up with (its return value is `info(i)`); `bring_up(i)`: called after a replacement's setup, to
    give it the run's state; `replaceable` False: a failed replica ends the run instead. `poll_s`: how often an
    outstanding call checks its replica's heartbeat."""

    def __init__(
        self,
        role: str,
        num: int,
        spawn: Callable[[int], tuple[Any, Any]],
        *,
        budget: RestartBudget,
        timeout_s: float,
        heartbeat_s: float,
        setup: str | None = None,
        bring_up: Callable[[int], None] | None = None,
        replaceable: bool = True,
        poll_s: float = 1.0,
    ) -> None:
        self.role, self._spawn_fn, self.setup_endpoint = role, spawn, setup
        self.budget, self.timeout_s, self.heartbeat_s, self.poll_s = budget, timeout_s, heartbeat_s, poll_s
        self.bring_up = bring_up
        # False: a failed replica ends the run instead (the asynchronous loop: its queued requests wait on the
        # weights version they were sent for, which a replacement may no longer be able to load).
        self.replaceable = replaceable
        self._lock = threading.Lock()
        self.replicas = [self._spawn(i) for i in range(num)]
        # Set up now, waited for in `start`: the caller builds its other meshes meanwhile (models load in parallel).
        self._starting = [
            (getattr(r.actor, setup).call_one() if setup else None, r.heartbeat.beat.call_one()) for r in self
        ]

    def __len__(self) -> int:
        return len(self.replicas)

    def _spawn(self, i: int, generation: int = 0) -> Replica:
        procs, actor = self._spawn_fn(i)
        from meshrl.actors.heartbeat import Heartbeat

        return Replica(procs, actor, procs.spawn("heartbeat", Heartbeat), generation=generation)

    def start(self) -> list[Any]:
        """Wait for every replica's setup (sent when the pool was made); returns each one's `setup` result."""
        for r, (setup, beat) in zip(self, self._starting, strict=True):
            r.info = setup.get(timeout=self.timeout_s) if setup is not None else None
            where = beat.get(timeout=self.timeout_s)
            r.pid, r.host = where["pid"], where["host"]
        return [r.info for r in self]

    def __iter__(self):
        return iter(self.replicas)

    def actor(self, i: int) -> Any:
        """Replica i's actor mesh (one process), for a call that needs no watching (tests, tools)."""
        return self.replicas[i].actor

    @property
    def pids(self) -> list[int | None]:
        return [r.pid for r in self]

    def send(self, i: int, endpoint: str, *args: Any) -> ReplicaCall:
        return ReplicaCall(self, i, endpoint, args)

    def send_all(self, endpoint: str, *args: Any) -> list[ReplicaCall]:
        return [self.send(i, endpoint, *args) for i in range(len(self))]

    def frozen(self, i: int) -> str | None:
        """Why replica i cannot answer (None: it answers its heartbeat within heartbeat_s)."""
        replica = self.replicas[i]
        try:
            replica.heartbeat.beat.call_one().get(timeout=self.heartbeat_s)
        except TimeoutError:
            # Monarch may not have noticed a death yet: on this host, the process table tells.
            if replica.host == socket.gethostname() and process_state(replica.pid) in (None, "Z"):
                return "died (its process is gone)"
            return f"stopped answering: no heartbeat for {self.heartbeat_s:g}s (frozen or hung, not dead)"
        except SupervisionError as e:
            return f"died ({_last_line(e)})"
        return None

    def replace(self, i: int, generation: int, why: str) -> None:
        """Replace replica i, unless another call already did since `generation` (that one is used then)."""
        with self._lock:
            old = self.replicas[i]
            if old.generation != generation:
                return
            what = f"{self.role} {i} (pid {old.pid})"
            if not self.replaceable:
                raise ReplicaFailedError(f"{what} {why}; {self.role}s are not replaced in this loop: resume instead")
            self.budget.spend(what, why)
            print(
                f"[meshrl] {what} {why}: replacing it ({self.budget.used} of run.max_restarts="
                f"{self.budget.max_restarts}); its requests are sent again",
                file=sys.stderr,
                flush=True,
            )
            self._kill(old)
            t0 = time.perf_counter()
            new = self._spawn(i, generation + 1)
            self.replicas[i] = new
            try:
                if self.setup_endpoint:
                    new.info = getattr(new.actor, self.setup_endpoint).call_one().get(timeout=self.timeout_s)
                where = new.heartbeat.beat.call_one().get(timeout=self.timeout_s)
                new.pid, new.host = where["pid"], where["host"]
                if self.bring_up is not None:
                    self.bring_up(i)
            except Exception as e:  # noqa: BLE001 - any failure of the replacement ends the run
                raise ReplicaFailedError(f"{what} {why}; its replacement failed too: {e}") from e
            print(
                f"[meshrl] {self.role} {i} replaced by pid {new.pid} in {time.perf_counter() - t0:.1f}s",
                file=sys.stderr,
                flush=True,
            )

    @staticmethod
    def _kill(replica: Replica) -> None:
        """A frozen process cannot stop itself: kill it (on this host), then let Monarch drop the mesh."""
        if replica.pid is not None and replica.host == socket.gethostname():
            try:
                os.kill(replica.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            replica.procs.stop()  # not waited for: a dead mesh may never confirm
        except Exception:  # noqa: BLE001 - best effort, the process is gone
            pass

    def stop(self) -> list[Any]:
        """Stop every replica's processes; returns the futures to wait on."""
        stopping = []
        for r in self:
            try:
                stopping.append(r.procs.stop())
            except Exception:  # noqa: BLE001 - best effort: the processes may already be gone
                pass
        return stopping


class ReplicaCall:
    """One endpoint call to one replica, re-sent to its replacement if the replica dies or freezes before
    answering. Waits like a Monarch future: `.get(timeout)`."""

    def __init__(self, pool: ReplicaPool, index: int, endpoint: str, args: tuple) -> None:
        self.pool, self.index, self.endpoint, self.args = pool, index, endpoint, args
        self._send()

    def _send(self) -> None:
        replica = self.pool.replicas[self.index]
        self.generation = replica.generation
        self.future = getattr(replica.actor, self.endpoint).call_one(*self.args)

    def get(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                value = _get_slice(self.future, deadline, self.pool.poll_s)
                if value is not _NOT_YET:
                    return value
                why = self.pool.frozen(self.index)
                if why is None:
                    continue  # busy, and alive
            except SupervisionError as e:
                why = f"died ({_last_line(e)})"
            self.pool.replace(self.index, self.generation, why)
            self._send()
            if timeout is not None:  # the re-sent request gets the whole time again
                deadline = time.monotonic() + timeout


_NOT_YET = object()


def _get_slice(future: Any, deadline: float | None, poll_s: float) -> Any:
    """`future`'s value if it comes within `poll_s` (else _NOT_YET: time to check on the process); TimeoutError
    once `deadline` has passed. A Monarch future survives a timed-out get."""
    left = poll_s if deadline is None else deadline - time.monotonic()
    try:
        return future.get(timeout=max(0.0, min(poll_s, left)))
    except TimeoutError:
        if deadline is not None and time.monotonic() >= deadline:
            raise
        return _NOT_YET


def process_state(pid: int | None) -> str | None:
    """The state letter of a process on this host (R, S, T for stopped, Z for a zombie...); None: no such process."""
    if pid is None:
        return None
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one read
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]  # after the command name, which may hold spaces and parentheses


def _last_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


class ActorFrozenError(RuntimeError):
    """An actor process stopped answering its heartbeat: frozen or hung, not dead."""


class WatchedMesh:
    """An actor mesh that is not replaced (the trainer) but watched: waiting on any of its calls checks its
    processes' heartbeat every `poll_s`, so a frozen process ends the run within `heartbeat_s` of being waited on,
    named as frozen, instead of after Monarch's supervision timeout (reported as a death) or the call timeout.
    `on_frozen()` runs first (killing the processes: a frozen process cannot stop itself)."""

    def __init__(
        self, mesh: Any, heartbeat: Any, *, what: str, heartbeat_s: float, on_frozen: Callable[[], None],
        poll_s: float = 1.0,
    ) -> None:  # fmt: skip
        self.mesh, self._heartbeat, self._what = mesh, heartbeat, what  # `mesh`: the actors, unwatched
        self._heartbeat_s, self._on_frozen, self._poll_s = heartbeat_s, on_frozen, poll_s

    def __getattr__(self, endpoint: str) -> _WatchedEndpoint:
        return _WatchedEndpoint(self, getattr(self.mesh, endpoint))

    def check(self) -> None:
        try:
            self._heartbeat.beat.call().get(timeout=self._heartbeat_s)
        except TimeoutError:
            self._on_frozen()
            raise ActorFrozenError(
                f"{self._what} stopped answering: no heartbeat for {self._heartbeat_s:g}s (frozen or hung, not dead)"
            ) from None
        except SupervisionError:
            pass  # died: the call itself raises that


class _WatchedEndpoint:
    def __init__(self, mesh: WatchedMesh, endpoint: Any) -> None:
        self._mesh, self._endpoint = mesh, endpoint

    def call(self, *args: Any) -> _WatchedFuture:
        return _WatchedFuture(self._mesh, self._endpoint.call(*args))


class _WatchedFuture:
    def __init__(self, mesh: WatchedMesh, future: Any) -> None:
        self._mesh, self._future = mesh, future

    def get(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (value := _get_slice(self._future, deadline, self._mesh._poll_s)) is _NOT_YET:
            self._mesh.check()
        return value
