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

from meshrl.controller.futures import ActorDiedError, ActorFrozenError, CollectiveRankError


class ReplicaLostError(RuntimeError):
    """A replica's process died or froze while a call waited on it (`ReplicaPool.wait`); the message says how."""


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

    def spend(self, what: str, why: str) -> dict[str, Any]:
        if self.used >= self.max_restarts:
            raise ReplicaFailedError(
                f"{what} {why}, and the run's {self.max_restarts} replacement(s) (run.max_restarts) are spent"
            )
        event = {"what": what, "why": why, "time": time.time()}
        self.events.append(event)
        return event

    def refund(self, events: list[dict[str, Any]]) -> None:
        """Take back replacements that turned out to be a sample's fault, not the process's (a reward function that
        crashes on one sample: controller/reward_pool.py)."""
        self.events = [e for e in self.events if not any(e is r for r in events)]


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
        """Why replica i cannot answer (None: it answers its heartbeat within heartbeat_s of this process's own
        running time: see `heartbeat_answers`)."""
        replica = self.replicas[i]
        # Monarch may not have noticed a death yet: on this host, the process table tells (at once, not after
        # heartbeat_s of silence).
        if replica.host == socket.gethostname() and process_state(replica.pid) in (None, "Z"):
            return "died (its process is gone)"
        try:
            heartbeat_answers(replica.heartbeat.beat.call_one, self.heartbeat_s)
        except TimeoutError:
            if replica.host == socket.gethostname() and process_state(replica.pid) in (None, "Z"):
                return "died (its process is gone)"
            return f"stopped answering: no heartbeat for {self.heartbeat_s:g}s (frozen or hung, not dead)"
        except SupervisionError as e:
            return f"died ({_last_line(e)})"
        return None

    def replace(self, i: int, generation: int, why: str, *, charge: bool = True) -> dict[str, Any] | None:
        """Replace replica i, unless another call already did since `generation` (that one is used then). Returns
        the restart-budget event spent (None: none; `charge` False: a replacement the budget does not pay for)."""
        with self._lock:
            old = self.replicas[i]
            if old.generation != generation:
                return None
            what = f"{self.role} {i} (pid {old.pid})"
            if not self.replaceable:
                raise ReplicaFailedError(f"{what} {why}; {self.role}s are not replaced in this loop: resume instead")
            event = self.budget.spend(what, why) if charge else None
            counted = f"{self.budget.used} of run.max_restarts={self.budget.max_restarts}" if charge else "not counted"
            print(
                f"[meshrl] {what} {why}: replacing it ({counted}); its requests are sent again",
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
            return event

    def isolate(self, call: ReplicaCall, why: str) -> Any:
        """Called when a replacement was lost on the same request as the replica before it: the request itself
        may be what kills the process. A pool that can split its requests answers it piece by piece
        (RewardPool); this one returns _NOT_YET: the request is sent again whole, as any other."""
        return _NOT_YET

    def wait(self, i: int, future: Any, timeout: float | None) -> Any:
        """`future` (a call to replica i's current process)'s value, watched as a ReplicaCall is; ReplicaLostError
        (with why) when the process dies or freezes first. Nothing is replaced or sent again here."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                value = _get_slice(future, deadline, self.poll_s)
            except SupervisionError as e:
                raise ReplicaLostError(f"died ({_last_line(e)})") from None
            if value is not _NOT_YET:
                return value
            if (why := self.frozen(i)) is not None:
                raise ReplicaLostError(why)

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
        self.lost = 0  # processes lost while answering this request
        self.charged: list[dict[str, Any]] = []  # the restart-budget events its replacements spent
        self._send()

    def _send(self) -> None:
        replica = self.pool.replicas[self.index]
        self.generation = replica.generation
        self.future = getattr(replica.actor, self.endpoint).call_one(*self.args)

    def ready(self) -> bool:
        """Whether the answer (or the call's failure) has come back, without waiting: then `get` returns or deals
        with the failure at once. For the asynchronous loop, which must not wait behind a replica's queued work."""
        try:
            self.future.get(timeout=0)  # a timed-out get leaves the future as it was
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - failed: `get` replaces the replica or raises
            return True
        return True

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
            self.lost += 1
            if self.lost >= 2 and (value := self.pool.isolate(self, why)) is not _NOT_YET:
                return value  # answered piece by piece: the piece that kills the process found and scored 0
            if event := self.pool.replace(self.index, self.generation, why):
                self.charged.append(event)
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


class WatcherClock:
    """This process's own stalls: a daemon thread ticks every `tick_s`, and a tick that comes late by more than a
    tick means this process did not run meanwhile (SIGSTOP and SIGCONT, a suspended machine, a debugger pause,
    a C call holding the interpreter). A watcher that was not running cannot have seen a heartbeat answer, so
    such a stall is not counted as the watched process's silence (`heartbeat_answers`).

    `start=False` and `now`: a clock driven by hand (`tick()`), for tests."""

    def __init__(self, tick_s: float = 0.25, *, start: bool = True, now: Callable[[], float] = time.monotonic):
        self.tick_s, self.now = tick_s, now
        self._lock = threading.Lock()
        self._last = now()
        self._gaps: list[tuple[float, float]] = []  # (when a stall ended, its length), the last few minutes' only
        if start:
            threading.Thread(target=self._run, name="meshrl-watcher-clock", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.tick_s)
            self.tick()

    def tick(self) -> None:
        now = self.now()
        with self._lock:
            late = now - self._last - self.tick_s
            if late > self.tick_s:
                self._gaps.append((now, late))
                self._gaps = [(t, g) for t, g in self._gaps if t > now - 600]
            self._last = now

    def stalled_since(self, t0: float) -> float:
        """Seconds since `t0` during which this process did not run (the stall still under way included: a tick
        overdue now, as right after a SIGCONT, before the ticking thread has run)."""
        now = self.now()
        with self._lock:
            total = sum(min(gap, end - t0) for end, gap in self._gaps if end > t0)
            overdue = now - max(self._last, t0) - self.tick_s
            if overdue > self.tick_s:
                total += overdue
        return total


_clock: WatcherClock | None = None
_clock_lock = threading.Lock()


def watcher_clock() -> WatcherClock:
    """This process's WatcherClock (started on first use)."""
    global _clock
    with _clock_lock:
        if _clock is None:
            _clock = WatcherClock()
        return _clock


def heartbeat_answers(ask: Callable[[], Any], heartbeat_s: float, clock: WatcherClock | None = None) -> Any:
    """The answer of a heartbeat: `ask()` sends one and returns its future. TimeoutError when none came within
    `heartbeat_s` of this (the watching) process's own running time: a stall of the watcher while it waited (a
    paused controller: issue 31 item 11) extends the wait by the stall, and the beat is asked again after it, as
    an answer due while this process was stopped may have been given up on by the timer that woke it."""
    clock = clock or watcher_clock()
    t0 = clock.now()
    future = ask()
    while True:
        allowed = heartbeat_s + clock.stalled_since(t0)
        try:
            return future.get(timeout=max(0.0, t0 + allowed - clock.now()))
        except TimeoutError:
            stalled = clock.stalled_since(t0)
            if clock.now() >= t0 + heartbeat_s + stalled:
                raise
            # The watcher was stopped while it waited: ask again, for the time it is owed.
            print(
                f"[meshrl] this controller did not run for {stalled:.1f}s (paused or stopped): asking the heartbeat "
                "again before judging the watched process",
                file=sys.stderr,
                flush=True,
            )
            future = ask()


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


class WatchedMesh:
    """An actor mesh that is not replaced (the trainer) but watched: waiting on any of its calls checks its
    processes' heartbeat every `poll_s`, so a frozen process ends the run within `heartbeat_s` of being waited on,
    named as frozen, instead of after Monarch's supervision timeout (reported as a death) or the call timeout.
    `on_frozen()` runs first (killing the processes: a frozen process cannot stop itself). `dead()`: names the
    processes of the mesh that are gone ("trainer rank 1 of 2 (pid 4242)"; None: none), asked before the heartbeat:
    a killed rank leaves the heartbeat unanswered too, and on a loaded machine Monarch's supervision may report the
    death only after `heartbeat_s`, so without it a death was told as a freeze (CI, two test workers)."""

    def __init__(
        self, mesh: Any, heartbeat: Any, *, what: str, heartbeat_s: float, on_frozen: Callable[[], None],
        poll_s: float = 1.0, dead: Callable[[], str | None] | None = None,
        on_wedged: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.mesh, self._heartbeat, self._what = mesh, heartbeat, what  # `mesh`: the actors, unwatched
        self._heartbeat_s, self._on_frozen, self._poll_s = heartbeat_s, on_frozen, poll_s
        # ranks left waiting in a collective for one that raised (`call_collective`): stopped as a frozen one is
        self.on_wedged = on_wedged or on_frozen
        self._dead = dead or (lambda: None)

    def __getattr__(self, endpoint: str) -> _WatchedEndpoint:
        return _WatchedEndpoint(self, getattr(self.mesh, endpoint))

    def check(self) -> None:
        self._raise_if_dead()
        try:
            heartbeat_answers(self._heartbeat.beat.call, self._heartbeat_s)
        except TimeoutError:
            self._raise_if_dead()
            self._on_frozen()
            raise ActorFrozenError(
                f"{self._what} stopped answering: no heartbeat for {self._heartbeat_s:g}s (frozen or hung, not dead)"
            ) from None
        except SupervisionError:
            pass  # died: the call itself raises that

    def _raise_if_dead(self) -> None:
        if gone := self._dead():
            raise ActorDiedError(f"{gone} died (its process is gone)", gone)


class _WatchedEndpoint:
    def __init__(self, mesh: WatchedMesh, endpoint: Any) -> None:
        self._mesh, self._endpoint = mesh, endpoint

    def call(self, *args: Any) -> _WatchedFuture:
        return _WatchedFuture(self._mesh, self._endpoint.call(*args))

    def call_collective(self, *args: Any) -> _CollectiveFuture:
        """For an endpoint whose ranks run collectives together and answer the same value (the trainer's
        forward_backward, forward, optim_step, push_weights): the answers as they come, so that one rank's error
        ends the wait at once (`_CollectiveFuture`). `.call()` waits for every rank's answer, and after one rank
        raised inside a call (out of memory in its forward, say) the others never answer: they wait in a
        collective for it until NCCL's timeout, and the run hung (four-GPU layout, 2026-11-27)."""
        return _CollectiveFuture(self._mesh, list(self._endpoint.stream(*args)))


class _WatchedFuture:
    def __init__(self, mesh: WatchedMesh, future: Any) -> None:
        self._mesh, self._future = mesh, future

    def get(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (value := _get_slice(self._future, deadline, self._mesh._poll_s)) is _NOT_YET:
            self._mesh.check()
        return value


class _CollectiveFuture:
    """The per-rank answers of a collective call in the order they arrive. `get` returns them as `_Answers` (what
    `.call()`'s ValueMesh gives the combiners: `.values()`, not in rank order, which is why only endpoints whose
    ranks answer alike use it). The first error raises at once, after `grace_s` for the other ranks to answer
    (a failure every rank reaches, e.g. a non-finite loss after the all-reduce, comes from all of them within
    milliseconds); a rank still silent then is waiting in a collective for the one that failed and never will
    answer: `mesh.on_wedged()` stops the mesh, and the error is a `CollectiveRankError` saying so."""

    def __init__(self, mesh: WatchedMesh, futures: list[Any], grace_s: float = 15.0) -> None:
        self._mesh, self._futures, self._grace_s = mesh, futures, grace_s
        self._values: list[Any] = []

    def get(self, timeout: float | None = None) -> _Answers:
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._values) < len(self._futures):  # a get after a timed-out one goes on where it stopped
            future = self._futures[len(self._values)]
            try:
                while (value := _get_slice(future, deadline, self._mesh._poll_s)) is _NOT_YET:
                    self._mesh.check()
            except (TimeoutError, SupervisionError, ActorDiedError, ActorFrozenError):
                raise
            except Exception as e:  # noqa: BLE001 - a rank's own error: raised below, after the others' answers
                self._raise_after_grace(e)
            self._values.append(value)
        return _Answers(self._values)

    def _raise_after_grace(self, error: Exception) -> None:
        silent = len(self._futures) - len(self._values) - 1
        grace = time.monotonic() + self._grace_s
        for future in self._futures[len(self._values) + 1 :]:
            try:
                future.get(timeout=max(grace - time.monotonic(), 0.0))
            except TimeoutError:
                break
            except Exception:  # noqa: BLE001 - that rank failed too (or died): it is not waiting
                pass
            silent -= 1
        if silent <= 0 or self._mesh._dead():
            raise error  # a rank that died is told as a death (Pending), not as ranks left waiting
        self._mesh.on_wedged()
        raise CollectiveRankError(
            f"{_last_line(error)}\n[meshrl] a rank raised that inside a call its other {silent} rank(s) were still "
            f"in: they waited for it in a collective (FSDP's all-gather / reduce-scatter) and could not go on, so "
            f"{self._mesh._what} was stopped. The error above says what to change; the rank's traceback:\n{error}"
        ) from error


class _Answers:
    """Per-rank values, as `ValueMesh.values()` yields them (here in arrival order)."""

    def __init__(self, values: list[Any]) -> None:
        self._values = values

    def values(self) -> list[Any]:
        return list(self._values)
