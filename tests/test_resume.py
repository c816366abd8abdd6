"""Exact resume: N steps straight == N/2 steps, stop, resume, N; and a killed trainer process ends the run
with the last good checkpoint and the command to resume — no hang."""

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

from meshrl.config import (
    ModelConfig,
    OptimConfig,
    RunConfig,
    SFTConfig,
    SFTDataConfig,
    SFTRunConfig,
    TrainerConfig,
)
from meshrl.models.qwen3 import load_hf_state_dict
from meshrl.tasks.reverse import ReverseTaskConfig


def _cfg(out, name, *, num_procs=2, **run_kw):
    return SFTRunConfig(
        model=ModelConfig(flavor="tiny"),
        trainer=TrainerConfig(num_procs=num_procs, micro_batch_size=8),
        optim=OptimConfig(lr=3e-3, schedule="cosine", warmup_steps=2),
        sft=SFTConfig(max_steps=6, batch_size=16, eval_every=0, eval_generate=False),
        data=SFTDataConfig(shuffle_seed=7),
        reverse=ReverseTaskConfig(num_train=40, num_eval=8),
        run=RunConfig(output_dir=str(out), name=name, save_every=0, call_timeout_s=120, **run_kw),
    )


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["phase"] == "sft"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    from meshrl.controller import sft

    out = tmp_path_factory.mktemp("resume")
    summary = sft.main(_cfg(out, "straight"))
    return out, summary


@pytest.fixture(scope="module")
def stopped(straight):
    """The straight run's config stopped after step 3 (its checkpoint written), as run 'split', and a copy of that
    run directory as 'reshard': the two tests below resume the same stopped run, on 2 ranks and on 1."""
    import shutil

    from meshrl.controller import sft

    out, _ = straight
    stopped = sft.main(_cfg(out, "split", stop_at_step=3))
    assert stopped["stopped_at"] == 3
    shutil.copytree(out / "split", out / "reshard", ignore=shutil.ignore_patterns(".lock"))
    return out


def test_stop_and_resume_matches_a_straight_run_bitwise(stopped):
    from meshrl.controller import sft

    out = stopped
    sft.main(_cfg(out, "split", resume="latest"))
    a, b = _losses(out / "straight"), _losses(out / "split")
    assert [s for s, _ in b] == list(range(6))  # each step logged once: no step repeated or skipped
    assert a == b  # bitwise: deterministic data order, restored optimiser state and LR position
    wa = load_hf_state_dict(out / "straight" / "final_model")
    wb = load_hf_state_dict(out / "split" / "final_model")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_on_a_different_number_of_trainer_ranks(stopped):
    """DCP reshards on load: resume a 2-rank checkpoint on 1 rank. Not bitwise (the gradient reduction order
    changes with the rank count), so within a tight tolerance."""
    from meshrl.controller import sft

    out = stopped
    sft.main(_cfg(out, "reshard", num_procs=1, resume="latest"))
    a, b = _losses(out / "straight"), _losses(out / "reshard")
    assert [s for s, _ in b] == list(range(6))
    assert [x for _, x in b] == pytest.approx([x for _, x in a], rel=1e-4)


def test_killed_trainer_process_names_last_checkpoint_and_resume_command(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "meshrl.controller.sft",
        "--preset",
        "tiny-reverse-sft",
        "--sft.max-steps",
        "100000",
        "--sft.eval-every",
        "0",
        "--sft.no-eval-generate",
        "--sft.batch-size",
        "16",
        "--trainer.micro-batch-size",
        "8",
        "--run.save-every",
        "5",
        "--run.output-dir",
        str(tmp_path),
        "--run.name",
        "killme",
        "--run.call-timeout-s",
        "120",
        "--reverse.num-train",
        "100",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    pids, deadline = None, time.time() + 300
    for line in proc.stdout:
        if m := re.search(r"trainer processes \(pids\): \[([\d, ]+)\]", line):
            pids = [int(p) for p in m.group(1).split(",")]
            break
    assert pids, "the run did not report its trainer processes"
    ckpt_root = tmp_path / "killme" / "checkpoints"
    while not list(ckpt_root.glob("step_*")) and time.time() < deadline:
        time.sleep(0.5)
    os.kill(pids[1], signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the controller hung after a trainer process was killed")
    assert proc.returncode != 0
    assert "an actor process died" in err, err[-2000:]
    assert f"trainer rank 1 of 2 (pid {pids[1]}) died" in err, err[-2000:]  # which one (issue 31 item 17)
    assert re.search(r"last good checkpoint: .*checkpoints/step_\d{8}", err), err[-2000:]
    assert "--run.resume latest" in err and "--run.name killme" in err


def test_resume_command_repeats_the_run_flags_and_rng_state_round_trips_through_json(tmp_path):
    import random

    from meshrl.checkpoint import config_changes, resume_command, rng_state, set_rng_state

    ckpt = tmp_path / "runs" / "r1" / "checkpoints" / "step_00000004"
    flags = ["--preset", "tiny-reverse", "--run.name", "old", "--run.output-dir=/x", "--grpo.steps", "6"]
    flags += ["--run.stop-at-step", "2", "--grpo.dynamic-sampling", "--run.resume", "latest", "--optim.lr", "-1e-3"]
    assert resume_command("grpo", ckpt, flags) == (  # this interpreter: runnable as printed
        f"{shlex.quote(sys.executable)} -m meshrl.controller.grpo --preset tiny-reverse --grpo.steps 6 "
        f"--grpo.dynamic-sampling --optim.lr -1e-3 --run.output-dir {tmp_path / 'runs'} --run.name r1 "
        "--run.resume latest"
    )
    assert "no checkpoint" in resume_command("grpo", None, flags)

    rng = random.Random(3)
    rng.random()
    saved = json.loads(json.dumps(rng_state(rng)))
    want = [rng.random() for _ in range(5)]
    other = random.Random(0)
    set_rng_state(other, saved)
    assert [other.random() for _ in range(5)] == want

    old = {"grpo": {"steps": 6}, "run": {"name": "a"}, "task": {"reward_weights": {"char_match": 1.0}}}
    new = {"grpo": {"steps": 8}, "run": {"name": "b"}, "task": {"reward_weights": {"char_match": 1.0}}}
    assert config_changes(old, new) == ["grpo.steps: 6 -> 8"]  # run.* (placement, resume, saving) may differ
