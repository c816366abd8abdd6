"""Faults injected into real GRPO runs: does the run survive each one, or end with a resume command that works, and
is no sample lost or drawn twice? (issue 18: "Runs that survive faults and lose nothing")

    .venv/bin/python bench/faults.py      # every fault: prints the table, writes bench/results/faults-cpu.json
    .venv/bin/python bench/faults.py --only generator-sigkill,trainer-sigkill

Every fault is one run of `python -m meshrl.controller.grpo --preset tiny-reverse` (12 RL steps, a checkpoint every
3) in a temporary directory, beside one fault-free baseline run with the same flags. The tiny run's RL steps take a
fraction of a second, so a fault is placed by pausing the controller (SIGSTOP) once metrics.jsonl shows the wanted
RL step, injecting the fault, and letting the controller go on (SIGCONT). Reported for each fault:

- outcome: survived in-run (the run finished by itself, exit 0), ended with the resume command, refused, or other;
- detection: seconds from the fault to the controller's message about it (refusals: from the start to the exit);
- same samples: the run's RL records (after its resume, where it had one) equal the baseline's, timings and the
  restart count aside: losses, rewards, the prompts drawn and the groups trained, each step once;
- resume: the printed resume command, run as printed, runs to completion (or, where the controller could print
  nothing, `--run.resume latest`);
- leftovers: processes of the run (every descendant of the controller, tracked while it ran) still alive 30 s
  after the controller exited (60 s after a SIGKILL of the controller); they are killed then.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = 12
FLAGS = [
    "--preset", "tiny-reverse", "--warmup.steps", "2", "--warmup.batch-size", "16", "--grpo.steps", str(STEPS),
    "--grpo.prompts-per-step", "4", "--generator.engine", "transformers", "--trainer.micro-batch-size", "16",
    "--reverse.num-train", "18", "--reverse.num-eval", "4", "--run.save-every", "3", "--run.call-timeout-s", "120",
]  # fmt: skip
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
NOT_COMPARED = ("tokens_per_s", "replicas_restarted")  # and every time_* key
RUN_TIMEOUT_S = 600.0  # a run (or resume) still going after this long is hung: it is killed
GRACE_S = 30.0  # how long a run's processes may outlive its controller before they count as left over
EVIDENCE = re.compile(
    r"died|stopped answering|replaced by|run failed|interrupted|last good checkpoint|resume with|skipping checkpoint"
    r"|falling back|resumed from|in use by|already holds|config error|Error"
)


class FaultError(RuntimeError):
    """The fault could not be placed or the run did not do what was waited for."""


# ---- processes ---------------------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time, state) of process `pid`, None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[19]), fields[0]


def _processes() -> dict[int, tuple[int, int, str]]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            table[int(name)] = st
    return table


def _alive(pid: int, start: int) -> bool:
    """The process that had `pid` and `start` runs (a zombie has ended; a reused pid is another process)."""
    st = _stat(pid)
    return st is not None and st[1] == start and st[2] not in ("Z", "X")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


class Run:
    """One controller process: its stdout and stderr lines with their arrival times (two reader threads), and every
    process under it (a thread walks /proc), so that what outlives it is found, reported and killed."""

    def __init__(self, label: str, cmd: list[str], cwd: Path) -> None:
        self.label, self.cmd = label, cmd
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=cwd)
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self.tree: dict[int, int] = {}  # pid -> start time of every process seen under the controller
        self._stop = threading.Event()
        self.exit_code: int | None = None
        self.ended: float | None = None
        self.hung = False
        self.gone_at: float | None = None  # when the last of its processes was gone
        self.leftovers: list[str] = []  # "pid: command line" of those still alive after the grace time
        self._readers = [
            threading.Thread(target=self._read, args=(stream,), daemon=True)
            for stream in (self.proc.stdout, self.proc.stderr)
        ]
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        for t in (*self._readers, self._watcher):
            t.start()

    def _read(self, stream) -> None:
        for line in stream:  # text mode: tqdm's carriage returns end lines too
            with self._cond:
                self.lines.append((time.time(), line.rstrip("\n")))
                self._cond.notify_all()

    def _scan(self) -> None:
        if not self.tree and (st := _stat(self.proc.pid)) is not None:
            self.tree[self.proc.pid] = st[1]
        table, grew = _processes(), True
        while grew:
            grew = False
            for pid, (ppid, start, _) in table.items():
                if pid not in self.tree and self.tree.get(ppid) == table.get(ppid, (0, -1))[1]:
                    self.tree[pid], grew = start, True

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            self._scan()

    def wait_for(self, pattern: str, timeout_s: float = 300.0, since: float = 0.0) -> tuple[float, re.Match]:
        """The first line matching `pattern` that arrived at or after `since`: (its arrival time, the match)."""
        deadline, i, exited = time.time() + timeout_s, 0, None
        with self._cond:
            while True:
                for at, line in self.lines[i:]:
                    if at >= since and (m := re.search(pattern, line)):
                        return at, m
                i = len(self.lines)
                if self.proc.poll() is not None:
                    exited = exited or time.time()
                    if time.time() - exited > 3 or not any(t.is_alive() for t in self._readers):
                        raise FaultError(f"{self.label} ended (exit {self.proc.returncode}) without {pattern!r}")
                if time.time() > deadline:
                    raise FaultError(f"{self.label}: no line matching {pattern!r} within {timeout_s:.0f}s")
                self._cond.wait(1.0)

    def find(self, pattern: str) -> re.Match | None:
        """The last line matching `pattern` so far."""
        with self._cond:
            found = [m for _, line in self.lines if (m := re.search(pattern, line))]
        return found[-1] if found else None

    def pids(self, role: str) -> list[int]:
        """The pids the controller printed for `role` (trainer / generator / reward) at start."""
        _, m = self.wait_for(rf"{role} processes \(pids\): \[([\d, ]+)\]")
        return [int(p) for p in m.group(1).split(",")]

    def wait_step(self, run_dir: Path, step: int, timeout_s: float = 300.0) -> None:
        """Until metrics.jsonl holds the record of RL step `step` (or a later one)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if any(r["step"] >= step for r in rl_records(run_dir)):
                return
            if self.proc.poll() is not None:
                raise FaultError(f"{self.label} ended (exit {self.proc.returncode}) before RL step {step}")
            time.sleep(0.05)
        raise FaultError(f"{self.label} did not reach RL step {step} within {timeout_s:.0f}s")

    def paused(self, pid: int, sig: int) -> float:
        """Send `sig` to `pid` while the controller is stopped, so that the fault lands where the run is now;
        returns when it was sent."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            os.kill(pid, sig)
            return time.time()
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def finish(self, timeout_s: float = RUN_TIMEOUT_S, grace_s: float = GRACE_S) -> int:
        """Wait for the controller to exit (killed after `timeout_s`: hung), then up to `grace_s` for every process
        under it to be gone; those still alive then are recorded in `leftovers` and killed."""
        if self.exit_code is not None:
            return self.exit_code
        try:
            self.exit_code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.hung = True
            self.proc.kill()
            self.exit_code = self.proc.wait()
        self.ended = time.time()
        self._scan()
        self._stop.set()
        self._watcher.join()
        under = {pid: start for pid, start in self.tree.items() if pid != self.proc.pid}
        deadline = self.ended + grace_s
        while (alive := [p for p, s in under.items() if _alive(p, s)]) and time.time() < deadline:
            time.sleep(0.1)
        if not alive:
            self.gone_at = time.time()
        for pid in alive:
            self.leftovers.append(f"{pid}: {_cmdline(pid)[:100]}")
            if _alive(pid, under[pid]):
                os.kill(pid, signal.SIGKILL)
        for t in self._readers:
            t.join(timeout=5)
        return self.exit_code

    def text(self) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines)

    def evidence(self) -> list[str]:
        """The controller's lines about faults, failures and resumes, with seconds since the run started."""
        with self._cond:
            return [f"{self.label} +{at - self.started:.1f}s: {line.strip()[:400]}" for at, line in self.lines
                    if EVIDENCE.search(line) and "Warning" not in line]  # fmt: skip


