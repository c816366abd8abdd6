"""GRPO checkpoint and resume on real meshes (2 FSDP trainer processes, a generator, a reward actor).

A run whose trainer process is killed mid-run ends with the last good checkpoint and the command to resume;
running that command finishes the run, and the result equals a straight run bitwise: every metrics record
(losses, rewards, the prompts drawn, evaluations before and after RL; timings aside) and the final weights.
Bitwise holds because the controller's RNG is all the randomness (prompt draws and per-round generation
seeds, from which the engine derives every sample's noise) and it is checkpointed with the trainer's model and
optimiser."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from procs import ENV, gone

from meshrl.config import GRPORunConfig
from meshrl.controller.cli import parse_run_config
from meshrl.models.qwen3 import load_hf_state_dict

STEPS = 6
# Both engines resume bitwise; 'transformers' starts faster on 2 cores (about 1.7x less wall time for this
# module). Set "vllm" to check the vLLM engine (per-request seeds: SamplingParams.seed + i * n + j).
ENGINE = "transformers"
FLAGS = [
    "--preset",
    "tiny-reverse",
    "--warmup.steps",
    "2",
    "--warmup.batch-size",
    "16",
    "--grpo.steps",
    str(STEPS),
    "--grpo.prompts-per-step",
    "4",
    "--generator.engine",
    ENGINE,
    "--grpo.dynamic-sampling",  # its refill rounds draw from the same RNG: covered by the bitwise check
    "--trainer.micro-batch-size",
    "16",
    # 18 training prompts, >= 24 drawn: the run crosses an epoch boundary, and is checkpointed mid-epoch (the data
    # cursor is part of the checkpoint). Evaluation during RL (greedy + 2 samples per prompt) is part of the records.
    "--reverse.num-train",
    "18",
    "--reverse.num-eval",
    "4",
    "--eval.every",
    "3",
    "--eval.samples",
    "2",
    "--run.save-every",
    "2",
    "--run.call-timeout-s",
    "120",
]


def _records(run_dir):
    """metrics.jsonl without the measurements that differ from run to run: wall-clock times and memory readings."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    drop = ("time_", "tokens_per_s", "memory/")
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("grpo_resume")


@pytest.fixture(scope="module")
def straight(out):
    from meshrl.controller import grpo

    summary = grpo.main(parse_run_config(GRPORunConfig, argv=[*FLAGS, "--run.output-dir", str(out), "--run.name", "a"]))
    return out / "a", summary


