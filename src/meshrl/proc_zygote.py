"""Actor processes forked from a warm process instead of started cold (opt-in: MESHRL_PROC_ZYGOTE=1).

Every Monarch process of a run is a new Python interpreter that imports torch, transformers and torchtitan before
it does anything: 4-6 CPU-s each on the 2-core CPU machine, most of the test suite's CPU (192 processes at 6.3 CPU-s,
2026-11-27, tests/README.md). The zygote is one process per controller that has imported them (`_preload`) and then
only forks: Monarch starts a
tiny client instead of `python -m monarch._src.actor.bootstrap_main` (`bootstrap_args`), the client hands the
zygote its argv, environment, working directory and standard streams, and the zygote forks a child that runs the
bootstrap module with them. The child is the actor process (its pid is the one the actor reports); the client
stays as what Monarch started: it forwards signals to the child and exits as the child did (its code, or killed by
the same signal), and if the client is killed the zygote kills the child. The same design as multiprocessing's
forkserver, which Monarch's own bootstrap uses for its children. Processes on this machine only (the local
placement, `meshrl.controller.provision`): processes on other hosts start as their host's Monarch starts them.

The zygote imports nothing of Monarch (its runtime starts threads, and a process that forks must have none) and
never touches CUDA, so each child starts its own runtime and CUDA context as a spawned process would. What a
preloaded module reads from the environment at import comes from the controller's environment, which meshrl's
processes inherit unchanged (their thread counts and devices are set at run time, after the fork). After the fork
the child reseeds numpy's global generator (Python's `random` reseeds itself), as a spawned process would differ.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

ENV_FLAG = "MESHRL_PROC_ZYGOTE"

# The client Monarch starts (`python -S -c CLIENT SOCKET ARGV...`): no site packages, ~15 ms. It sends a length-
# prefixed JSON header with its fds 0-2, reads the child's pid, forwards signals, and ends as the child ended.
CLIENT = r"""
import json, os, signal, socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
head = json.dumps({"argv": [sys.executable, *sys.argv[2:]], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
socket.send_fds(s, [struct.pack("!I", len(head)) + head], [0, 1, 2])
f = s.makefile("rb")
pid = int(f.readline())
for n in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(n, lambda n, _f: os.kill(pid, n))
end = f.readline().split()
if not end:
    sys.exit(1)
if end[0] == b"signal":
    n = int(end[1])
    if n != signal.SIGKILL:
        signal.signal(n, signal.SIG_DFL)
    os.kill(os.getpid(), n)
sys.exit(int(end[1]))
"""

_lock = threading.Lock()
_zygote: tuple[subprocess.Popen, str] | None = None


def enabled() -> bool:
    return os.environ.get(ENV_FLAG, "") == "1"


def bootstrap_args(args: list[str]) -> tuple[str, list[str]]:
    """The program and arguments that start `python -m MODULE ...` (`args`: Monarch's bootstrap command's) from
    this process's zygote, started here on first use."""
    if args[:1] != ["-m"] or len(args) < 2:
        raise ValueError(f"the process zygote starts `python -m MODULE ...` only, not python {args}")
    return sys.executable, ["-S", "-c", CLIENT, _ensure_zygote(), *args]


def _ensure_zygote() -> str:
    global _zygote
    with _lock:
        if _zygote is not None and _zygote[0].poll() is None:
            return _zygote[1]
        # A Unix socket's path holds at most 107 bytes: a long TMPDIR gives way to /tmp.
        where = None if len(tempfile.gettempdir()) < 64 else "/tmp"
        folder = tempfile.mkdtemp(prefix="meshrl-zygote-", dir=where)
        path = os.path.join(folder, "sock")
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshrl.proc_zygote", path, str(os.getpid())], stdout=subprocess.PIPE
        )
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the process zygote did not start (exit {proc.wait()})")
        atexit.register(shutil.rmtree, folder, True)
        atexit.register(proc.kill)
        _zygote = (proc, path)
        return path


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the client closed before sending its request")
        data += more
    (size,) = struct.unpack("!I", data[:4])
    return json.loads(data[4 : 4 + size]), list(fds)


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the process the client asked for, then run Monarch's bootstrap module."""
    import runpy

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for n in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(n, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    import numpy as np

    np.random.seed()
    argv = request["argv"]  # [python, "-m", MODULE, ...] (bootstrap_args checked it)
    sys.argv = [argv[0], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


def _preload() -> None:
    """What every actor process imports, heaviest first (CPU-s each on the 2-core machine): torch 2.0, the trainer's
    torchtitan model (its import-time torch.compile calls deferred, meshrl.models.titan_import) 2.3, transformers'
    auto classes 1-3 (the hf trainer, the transformers engine, tokenizers), DTensor 0.8. None of them starts a
    thread or touches CUDA when imported."""
    import numpy  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    try:
        from meshrl.models.titan_import import import_torchtitan_qwen3

        import_torchtitan_qwen3()
    except ImportError:  # torchtitan is optional for the hf backend
        pass


def serve(path: str, parent_pid: int) -> None:
    """The zygote: preload, then fork a child per request until the controller that started it is gone."""
    _preload()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}  # child pid -> its client's connection
    print("ready", flush=True)
    while True:
        if os.getppid() != parent_pid:  # the controller is gone: so are its processes
            for pid in children:
                _kill(pid)
            return
        ready, _, _ = select.select([listener, wake_r, *children.values()], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        if listener in ready:
            conn, _ = listener.accept()
            try:
                request, fds = _recv_request(conn)
            except (OSError, EOFError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for c in children.values():
                    c.close()
                os.close(wake_r)
                os.close(wake_w)
                signal.set_wakeup_fd(-1)
                code = 0
                try:
                    _run_child(request, fds)
                except SystemExit as e:  # as the interpreter treats it: None is 0, a message is printed and 1
                    code = e.code or 0
                    if not isinstance(code, int):
                        print(code, file=sys.stderr)
                        code = 1
                except BaseException:  # noqa: BLE001 - reported as a spawned interpreter would
                    import traceback

                    traceback.print_exc()
                    code = 1
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        for pid, conn in list(children.items()):
            if conn in ready and not conn.recv(1, socket.MSG_PEEK):  # the client is gone: so goes its process
                _kill(pid)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            end = (
                f"signal {os.WTERMSIG(status)}"
                if os.WIFSIGNALED(status)
                else f"exit {os.waitstatus_to_exitcode(status)}"
            )
            try:
                conn.sendall(f"{end}\n".encode())
            except OSError:
                pass
            conn.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