# ---- results -----------------------------------------------------------------------------------------------------
def rl_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's RL records, without the timings and the restart count."""
    path, out = run_dir / "metrics.jsonl", []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # a line being written
            continue
        if r.get("phase") == "rl":
            out.append({k: v for k, v in r.items() if not k.startswith("time_") and k not in NOT_COMPARED})
    return out


@dataclass
class Result:
    fault: str
    how: str  # the fault, in words
    outcome: str = "other"
    exit_code: int | None = None
    detect_s: float | None = None
    same_samples: bool | None = None
    resume: str = "-"  # "ok", "FAILED (...)", "none printed", "-" (not needed)
    leftovers: list[str] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""
    messages: list[str] = field(default_factory=list)

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text


class Bench:
    """The temporary directory, the baseline's records, and the runs of the fault in progress."""

    def __init__(self, root: Path) -> None:
        self.root, self.out = root, root / "runs"
        self.runs: list[Run] = []
        self.baseline: list[dict] = []

    def run_dir(self, name: str) -> Path:
        return self.out / name

    def start(self, name: str, *extra: str, cmd: list[str] | None = None, label: str | None = None) -> Run:
        """The GRPO command line with the shared flags (or `cmd` as given), run `name` in the output directory."""
        if cmd is None:
            cmd = [sys.executable, "-m", "meshrl.controller.grpo", *FLAGS, *extra]
            cmd += ["--run.output-dir", str(self.out), "--run.name", name]
        run = Run(label or name, cmd, self.root)
        self.runs.append(run)
        return run

    def resume_printed(self, run: Run, r: Result) -> None:
        """Run the resume command `run` printed, exactly as printed, to its end."""
        m = run.find(r"resume with: (.+)$")
        if m is None:
            r.resume = "none printed"
            return
        again = self.start(run.label, cmd=shlex.split(m.group(1)), label=f"{run.label} (resume)")
        self._resumed(again, r, "ok")

    def resume_latest(self, name: str, r: Result, *extra: str) -> None:
        """`--run.resume latest` on run `name` (for a controller that could print nothing: SIGKILL)."""
        again = self.start(name, *extra, "--run.resume", "latest", label=f"{name} (resume)")
        self._resumed(again, r, "ok (--run.resume latest)")

    @staticmethod
    def _resumed(again: Run, r: Result, ok: str) -> None:
        code = again.finish()
        m = again.find(r"resumed from \S+/(step_\d+) at step (\d+)")
        if code == 0 and m:
            r.resume = ok
            r.add_note(f"resumed from {m.group(1)}")
        else:
            r.resume = f"FAILED (exit {code}{', hung' if again.hung else ''})"

    def compare(self, name: str, r: Result) -> None:
        """The run's RL records against the baseline's: r.same_samples, and what differs in the note."""
        got, want = rl_records(self.run_dir(name)), self.baseline
        r.same_samples = got == want
        if r.same_samples:
            return
        steps = [g["step"] for g in got]
        if steps != [w["step"] for w in want]:
            r.add_note(f"RL steps logged {steps}, the baseline's 0..{len(want) - 1}")
        for g, w in zip(got, want, strict=False):
            if g != w:
                keys = sorted(k for k in g.keys() | w.keys() if g.get(k) != w.get(k))
                r.add_note(f"step {g['step']} differs in {keys[:6]}")
                break

    def cleanup(self, r: Result) -> None:
        """Every run of this fault finished (a live one killed), its leftovers and messages into `r`."""
        for run in self.runs:
            run.finish(timeout_s=0 if run.proc.poll() is None else RUN_TIMEOUT_S)
            r.leftovers += [f"{x} ({run.label})" for x in run.leftovers]
            r.messages += run.evidence()
        self.runs = []


