"""Environments out of the controller process: a pool of environment processes, each one replaceable.

    envs = EnvWorkers(CalculatorEnv, {}, num_workers=4, timeout_s=30)    # processes start at the first episode
    runner = EpisodeRunner(None, renderer, generate, limits, envs=envs)  # every env call goes to a process
    ...
    envs.close()                                                         # also at exit, and with the controller

Why processes. An environment's `step` runs user code: a regex that backtracks forever, a C extension stuck in a
loop, a segfault. On the controller's own threads such a step held the controller's interpreter (its GIL), so no
timeout fired and no heartbeat was watched: the whole run froze (issue 31, item 13); a segfault killed the run.
Here each episode's environment lives in one of `num_workers` processes (`python -m meshrl.rollout.env_worker`),
constructed there from its class — imported by name in the process, as a reward function is in a reward process —
and the episode's calls go to that process. `--env.timeout-s` is enforced from the controller: a call that does
not answer in time ends its episode (env_timeout, as before); the process is then asked to answer a ping, and one
that cannot (its interpreter held) is killed and replaced. A process that dies (a segfault, `os.abort`) is
replaced too. The episodes whose environments lived in a lost process end as env_error, naming the process and
why it was lost; they are counted in the step's metrics exactly as other environment failures, and the run goes on.

Inside a process the calls run as they did in the controller: plain methods on threads, `async def` ones on the
process's event loop — so a slow (sleeping) step never holds up the other episodes of its process, and costs only
its own episode. Fewer processes means more episodes lost with a process that a step hangs or kills; more means
more memory (~30 MB each plus the environment's imports). The default (`EnvConfig.num_workers`) is one per CPU core,
at least 2 and at most 8.

Why the threads stay an option (`--env.workers 0`, and `EpisodeRunner` without `envs=`, e.g. a function making
environments passed to `Controller.run_episodes`): an environment that cannot be re-created by name in a fresh
process — a class defined in a notebook or in the `__main__` script, one sharing objects with its caller, a
factory closure — or a test of the episode logic itself. Such environments have the old limits (a step holding the
interpreter freezes the run) and the old reach (they see the controller's memory). Episodes are identical either
way: which process runs an environment never changes what it answers, so runs stay reproducible and resumable.

The processes die with the controller (PR_SET_PDEATHSIG, even while a step holds their interpreter) and exit when
their pipe closes. No Monarch imports.
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

START_TIMEOUT_S = 120.0
"""A process that has not started (imported its modules) by then is killed: the run ends, naming it."""


class EnvProcessLost(RuntimeError):
    """An episode's environment was lost with its process (killed for holding its interpreter, or dead)."""


class EnvProcessStartError(RuntimeError):
    """An environment process could not start (not an episode's failure: the run ends, naming the process)."""


@dataclass(frozen=True)
class RemoteEnv:
    """One episode's environment, living in process `proc`."""

    proc: _Proc
    env_id: int


def ping_grace_s(timeout_s: float) -> float:
    """How long a process whose call timed out may take to answer a ping before it is found held: its reader
    thread needs the interpreter for a moment only, so this is generous against a busy machine, and short."""
    return min(max(timeout_s, 2.0), 10.0)


