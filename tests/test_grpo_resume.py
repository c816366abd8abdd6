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
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _records(run_dir):
    """metrics.jsonl without the wall-clock fields."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k != "tokens_per_s"} for r in rows]


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
    """The same run on the command line; one trainer process is SIGKILLed once the first checkpoint exists."""
    cmd = [sys.executable, "-m", "meshrl.controller.grpo", *FLAGS, "--run.output-dir", str(out), "--run.name", "b"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    pids = None
    for line in proc.stdout:
        if m := re.search(r"trainer processes \(pids\): \[([\d, ]+)\]", line):
            pids = [int(p) for p in m.group(1).split(",")]
            break
    assert pids, "the run did not report its trainer processes"
    ckpts, deadline = out / "b" / "checkpoints", time.time() + 300
    while not list(ckpts.glob("step_*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    os.kill(pids[1], signal.SIGKILL)  # 4 RL steps are still to go: the kill lands mid-run
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
    assert re.search(r"last good checkpoint: .*/b/checkpoints/step_\d{8}\n", err), err[-2000:]
    command = re.search(r"resume with: (python -m meshrl\.controller\.grpo .*)", err)
    assert command and command.group(1).endswith("--run.name b --run.resume latest"), err[-2000:]
    assert "--grpo.steps 6" in command.group(1)  # the run's own flags are repeated: same config on resume


def test_resumed_run_equals_the_straight_run_bitwise(out, straight, killed):
    (a, summary_a), (_, err) = straight, killed
    command = shlex.split(re.search(r"resume with: (.*)", err).group(1))
    proc = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"resumed from .*step_\d{8} at step [24] ", proc.stdout), proc.stdout[-3000:]
    assert "supervised warm-up" not in proc.stdout  # done before the checkpoint: not repeated

    b = out / "b"
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


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_sigterm_ends_the_run_with_the_resume_command_and_cleans_up(out):
    """A scheduler's SIGTERM to the controller (preemption): the run stops with the last checkpoint and the resume
    command, its actor processes exit, and the shared weight buffer's files do not stay behind in /dev/shm."""
    shm_before = set(os.listdir("/dev/shm"))
    cmd = [sys.executable, "-m", "meshrl.controller.grpo", *FLAGS, "--run.output-dir", str(out), "--run.name", "c"]
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
    assert "interrupted; last good checkpoint: " in err and str(ckpts / "step_") in err, err[-2000:]
    assert "resume with: " in err and "--run.resume" in err, err[-2000:]
    assert all(_gone(pid, 30) for pid in pids), "trainer processes outlived the controller"
    left = [f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith("meshrl-wsync-")]
    assert not left, left