def _short(text: str, n: int = 160) -> str:
    return text if len(text) <= n else f"{text[: n // 2]} ... {text[-(n // 2 - 5) :]}"


def outcome(run: Run) -> str:
    if run.hung:
        return "hung (killed)"
    if run.exit_code == 0:
        return "survived in-run"
    if run.find(r"resume with: "):
        return "ended with resume command"
    return f"other (exit {run.exit_code})"


# ---- the faults --------------------------------------------------------------------------------------------------
def _replica_fault(b: Bench, r: Result, role: str, sig: int, *extra: str, heartbeat_s: float = 20.0) -> None:
    """One generator / reward process killed or frozen after RL step 4: replaced, requests sent again."""
    run = b.start(r.fault, *extra)
    (pid,) = run.pids(role)
    run.wait_step(b.run_dir(r.fault), 4)
    t = run.paused(pid, sig)
    at, m = run.wait_for(rf"{role} 0 \(pid {pid}\) (.*?): replacing it", since=t, timeout_s=heartbeat_s + 120)
    r.detect_s = at - t
    _, rep = run.wait_for(rf"{role} 0 replaced by pid (\d+) in ([\d.]+)s", since=at)
    r.add_note(f"{m.group(1)[:90]}; replaced in {rep.group(2)}s")
    run.finish()
    r.exit_code, r.outcome = run.exit_code, outcome(run)
    b.compare(r.fault, r)