class EnvWorkers:
    """`num_workers` processes holding environments of class `env_cls` (made with `kwargs`), started at the first
    `open`. `timeout_s`: the episode's per-call limit (the runner enforces it; here it sets the ping's grace).
    `max_threads`: plain calls running at once in each process. Thread-safe; usable from any event loop."""

    def __init__(
        self,
        env_cls: type,
        kwargs: dict[str, Any],
        num_workers: int,
        *,
        timeout_s: float = 30.0,
        max_threads: int = 32,
        name: str | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1 (0 means: no processes, use threads)")
        if env_cls.__module__ == "__main__":
            raise ValueError(
                f"environment class {env_cls.__qualname__} is defined in the __main__ script, so an environment "
                "process cannot import it by name; move it into a module (package.module:Class), or run environments "
                "on the controller's threads (--env.workers 0)"
            )
        try:
            self.spec = pickle.dumps((env_cls, dict(kwargs)))
        except Exception as e:  # noqa: BLE001 - said with what to do
            raise ValueError(
                f"environment {env_cls.__qualname__} with kwargs {kwargs!r} cannot be sent to an environment process "
                f"({type(e).__name__}: {e}); give it importable keyword arguments, or use --env.workers 0"
            ) from e
        self.env_cls, self.num_workers, self.timeout_s, self.max_threads = env_cls, num_workers, timeout_s, max_threads
        self.name = name or env_cls.__qualname__
        self.procs: list[_Proc] = []
        self.replaced: list[str] = []  # why each replacement was made
        self._reported = 0
        self.lock = threading.Lock()
        self.closed = False
        self._env_ids = itertools.count()
        self._started: list[subprocess.Popen] = []
        self._stopping = [False]  # set (first) by the finalizer: processes it kills are not replaced
        self._finalizer = weakref.finalize(self, _kill_all, self._started, self._stopping)

    # ---- the episode's side ---------------------------------------------------------------------------------
    def open(self) -> Future:
        """A place for one episode's environment: a `RemoteEnv` in the least loaded process, once that process
        has started (not timed as the environment's: starting a process is not the environment's call)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("this EnvWorkers was closed")
            if not self.procs:
                self.procs = [_Proc(self, i) for i in range(self.num_workers)]
            proc = min(self.procs, key=lambda p: (len(p.envs), p.index))
            env = RemoteEnv(proc, next(self._env_ids))
            proc.envs.add(env.env_id)
        out: Future = Future()

        def started(f: Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(env)

        proc.started.add_done_callback(started)
        return out

    def call(self, env: RemoteEnv, method: str, *args: Any) -> Future:
        """`method(*args)` on the episode's environment ("__init__": construct it) -> its result, or its error
        (an `EnvCallError` carrying the environment's exception type name), or `EnvProcessLost`."""
        return env.proc.call(env.env_id, method, args)

    def timed_out(self, env: RemoteEnv, method: str) -> None:
        """The runner gave up on `method` of `env` at the timeout: find out (on a thread) whether its process
        still answers; one that does not is killed and replaced."""
        env.proc.check(f"{self.describe(method)} took over {self.timeout_s:g}s (--env.timeout-s)")

    def release(self, env: RemoteEnv) -> None:
        """The episode is over: its environment is dropped in its process."""
        env.proc.envs.discard(env.env_id)
        env.proc.post(("drop", env.env_id))

    def describe(self, method: str) -> str:
        return f"{self.env_cls.__qualname__}()" if method == "__init__" else f"{self.env_cls.__qualname__}.{method}"

    # ---- the processes ----------------------------------------------------------------------------------------
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.procs]

    def take_replaced(self) -> int:
        """Replacements made since the last call (the step's metric env_processes_replaced)."""
        with self.lock:
            n = len(self.replaced) - self._reported
            self._reported = len(self.replaced)
        return n

    def _replace(self, lost: _Proc, why: str) -> None:
        with self.lock:
            if self.closed or self._stopping[0] or self.procs[lost.index] is not lost:
                return
            self.replaced.append(why)
            self.procs[lost.index] = _Proc(self, lost.index)
        print(
            f"[meshrl] environment process {lost.index} (pid {lost.pid}) {why}; replaced. Its episodes still under "
            "way end as env_error (counted in env_failures); the run goes on",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        with self.lock:
            self.closed = True
            procs, self.procs = self.procs, []
        for p in procs:
            p.lost = p.lost or "closed"
        self._finalizer()


def _kill_all(started: list[subprocess.Popen], stopping: list[bool]) -> None:
    stopping[0] = True
    for popen in started:
        if popen.poll() is None:
            popen.kill()
    for popen in started:
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class EnvCallError(RuntimeError):
    """An environment's exception, raised in its process: `type_name` is the original exception's type."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name


class _Proc:
    """One environment process: its pipe, the calls waiting on it, the environments it holds."""

    def __init__(self, pool: EnvWorkers, index: int) -> None:
        self.pool_ref = weakref.ref(pool)
        self.index, self.timeout_s = index, pool.timeout_s
        self.started: Future = Future()
        self.pending: dict[int, tuple[Future, str]] = {}
        self.pongs: dict[int, threading.Event] = {}
        self.envs: set[int] = set()
        self.lost: str | None = None  # why this process is no longer used (set before it is killed)
        self.checking = False
        self.pid: int | None = None
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the dir holding meshrl
        paths = [src, *env.get("PYTHONPATH", "").split(os.pathsep)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        try:
            self.popen = _spawn(
                [sys.executable, "-m", "meshrl.rollout.env_worker", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
            )  # fmt: skip
        finally:
            theirs.close()
        pool._started.append(self.popen)
        self.pid = self.popen.pid
        self.conn = Connection(ours.detach())
        self.post(("spec", list(sys.path), pool.spec, pool.max_threads))
        threading.Thread(target=self._send_loop, daemon=True, name=f"meshrl-env-send-{index}").start()
        threading.Thread(target=self._read_loop, daemon=True, name=f"meshrl-env-read-{index}").start()
        self.start_timer = threading.Timer(START_TIMEOUT_S, self._start_timed_out)
        self.start_timer.daemon = True
        self.start_timer.start()

    # ---- sending --------------------------------------------------------------------------------------------
    def post(self, message: tuple) -> None:
        """Queued for the sender thread: a process that holds its interpreter stops reading its pipe, and a
        full pipe must block that thread, never the episode's event loop."""
        self.outbox.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_loop(self) -> None:
        while True:
            data = self.outbox.get()
            try:
                self.conn.send_bytes(data)
            except OSError:  # the process is gone; the reader settles what waits on it
                return

    def call(self, env_id: int, method: str, args: tuple) -> Future:
        future: Future = Future()
        with self.lock:
            if self.lost is not None:
                future.set_exception(EnvProcessLost(self._lost_before(method)))
                return future
            call_id = next(self.ids)
            self.pending[call_id] = (future, method)
        try:
            self.post(("call", call_id, env_id, method, args))
        except Exception as e:  # noqa: BLE001 - arguments that cannot be pickled: the environment's inputs
            with self.lock:
                self.pending.pop(call_id, None)
            future.set_exception(TypeError(f"cannot send {method}'s arguments to its environment process: {e}"))
        return future

    def _lost_before(self, method: str) -> str:
        return (
            f"its environment process {self.index} (pid {self.pid}) was lost before {method} ({self.lost}); the "
            "environment's state went with it"
        )

    # ---- watching -------------------------------------------------------------------------------------------
    def check(self, why: str) -> None:
        """On a thread: a ping; no answer within the grace (the interpreter held by a step) -> killed."""
        with self.lock:
            if self.lost is not None or self.checking:
                return
            self.checking = True

        def run() -> None:
            grace = ping_grace_s(self.timeout_s)
            try:
                if not self.ping(grace):
                    self.kill(f"held its interpreter: {why}, and it answered no ping for {grace:g}s")
            finally:
                self.checking = False

        threading.Thread(target=run, daemon=True, name=f"meshrl-env-check-{self.index}").start()

    def ping(self, timeout_s: float) -> bool:
        n, answered = next(self.ids), threading.Event()
        self.pongs[n] = answered
        self.post(("ping", n))
        try:
            return answered.wait(timeout_s) or self.lost is not None
        finally:
            self.pongs.pop(n, None)

    def kill(self, why: str) -> None:
        with self.lock:
            if self.lost is not None:
                return
            self.lost = why
        if self.popen.poll() is None:
            self.popen.kill()  # the reader sees the pipe close and settles the calls

    def _start_timed_out(self) -> None:
        if not self.started.done():
            self.kill(f"did not start within {START_TIMEOUT_S:g}s")

    # ---- receiving ------------------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while True:
                message = self.conn.recv()
                kind = message[0]
                if kind == "done":
                    _, call_id, ok, value = message
                    with self.lock:
                        future, _method = self.pending.pop(call_id, (None, None))
                    if future is None or future.done():  # abandoned at its timeout
                        continue
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(EnvCallError(*value))
                elif kind == "pong":
                    event = self.pongs.get(message[1])
                    if event is not None:
                        event.set()
                elif kind == "ready":
                    self.start_timer.cancel()
                    self.started.set_result(self)
        except (EOFError, OSError):
            pass
        self._ended()

    def _ended(self) -> None:
        try:
            code = self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait()
        with self.lock:
            if self.lost is None:
                self.lost = f"died ({_exit_status(code)})"
            pending, self.pending = self.pending, {}
        self.conn.close()
        for future, method in pending.values():
            if not future.done():
                future.set_exception(
                    EnvProcessLost(
                        f"its environment process {self.index} (pid {self.pid}) {self.lost} while running {method} "
                        "(this episode's call or another episode's beside it in that process)"
                    )
                )
        pool = self.pool_ref()
        if not self.started.done():
            self.started.set_exception(
                EnvProcessStartError(
                    f"environment process {self.index} (pid {self.pid}) for --env {pool.name if pool else '?'} "
                    f"could not start: it {self.lost} (see its output above)"
                )
            )
        elif pool is not None and self.lost != "closed":
            pool._replace(self, self.lost)


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ---- starting processes -----------------------------------------------------------------------------------------
# PR_SET_PDEATHSIG (the worker's "die with the controller") fires when the *thread* that started the process ends,
# not the process: so every environment process is started by one thread that lives as long as the controller.
_spawn_jobs: queue.SimpleQueue | None = None
_spawn_lock = threading.Lock()


def _spawn(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    global _spawn_jobs
    with _spawn_lock:
        if _spawn_jobs is None:
            _spawn_jobs = queue.SimpleQueue()
            threading.Thread(target=_spawner, args=(_spawn_jobs,), daemon=True, name="meshrl-env-spawner").start()
        jobs = _spawn_jobs
    done: Future = Future()
    jobs.put((done, cmd, kwargs))
    return done.result()


def _spawner(jobs: queue.SimpleQueue) -> None:
    while True:
        done, cmd, kwargs = jobs.get()
        try:
            done.set_result(subprocess.Popen(cmd, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.set_exception(e)
