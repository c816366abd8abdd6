"""The asynchronous GRPO loop (--grpo.max-staleness K) on real meshes (a trainer process, a generator,
reward processes): generation runs one step ahead of training.

Staleness is exactly what the schedule says (0 for the first step, then K), never over K; timing never changes
what is trained (a run whose scoring is slow and whose trainer is far slower than the generator equals a fast one
bitwise); a run whose generator dies with a round in flight ends with the resume command, and resuming it equals
the straight run bitwise, the rounds in flight at the checkpoint included.

Two runs of the program and one resume: the straight run (in this process), and the same run on the command line
with slow scoring and a slow trainer, whose generator is SIGKILLed after its step-2 checkpoint, resumed as printed.
(`--run.stop-at-step` in the asynchronous loop is checked by tests/test_envs_e2e.py's rubric + asynchronous test.)"""

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
from procs import ENV

from meshrl.config import GRPORunConfig
from meshrl.controller.cli import parse_run_config
from meshrl.models.qwen3 import load_hf_state_dict

STEPS = 5
FLAGS = [
    "--preset", "tiny-reverse", "--warmup.steps", "2", "--warmup.batch-size", "16", "--grpo.steps", str(STEPS),
    "--grpo.prompts-per-step", "4", "--generator.engine", "transformers", "--grpo.dynamic-sampling",
    "--trainer.num-procs", "1",  # several ranks resume bitwise in test_grpo_resume; here: the loop running ahead
    "--log.plots",  # timeline.png (the test suite turns plots off elsewhere)
    "--trainer.micro-batch-size", "16", "--reverse.num-train", "18", "--reverse.num-eval", "4", "--eval.every", "2",
    "--eval.samples", "2", "--run.save-every", "2", "--run.call-timeout-s", "120", "--grpo.max-staleness", "1",
    # The task's reward, plus a function from this module that adds 0 (slowly where REWARD_DELAY is set).
    "--reward", "char_match=0.5,exact_match=0.5,test_grpo_async:extra_reward=1.0",
]  # fmt: skip
REWARD_DELAY = "MESHRL_TEST_REWARD_DELAY_S"  # read in the reward processes, which inherit the run's environment


def _records(run_dir):
    """metrics.jsonl without the measurements that differ from run to run: wall-clock times and memory readings."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    drop = ("time_", "tokens_per_s", "memory/")
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


def extra_reward(completion: str, row: dict) -> float:
    """Scores nothing (0); slowly where REWARD_DELAY is set: the controller then falls behind the generators."""
    time.sleep(float(os.environ.get(REWARD_DELAY, "0")))
    return 0.0


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("grpo_async")


@pytest.fixture(scope="module")
def straight(out):
    from meshrl.controller import grpo

    summary = grpo.main(parse_run_config(GRPORunConfig, argv=[*FLAGS, "--run.output-dir", str(out), "--run.name", "a"]))
    return out / "a", summary


def test_async_run_staleness_and_overlap(straight):
    a, summary_a = straight
    rl = [r for r in _records(a) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == list(range(STEPS))
    assert rl[0]["staleness_max"] == 0  # the first round was sampled from the weights RL starts from
    for r in rl[1:]:
        # Sampled one version before the trainer's; dynamic sampling's refills (if any) at the trainer's version.
        assert r["staleness_max"] == 1 and set(r["staleness_hist"]) <= {"0", "1"}
        assert r["groups_dropped_stale"] == 0
    assert all(r["staleness_max"] <= 1 for r in rl)
    assert all("reward/test_grpo_async:extra_reward" in r for r in rl)  # the function from this module scored
    # The timeline shows the overlap: the generator sampled the next step while the trainer trained this one.
    intervals = [json.loads(line) for line in (a / "timeline.jsonl").read_text().splitlines()]
    gens = [i for i in intervals if i["actor"].startswith("generator") and i["what"] == "generate"]
    trains = [i for i in intervals if i["actor"].startswith("trainer") and i["what"] == "forward_backward"]
    assert any(g["start"] < t["end"] and t["start"] < g["end"] for g in gens for t in trains)
    assert (a / "timeline.png").stat().st_size > 0 and summary_a["timeline"] == str(a / "timeline.jsonl")


def test_slow_run_whose_generator_is_killed_with_a_round_in_flight_resumes_to_the_straight_run(out, straight):
    """The straight run on the command line, with slow scoring (the controller falls behind) and a trainer far
    slower than the generator (`custom_algorithms:slow_grpo`): the generators get further ahead in wall time, never
    in versions. Its generator process dies after the step-2 checkpoint, while a round is in flight: the run ends
    naming the last good checkpoint and the command to resume; that checkpoint holds the round in flight; resuming
    (slow too) finishes the run, and it equals the straight run bitwise (no trained sample lost, the final weights
    and the evaluation after RL included). (Steps take a fraction of a second: the controller is paused while the
    generator is killed, so that it dies mid-run.)"""
    a, summary_a = straight
    env = {**ENV, REWARD_DELAY: "0.05"}
    flags = [*FLAGS, "--grpo.loss", "custom_algorithms:slow_grpo", "--run.output-dir", str(out), "--run.name", "k"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrl.controller.grpo", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        pids = None
        for line in proc.stdout:
            if m := re.search(r"generator processes \(pids\): \[([\d, ]+)\]", line):
                pids = [int(p) for p in m.group(1).split(",")]
                break
        assert pids, "the run did not report its generator processes"
        # The async loop on CPU runs the generator's working thread at niceness +10 (the trainer ranks first).
        want = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
        tids = [int(t) for t in os.listdir(f"/proc/{pids[0]}/task")]
        assert want in {os.getpriority(os.PRIO_PROCESS, t) for t in tids}
        checkpoint, deadline = out / "k" / "checkpoints" / "step_00000002", time.time() + 300
        while not checkpoint.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert checkpoint.exists(), "the run wrote no checkpoint at step 2"
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            os.kill(pids[0], signal.SIGKILL)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "an actor process died" in err, err[-2000:]
    assert re.search(r"last good checkpoint: .*/k/checkpoints/step_\d{8}\n", err), err[-2000:]
    # Step 2's round, sampled during step 1 (in flight at the checkpoint), saved with its completions.
    state = json.loads((checkpoint / "controller.json").read_text())
    assert list(state["rollouts"]) == ["2"] and state["rollouts"]["2"], state.get("rollouts")
    command = shlex.split(re.search(r"resume with: (.*)", err).group(1))
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)  # as printed
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert re.search(r"resumed from .*step_00000002 at step 2 ", resumed.stdout), resumed.stdout[-3000:]
    assert _records(out / "k") == _records(a)
    summary_k = json.loads((out / "k" / "summary.json").read_text())
    assert summary_k["eval_accuracy_after_rl"] == summary_a["eval_accuracy_after_rl"]
    wa, wk = load_hf_state_dict(a / "final_model"), load_hf_state_dict(out / "k" / "final_model")
    assert wa.keys() == wk.keys() and all(torch.equal(wa[k], wk[k]) for k in wa)