def generator_sigkill(b: Bench, r: Result) -> None:
    _replica_fault(b, r, "generator", signal.SIGKILL)


def generator_sigstop_5s(b: Bench, r: Result) -> None:
    _replica_fault(b, r, "generator", signal.SIGSTOP, "--run.heartbeat-s", "5", heartbeat_s=5)


def generator_sigstop_20s(b: Bench, r: Result) -> None:
    _replica_fault(b, r, "generator", signal.SIGSTOP)  # the default --run.heartbeat-s 20


def reward_sigkill(b: Bench, r: Result) -> None:
    _replica_fault(b, r, "reward", signal.SIGKILL)


def reward_sigstop_5s(b: Bench, r: Result) -> None:
    _replica_fault(b, r, "reward", signal.SIGSTOP, "--run.heartbeat-s", "5", heartbeat_s=5)


def generator_killed_4x(b: Bench, r: Result) -> None:
    """The generator (and each replacement) killed after RL steps 1, 2, 3 and 5: the 4th is one past
    --run.max-restarts 3, and ends the run with the resume command."""
    run = b.start(r.fault, "--run.max-restarts", "3")
    (pid,) = run.pids("generator")
    for k, step in enumerate((1, 2, 3, 5)):
        run.wait_step(b.run_dir(r.fault), step)
        t = run.paused(pid, signal.SIGKILL)
        if k < 3:
            at, _ = run.wait_for(rf"generator 0 \(pid {pid}\) died", since=t)
            pid = int(run.wait_for(r"generator 0 replaced by pid (\d+)", since=at)[1].group(1))
    at, m = run.wait_for(r"run failed \((.*?)\): (.*)", since=t)
    r.detect_s = at - t
    r.add_note(f"4th kill after step {step}: {_short(m.group(2))}")
    run.finish()
    r.exit_code, r.outcome = run.exit_code, outcome(run)
    b.resume_printed(run, r)
    b.compare(r.fault, r)


def _trainer_fault(b: Bench, r: Result, sig: int) -> None:
    run = b.start(r.fault)
    pids = run.pids("trainer")
    run.wait_step(b.run_dir(r.fault), 4)
    t = run.paused(pids[1], sig)
    at, m = run.wait_for(r"run failed \((.*?)\): (.*)", since=t, timeout_s=RUN_TIMEOUT_S)
    r.detect_s = at - t
    r.add_note(f"rank 1 (pid {pids[1]}): {m.group(1)}: {_short(m.group(2))}")
    run.finish()
    r.exit_code, r.outcome = run.exit_code, outcome(run)
    if run.gone_at is not None:
        r.add_note(f"all its processes gone {run.gone_at - t:.1f}s after the fault")
    b.resume_printed(run, r)
    b.compare(r.fault, r)


def trainer_sigkill(b: Bench, r: Result) -> None:
    _trainer_fault(b, r, signal.SIGKILL)


def trainer_sigstop(b: Bench, r: Result) -> None:
    _trainer_fault(b, r, signal.SIGSTOP)  # no trainer heartbeat: until --run.call-timeout-s 120 (or supervision)


def _after_controller_kill(r: Result, run: Run, t: float) -> None:
    run.finish(grace_s=60)
    r.exit_code, r.outcome = run.exit_code, "killed (no message possible)"
    if run.gone_at is not None:
        r.add_note(f"actor processes gone {run.gone_at - t:.1f}s after the SIGKILL")
    else:
        r.add_note(f"{len(run.leftovers)} actor process(es) still alive 60s after the SIGKILL")


def controller_sigkill(b: Bench, r: Result) -> None:
    run = b.start(r.fault)
    run.pids("reward")
    run.wait_step(b.run_dir(r.fault), 4)
    os.kill(run.proc.pid, signal.SIGKILL)
    _after_controller_kill(r, run, time.time())
    b.resume_latest(r.fault, r)
    b.compare(r.fault, r)