@pytest.fixture(scope="module")
def killed(out):
    """The same run on the command line; one trainer process is SIGKILLed once the step-4 checkpoint exists (the
    controller is paused meanwhile, so that the kill lands mid-run: the run's steps take a fraction of a second)."""
    cmd = [sys.executable, "-m", "meshrl.controller.grpo", *FLAGS, "--run.output-dir", str(out), "--run.name", "b"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    pids = None
    for line in proc.stdout:
        if m := re.search(r"trainer processes \(pids\): \[([\d, ]+)\]", line):
            pids = [int(p) for p in m.group(1).split(",")]
            break
    assert pids, "the run did not report its trainer processes"
    checkpoint, deadline = out / "b" / "checkpoints" / "step_00000004", time.time() + 300
    while not checkpoint.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert checkpoint.exists(), "the run wrote no checkpoint at step 4"
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        os.kill(pids[1], signal.SIGKILL)  # 2 RL steps are still to go
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the controller hung after a trainer process was killed")
    return proc.returncode, err


def test_killed_trainer_process_names_last_checkpoint_and_resume_command(killed):
    returncode, err = killed
    assert returncode != 0
    assert "an actor process died" in err, err[-2000:]
    assert re.search(r"trainer rank 1 of 2 \(pid \d+\)", err), err[-2000:]  # which one died (issue 31 item 17)
    assert re.search(r"last good checkpoint: .*/b/checkpoints/step_\d{8}\n", err), err[-2000:]
    command = re.search(r"resume with: (\S+) (-m meshrl\.controller\.grpo .*)", err)
    assert command and command.group(2).endswith("--run.name b --run.resume latest"), err[-2000:]
    assert shlex.split(command.group(1)) == [sys.executable]  # the project's interpreter: runnable as printed
    assert "--grpo.steps 6" in command.group(2)  # the run's own flags are repeated: same config on resume


def test_resume_skips_a_damaged_newest_checkpoint_and_equals_the_straight_run_bitwise(out, straight, killed):
    """The killed run's newest checkpoint (step 4) has one byte of a trainer shard changed in place (same size: only
    the checksum tells). The resume command, run as printed, says it skips that checkpoint and why, resumes from
    step 2 and finishes the run, which equals the straight run bitwise."""
    from meshrl.checkpoint import CheckpointManager

    (a, summary_a), (_, err) = straight, killed
    b = out / "b"
    newest = CheckpointManager(b).complete()[-1]
    assert newest.name == "step_00000004"
    shard = max((newest / "trainer").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))

    command = shlex.split(re.search(r"resume with: (.*)", err).group(1))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV)  # as printed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"skipping checkpoint {newest}: trainer/{shard.relative_to(newest / 'trainer')} does not match" in (
        proc.stdout
    ), proc.stdout[-3000:]
    assert "falling back to step_00000002" in proc.stdout
    assert re.search(r"resumed from .*step_00000002 at step 2 ", proc.stdout), proc.stdout[-3000:]
    assert "supervised warm-up" not in proc.stdout  # done before the checkpoint: not repeated

    ra, rb = _records(a), _records(b)
    assert [r["step"] for r in rb if r["phase"].startswith("rl")] == list(range(STEPS))  # each step once
    assert [r["phase"] for r in rb if not r["phase"].startswith("rl")] == ["warmup"] * 2 + ["eval"] * 3
    assert [r["prompts"] for r in rb if r["phase"] == "rl"] == [r["prompts"] for r in ra if r["phase"] == "rl"]
    epochs = [r["epoch"] for r in rb if r["phase"] == "rl"]
    assert epochs[0] < 1 < epochs[-1]  # the data cursor crossed an epoch boundary
    assert rb == ra  # losses, rewards, grad norms, policy versions, evaluations: bitwise
    summary_b = json.loads((b / "summary.json").read_text())
    for key in ("reward_first5_mean", "reward_last5_mean", "eval_accuracy_before_rl", "eval_accuracy_after_rl"):
        assert summary_b[key] == summary_a[key]
    wa, wb = load_hf_state_dict(a / "final_model"), load_hf_state_dict(b / "final_model")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sigterm_ends_the_run_with_the_resume_command_and_cleans_up(out):
    """A scheduler's SIGTERM to the controller (preemption): the run stops with the last checkpoint and the resume
    command, its actor processes exit, and the shared weight buffer's files do not stay behind in /dev/shm."""
    shm_before = set(os.listdir("/dev/shm"))
    cmd = [sys.executable, "-m", "meshrl.controller.grpo", *FLAGS, "--run.output-dir", str(out), "--run.name", "c"]
    cmd += ["--trainer.num-procs", "1"]  # what a SIGTERM ends is the point, not ranks (~10 CPU-s less on 2 cores)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    pids = None
    for line in proc.stdout:
        if m := re.search(r"trainer processes \(pids\): \[([\d, ]+)\]", line):
            pids = [int(p) for p in m.group(1).split(",")]
            break
    assert pids, "the run did not report its trainer processes"
    ckpts, deadline = out / "c" / "checkpoints", time.time() + 300
    while not list(ckpts.glob("step_*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the controller did not stop on SIGTERM")
    assert proc.returncode == 130, err[-2000:]
    # The step under way when SIGTERM came was finished and saved (issue 31 item 17), after the step-2 checkpoint.
    stopped = re.search(r"stopped after step (\d+) on SIGTERM; checkpoint (\S+)", err)
    assert stopped and int(stopped.group(1)) > 2, err[-2000:]
    saved = ckpts / f"step_{int(stopped.group(1)):08d}"
    assert stopped.group(2) == str(saved) and saved.is_dir(), err[-2000:]
    assert f"interrupted; last good checkpoint: {saved}\n" in err, err[-2000:]
    assert "resume with: " in err and "--run.resume" in err, err[-2000:]
    assert all(gone(pid, 30) for pid in pids), "trainer processes outlived the controller"
    left = [f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith("meshrl-wsync-")]
    # Another run on this machine (a test run beside this one) holds its own files: named by its live pid.
    left = [f for f in left if not (f.split("-")[2].isdigit() and os.path.exists(f"/proc/{f.split('-')[2]}"))]
    assert not left, left


def test_a_run_name_in_use_is_refused_without_resume(out, straight):
    """Running a finished run's name again without --run.resume would overwrite its model and mix its metrics:
    refused before any process starts, saying how to continue it or where else to go."""
    from meshrl.controller import grpo
    from meshrl.errors import ConfigError

    a, _ = straight
    before = (a / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"already holds a run \(2 checkpoint\(s\), the newest step_00000006\)"):
        grpo.main(parse_run_config(GRPORunConfig, argv=[*FLAGS, "--run.output-dir", str(out), "--run.name", "a"]))
    assert (a / "metrics.jsonl").read_text() == before
    cli = subprocess.run(
        [sys.executable, "-m", "meshrl.controller.grpo", *FLAGS, "--run.output-dir", str(out), "--run.name", "a"],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert cli.returncode != 0 and "--run.resume latest" in cli.stderr and "another --run.name" in cli.stderr
    assert "processes (pids)" not in cli.stdout


class _Lines:
    """A process's stdout and stderr lines as they come, with their arrival times (read by two threads)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import queue
        import threading

        self.queue, self.seen = queue.Queue(), []
        for stream in (proc.stdout, proc.stderr):
            threading.Thread(
                target=lambda s=stream: [self.queue.put((time.time(), ln)) for ln in s], daemon=True
            ).start()

    def wait_for(self, pattern: str, timeout_s: float = 300) -> tuple[float, re.Match]:
        for at, line in self.seen:  # already read
            if m := re.search(pattern, line):
                return at, m
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                at, line = self.queue.get(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty: keep waiting
                continue
            self.seen.append((at, line))
            if m := re.search(pattern, line):
                return at, m
        raise AssertionError(f"no line matching {pattern!r} in {timeout_s}s; last lines: {self.seen[-20:]}")


def _wait_for_step(run_dir, step: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(r.get("phase") == "rl" and r["step"] >= step for r in _records(run_dir)):
            return
        time.sleep(0.1)
    raise AssertionError(f"the run did not reach RL step {step}")


def test_generator_and_reward_processes_killed_or_frozen_are_replaced_and_the_run_trains_the_same(out, straight):
    """The run of `straight`, on the command line, with three faults: the generator is SIGKILLed after RL step 0,
    its replacement is SIGSTOPped (frozen: only the heartbeat can tell) after step 2, the reward process is
    SIGKILLed after step 3. Each is replaced and its requests are sent again, so the run finishes and trains
    exactly what the fault-free run trained: every record equal but the timings and the restart count. (The tiny
    run's steps take a fraction of a second: the controller is paused while each fault is injected, so that the
    fault lands before the run is over.) Meanwhile a second run on the same directory is refused: it is in use."""
    heartbeat_s, second = 5.0, None
    cmd = [sys.executable, "-m", "meshrl.controller.grpo", *FLAGS, "--run.output-dir", str(out), "--run.name", "f"]
    cmd += ["--run.heartbeat-s", str(heartbeat_s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    lines, run_dir = _Lines(proc), out / "f"
    try:
        (generator,) = map(int, lines.wait_for(r"generator processes \(pids\): \[(\d+)\]")[1].groups())
        (reward,) = map(int, lines.wait_for(r"reward processes \(pids\): \[(\d+)\]")[1].groups())
        second = subprocess.Popen(  # a resume as much as a new run: refused before it starts anything
            [*cmd, "--run.resume", "latest"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
        )

        def while_paused(pid: int, sig: int) -> float:
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                os.kill(pid, sig)
                return time.time()
            finally:
                os.kill(proc.pid, signal.SIGCONT)

        _wait_for_step(run_dir, 0, proc)
        while_paused(generator, signal.SIGKILL)
        lines.wait_for(rf"generator 0 \(pid {generator}\) died .*: replacing it \(1 of run.max_restarts=3\)")
        replacement = int(lines.wait_for(r"generator 0 replaced by pid (\d+)")[1].group(1))

        _wait_for_step(run_dir, 2, proc)
        stopped_at = while_paused(replacement, signal.SIGSTOP)
        detected_at, _ = lines.wait_for(
            rf"generator 0 \(pid {replacement}\) stopped answering: no heartbeat for 5s .*\(2 of run.max_restarts=3\)"
        )
        lines.wait_for(r"generator 0 replaced by pid (\d+)")

        _wait_for_step(run_dir, 3, proc)
        while_paused(reward, signal.SIGKILL)
        lines.wait_for(rf"reward 0 \(pid {reward}\) died .*\(3 of run.max_restarts=3\)")
        lines.wait_for(r"reward 0 replaced by pid (\d+)")
        assert proc.wait(timeout=600) == 0, "".join(line for _, line in lines.seen[-40:])
        _, refused = second.communicate(timeout=120)
        assert second.returncode != 0 and f"is in use by a live run (pid {proc.pid} " in refused, refused
    finally:
        for p in (proc, second):
            if p is not None and p.poll() is None:
                p.kill()
    # Frozen while idle between steps or busy generating: detected on the next call, within the heartbeat window
    # of that call's first poll; the time between steps (training, on 2 cores) comes on top.
    print(f"frozen generator detected {detected_at - stopped_at:.1f}s after SIGSTOP (heartbeat {heartbeat_s}s)")
    assert gone(replacement, 30)  # the frozen process was killed, not left behind

    def comparable(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "replicas_restarted"} for r in records]

    faulted = _records(run_dir)
    restarts = [r["replicas_restarted"] for r in faulted if r["phase"] == "rl"]
    assert restarts == sorted(restarts) and restarts[0] == 0 and restarts[-1] == 3, restarts
    assert comparable(faulted) == comparable(_records(straight[0]))  # no sample lost, none drawn twice


def test_a_frozen_trainer_rank_ends_the_run_named_as_frozen_within_the_heartbeat(out):
    """A trainer rank cannot be replaced (the ranks hold the optimiser state), but a frozen one (SIGSTOP) is told
    apart from a dead one and ends the run within the heartbeat window of the call waiting on it — not after
    Monarch's supervision timeout or the call timeout — with the resume command; no rank is left behind."""
    cmd = [sys.executable, "-m", "meshrl.controller.grpo", *FLAGS, "--run.output-dir", str(out), "--run.name", "z"]
    proc = subprocess.Popen(
        [*cmd, "--run.heartbeat-s", "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    lines = _Lines(proc)
    try:
        pids = [int(p) for p in lines.wait_for(r"trainer processes \(pids\): \[([\d, ]+)\]")[1].group(1).split(",")]
        _wait_for_step(out / "z", 2, proc)  # the checkpoint of step 2 is written
        os.kill(proc.pid, signal.SIGSTOP)
        os.kill(pids[1], signal.SIGSTOP)
        stopped_at = time.time()
        os.kill(proc.pid, signal.SIGCONT)
        detected_at, _ = lines.wait_for(
            r"run failed \(an actor process stopped answering\): .*a trainer process .*"
            r"stopped answering: no heartbeat for 5s \(frozen or hung, not dead\)"
        )
        lines.wait_for(r"last good checkpoint: .*/z/checkpoints/step_00000002")
        lines.wait_for(r"resume with: .* --run.name z --run.resume latest")
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert detected_at - stopped_at < 60, detected_at - stopped_at
    assert all(gone(pid, 30) for pid in pids), "trainer processes outlived the run"