def controller_sigterm(b: Bench, r: Result) -> None:
    run = b.start(r.fault)
    run.pids("reward")
    run.wait_step(b.run_dir(r.fault), 4)
    t = time.time()
    os.kill(run.proc.pid, signal.SIGTERM)
    at, m = run.wait_for(r"interrupted; last good checkpoint: \S+/(step_\d+|none yet)", since=t)
    r.detect_s = at - t
    run.finish()
    r.exit_code, r.outcome = run.exit_code, outcome(run)
    r.add_note(f"last good checkpoint {m.group(1)}")
    if run.gone_at is not None:
        r.add_note(f"all its processes gone {run.gone_at - t:.1f}s after the SIGTERM")
    b.resume_printed(run, r)
    b.compare(r.fault, r)


def controller_sigkill_during_save(b: Bench, r: Result) -> None:
    """The controller SIGKILLed during a checkpoint save after RL step 4: as soon as the trainer has written a file
    into the save's temporary directory (or, should every save be too quick for that, as soon as the save of step 9
    starts). The save never finishes, and `--run.resume latest` must take the checkpoint before."""
    run = b.start(r.fault)
    run.pids("reward")
    ckpts = b.run_dir(r.fault) / "checkpoints"
    run.wait_step(b.run_dir(r.fault), 4)
    deadline, tmp = time.time() + 300, None
    while tmp is None:  # the first save seen writing its files (else the last save, as soon as it starts)
        if run.proc.poll() is not None or time.time() > deadline:
            raise FaultError("no checkpoint save seen in progress")
        for d in ckpts.glob(".step_*.tmp"):
            try:
                if any(p.is_file() for p in d.rglob("*")) or int(d.name[6:14]) >= STEPS - 3:
                    tmp = d.name
            except OSError:  # committed (renamed) meanwhile
                pass
        if tmp is None:
            time.sleep(0.002)
    os.kill(run.proc.pid, signal.SIGKILL)
    t = time.time()
    written = sorted(str(p.relative_to(ckpts / tmp)) for p in (ckpts / tmp).rglob("*") if p.is_file())
    _after_controller_kill(r, run, t)
    r.add_note(f"killed while {tmp} held {len(written)} file(s), {'with' if 'COMPLETE' in written else 'no'} "
               f"COMPLETE")  # fmt: skip
    b.resume_latest(r.fault, r)
    b.compare(r.fault, r)


def _damaged_checkpoint(b: Bench, r: Result, damage: Callable[[Path], str]) -> None:
    """A copy of the finished baseline run whose newest checkpoint's largest trainer shard is damaged, then
    `--run.resume latest`: it must skip that checkpoint, say why, and re-run the steps after the one before."""
    from meshrl.checkpoint import CheckpointManager

    d = b.run_dir(r.fault)
    shutil.copytree(b.run_dir("baseline"), d, ignore=shutil.ignore_patterns(".lock"))
    newest = CheckpointManager(d).complete()[-1]
    shard = max((newest / "trainer").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    r.add_note(f"{newest.name}/{shard.relative_to(newest)} {damage(shard)}")
    run = b.start(r.fault, "--run.resume", "latest")
    at, m = run.wait_for(r"skipping checkpoint \S+/(step_\d+): (.*)")
    r.detect_s = at - run.started
    _, fell = run.wait_for(r"falling back to (step_\d+)")
    r.add_note(f"skipped {m.group(1)}: {m.group(2)[:100]}; fell back to {fell.group(1)}")
    run.finish()
    r.exit_code = run.exit_code
    resumed = run.find(r"resumed from \S+/(step_\d+) at step")
    r.outcome = "resumed from older checkpoint" if run.exit_code == 0 and resumed else outcome(run)
    r.resume = "ok (--run.resume latest)" if run.exit_code == 0 and resumed else f"FAILED (exit {run.exit_code})"
    if run.exit_code == 0:  # else the records are the copied baseline's: nothing to compare
        b.compare(r.fault, r)


def checkpoint_truncated(b: Bench, r: Result) -> None:
    def truncate(shard: Path) -> str:
        size = shard.stat().st_size
        with shard.open("r+b") as f:
            f.truncate(size // 2)
        return f"truncated {size} -> {size // 2} bytes"

    _damaged_checkpoint(b, r, truncate)


def checkpoint_bitflip(b: Bench, r: Result) -> None:
    def flip(shard: Path) -> str:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        return f"bit 0 of byte {len(data) // 2} flipped (same size)"

    _damaged_checkpoint(b, r, flip)


def second_run_on_live_dir(b: Bench, r: Result) -> None:
    """The same command again while the first run is live (its actor processes started): refused at once."""
    live = b.start(r.fault)
    live.pids("trainer")
    second = b.start(r.fault, label=f"{r.fault} (second)")
    second.finish(timeout_s=300)
    r.exit_code, r.detect_s = second.exit_code, second.ended - second.started
    refused = second.find(rf"is in use by a live run \(pid {live.proc.pid} ")
    started = second.find(r"processes \(pids\)")
    live_state = "still running" if live.proc.poll() is None else f"had ended (exit {live.proc.returncode})"
    r.outcome = "refused" if second.exit_code != 0 and refused and not started else outcome(second)
    r.add_note(f"refused after {r.detect_s:.1f}s while the first run {live_state}" if refused else second.text()[-200:])
    live.finish()
    r.add_note(f"the live run then ended with exit {live.exit_code}")
    b.compare(r.fault, r)  # the live run's own samples: untouched


def reused_name(b: Bench, r: Result) -> None:
    """The baseline's command again, same --run.name, no --run.resume: refused, the run's files untouched."""
    metrics = b.run_dir("baseline") / "metrics.jsonl"
    before = metrics.read_bytes()
    run = b.start("baseline", label=r.fault)
    run.finish(timeout_s=300)
    r.exit_code, r.detect_s = run.exit_code, run.ended - run.started
    refused = run.find(r"already holds a run \((.*?)\); a new run")
    started = run.find(r"processes \(pids\)")
    r.outcome = "refused" if run.exit_code != 0 and refused and not started else outcome(run)
    r.add_note(f"already holds a run ({refused.group(1)})" if refused else run.text()[-200:])
    unchanged = metrics.read_bytes() == before
    r.add_note("metrics.jsonl unchanged" if unchanged else "metrics.jsonl CHANGED")
    b.compare("baseline", r)
    r.same_samples = r.same_samples and unchanged


FAULTS: list[tuple[str, Callable[[Bench, Result], None], str]] = [
    ("generator-sigkill", generator_sigkill, "SIGKILL of the generator after RL step 4"),
    ("generator-sigstop-5s", generator_sigstop_5s, "SIGSTOP of the generator after step 4, --run.heartbeat-s 5"),
    ("generator-sigstop-20s", generator_sigstop_20s, "SIGSTOP of the generator after step 4, default heartbeat 20s"),
    ("reward-sigkill", reward_sigkill, "SIGKILL of the reward process after step 4"),
    ("reward-sigstop-5s", reward_sigstop_5s, "SIGSTOP of the reward process after step 4, --run.heartbeat-s 5"),
    ("generator-killed-4x", generator_killed_4x, "generator SIGKILLed 4 times, --run.max-restarts 3"),
    ("trainer-sigkill", trainer_sigkill, "SIGKILL of trainer rank 1 after step 4"),
    ("trainer-sigstop", trainer_sigstop, "SIGSTOP of trainer rank 1 after step 4 (--run.call-timeout-s 120)"),
    ("controller-sigkill", controller_sigkill, "SIGKILL of the controller after step 4"),
    ("controller-sigterm", controller_sigterm, "SIGTERM of the controller after step 4"),
    ("controller-sigkill-in-save", controller_sigkill_during_save, "SIGKILL of the controller during a save"),
    ("checkpoint-truncated", checkpoint_truncated, "newest checkpoint's largest shard cut to half, then resume"),
    ("checkpoint-bitflip", checkpoint_bitflip, "one bit of the newest checkpoint's largest shard flipped, resume"),
    ("second-run-live-dir", second_run_on_live_dir, "the same run started again on a live run's directory"),
    ("reused-name", reused_name, "a finished run's --run.name reused without --run.resume"),
]


# ---- main --------------------------------------------------------------------------------------------------------
def run_fault(b: Bench, name: str, fn: Callable[[Bench, Result], None], how: str) -> Result:
    r = Result(name, how)
    t0 = time.time()
    try:
        fn(b, r)
    except Exception as e:  # noqa: BLE001 - a fault that did not go as waited for is a result too
        r.add_note(f"{type(e).__name__}: {e}")
        unexpected(b, r)
    finally:
        b.cleanup(r)
    r.seconds = time.time() - t0
    return r


def unexpected(b: Bench, r: Result) -> None:
    """The fault's run did something other than what was waited for: say how it ended (a run still going is
    stopped), run the resume command if it printed one, and compare what it trained."""
    if not b.runs or r.fault == "reused-name":
        return
    run = b.runs[0]
    run.finish(timeout_s=0 if run.proc.poll() is None else RUN_TIMEOUT_S)
    r.exit_code, r.outcome = run.exit_code, outcome(run)
    if r.resume == "-" and run.find(r"resume with: "):
        b.resume_printed(run, r)
    if r.same_samples is None and (b.run_dir(r.fault) / "metrics.jsonl").exists():
        b.compare(r.fault, r)


def print_table(results: list[Result], tmp: str) -> None:
    def fmt(v: object) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "NO"
        if isinstance(v, float):
            return f"{v:.1f}"
        return str(v)

    head = f"{'fault':28} {'outcome':28} {'exit':>4} {'detect s':>8} {'same':>4} {'resume':24} "
    head += f"{'left':>4} {'s':>5}  note"
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        print(
            f"{r.fault:28} {r.outcome:28} {fmt(r.exit_code):>4} {fmt(r.detect_s):>8} {fmt(r.same_samples):>4} "
            f"{r.resume:24} {len(r.leftovers):>4} {r.seconds:>5.0f}  {r.note.replace(tmp, '$TMP')}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated fault names: " + ",".join(n for n, *_ in FAULTS))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "faults-cpu.json")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run directories (path printed)")
    args = ap.parse_args()
    wanted = [n for n in args.only.split(",") if n]
    if unknown := set(wanted) - {n for n, *_ in FAULTS}:
        ap.error(f"unknown fault(s) {sorted(unknown)}; known: {[n for n, *_ in FAULTS]}")
    faults = [f for f in FAULTS if not wanted or f[0] in wanted]

    t_start = time.time()
    tmp = tempfile.mkdtemp(prefix="meshrl-faults-")
    b = Bench(Path(tmp))
    results: list[Result] = []
    base_seconds = None
    try:
        print(f"baseline: {' '.join(FLAGS)}", flush=True)
        base = b.start("baseline")
        base.finish()
        base_seconds = time.time() - t_start
        b.baseline = rl_records(b.run_dir("baseline"))
        if base.exit_code != 0 or len(b.baseline) != STEPS:
            sys.exit(f"the baseline run failed (exit {base.exit_code}):\n{base.text()[-3000:]}")
        b.runs = []
        print(f"baseline: exit 0 in {base_seconds:.0f}s, {STEPS} RL steps", flush=True)
        for name, fn, how in faults:
            r = run_fault(b, name, fn, how)
            results.append(r)
            print(f"[{r.outcome}] {name}: {r.note.replace(tmp, '$TMP')} ({r.seconds:.0f}s)", flush=True)
    finally:
        for run in b.runs:  # interrupted: nothing of ours stays behind
            run.finish(timeout_s=0 if run.proc.poll() is None else 10, grace_s=5)
        if args.keep:
            print(f"runs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    total = time.time() - t_start
    survived = sum(r.outcome == "survived in-run" for r in results)
    print_table(results, tmp)
    for r in results:
        for left in r.leftovers:
            print(f"left over after {r.fault}: {left}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": {"cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0]},
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m meshrl.controller.grpo " + " ".join(FLAGS),
        "baseline_s": base_seconds and round(base_seconds, 1),
        "total_s": round(total, 1),
        "tried": len(results),
        "survived_in_run": survived,
        "faults": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(r).items()} for r in results],
    }
    args.out.write_text(json.dumps(record, indent=1).replace(tmp, "$TMP") + "\n")
    print(f"written: {args.out}; total {total / 60:.1f} min")
    print(f"faults tried / survived in-run: {len(results)} / {survived}")


if __name__ == "__main__":
    main()
