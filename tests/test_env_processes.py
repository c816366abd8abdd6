"""Environments in environment processes (issue 31, item 13): a step that holds its interpreter (a C loop that never
releases the GIL) or kills its process costs its episodes, the process is replaced, and the controller never stops.

Real parts: real environment processes (meshrl.rollout.env_pool), real faults inside them (a catastrophic regex in
re's C matcher, a read of address 0, os.abort — tests/user_faults.py), a BPE tokenizer trained here. The generator
is a scripted function (what is under test is where environments run, not what the model says); the whole program
with a model is the last test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshrl.envs import EnvConfig
from meshrl.errors import ConfigError
from meshrl.rollout.env_pool import EnvWorkers
from meshrl.rollout.episode import EpisodeRenderer
from meshrl.rollout.render import RenderConfig, Renderer
from meshrl.rollout.runner import EpisodeLimits, EpisodeRunner, EpisodeStats
from meshrl.tasks.base import Row
from meshrl.types import Completion, SamplingParams

HERE = Path(__file__).parent
TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def renderer():
    from meshrl.tokenizer import default_corpus, train_bpe_tokenizer

    tok = train_bpe_tokenizer(default_corpus(50), 300)
    return EpisodeRenderer(Renderer(tok, RenderConfig(), stop_token_ids=[tok.eos_token_id]))


def scripted(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
    return [Completion(list(p), [5, 6], [-0.5, -0.25], "stop", 0) for p in prompts]


def rows(*kinds: str) -> list[Row]:
    return [Row(f"row {i}", answer="1", info={"kind": k}) for i, k in enumerate(kinds)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for this purpose
        return f.read().split(") ")[-1][0] != "Z"


def wait_for(predicate, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def pool():
    from user_faults import FaultEnv

    envs = EnvWorkers(FaultEnv, {}, 2, timeout_s=TIMEOUT_S)
    yield envs
    envs.close()


def _runner(renderer, envs) -> EpisodeRunner:
    return EpisodeRunner(None, renderer, scripted, EpisodeLimits(2, 128, 8, timeout_s=TIMEOUT_S), envs=envs)


def test_a_step_holding_the_interpreter_costs_its_episode_and_its_process_is_replaced(renderer, pool):
    """Episodes are placed in order on the least loaded process: row 0 on process 0, row 1 (the catastrophic
    regex) on process 1. The round ends at --env.timeout-s with the hung episode failed, the held process is killed
    (it answers no ping) and replaced, and the next round runs on the replacement."""
    run = _runner(renderer, pool)
    run.run(rows("ok", "ok"), 1, SamplingParams(), seed=0)  # both processes started
    held = pool.pids()[1]
    t0 = time.perf_counter()
    episodes = run.run(rows("ok", "gil"), 1, SamplingParams(), seed=0)
    took = time.perf_counter() - t0
    assert [e.outcome.finish_reason for e in episodes] == ["done", "env_timeout"]
    assert episodes[1].outcome.error == f"FaultEnv.step took over {TIMEOUT_S}s" and episodes[1].outcome.reward == 0
    assert TIMEOUT_S <= took < TIMEOUT_S + 2.0, took  # the controller's loop was never held
    assert EpisodeStats.of(episodes).values["env_failures"] == 1
    assert wait_for(lambda: pool.replaced) and wait_for(lambda: not alive(held)), "the held process was not killed"
    assert pool.replaced == ["held its interpreter: FaultEnv.step took over 1.5s (--env.timeout-s), and it answered "
                             "no ping for 2s"]  # fmt: skip
    assert pool.take_replaced() == 1 and pool.take_replaced() == 0
    episodes = run.run(rows("ok", "ok", "ok"), 1, SamplingParams(), seed=0)
    assert [e.outcome.finish_reason for e in episodes] == ["done"] * 3
    assert pool.pids()[1] != held and all(alive(p) for p in pool.pids())


@pytest.mark.parametrize("kind, signal_name", [("segv", "SIGSEGV"), ("abort", "SIGABRT")])
def test_a_step_that_kills_its_process_costs_its_episode_and_the_process_is_replaced(renderer, pool, kind, signal_name):
    run = _runner(renderer, pool)
    episodes = run.run(rows("ok", kind), 1, SamplingParams(), seed=0)
    assert [e.outcome.finish_reason for e in episodes] == ["done", "env_error"]
    error = episodes[1].outcome.error
    assert error.startswith("EnvProcessLost: its environment process 1 (pid "), error
    assert f"died (killed by {signal_name}) while running step" in error, error
    assert wait_for(lambda: pool.replaced) and pool.replaced == [f"died (killed by {signal_name})"]
    assert [e.outcome.finish_reason for e in run.run(rows("ok", "ok"), 1, SamplingParams(), seed=0)] == ["done"] * 2


def test_an_episode_that_fails_before_its_opening_still_trains_as_a_sequence_without_model_tokens(renderer, pool):
    """Its environment raised in reset (or was lost with its process before it): the row's prompt, reward 0, no
    model token, so the step's batch still takes it (it used to end the run: 'an episode needs at least 2 tokens')."""
    episodes = _runner(renderer, pool).run(rows("ok", "bad_reset"), 1, SamplingParams(), seed=0)
    failed = episodes[1]
    assert failed.outcome.finish_reason == "env_error" and failed.outcome.error == "RuntimeError: no such puzzle"
    assert failed.tokens.tokens == renderer.renderer.prompt_ids(rows("ok", "bad_reset")[1])
    assert failed.tokens.datum().num_loss_tokens == 0 and failed.outcome.num_turns == 0


def test_the_warm_up_demonstrations_run_in_the_processes_under_the_same_rules(renderer, pool):
    played = _runner(renderer, pool).demonstrations(rows("ok", "segv", "ok", "ok"))
    assert played[1].startswith("env_error: EnvProcessLost: its environment process 1") and "SIGSEGV" in played[1]
    assert all(not isinstance(p, str) and p.num_model_tokens > 0 for p in (played[0], played[2]))


def test_episodes_in_processes_equal_episodes_on_threads(renderer):
    """Where an environment runs never changes what it answers: the same episodes (tokens, rewards, messages) from
    processes as from the controller's threads, for a multi-turn built-in environment."""
    from meshrl.envs.guess_number import GuessNumberEnv

    cfg = EnvConfig(name="guess_number", workers=2, timeout_s=10)
    data = GuessNumberEnv.rows("train", 3, seed=0)
    limits = EpisodeLimits(3, 256, 8, timeout_s=10)
    envs = cfg.processes()
    try:
        in_processes = EpisodeRunner(None, renderer, scripted, limits, envs=envs).run(data, 2, SamplingParams(), 3)
    finally:
        envs.close()
    on_threads = EpisodeRunner(cfg.factory()[1], renderer, scripted, limits).run(data, 2, SamplingParams(), 3)
    assert [e.state() | {"env_time_s": 0} for e in in_processes] == [e.state() | {"env_time_s": 0} for e in on_threads]
    assert all(e.outcome.finish_reason != "env_error" for e in in_processes)


def test_environment_processes_die_with_a_killed_controller():
    """A controller SIGKILLed while its environment process is held by a step (no pipe read, no Python running
    there): the process dies with it (PR_SET_PDEATHSIG), nothing is left behind."""
    script = (
        "import sys, time\n"
        "from user_faults import FaultEnv\n"
        "from meshrl.rollout.env_pool import EnvWorkers\n"
        "from meshrl.tasks.base import Row\n"
        "pool = EnvWorkers(FaultEnv, {}, 1, timeout_s=600)\n"
        "env = pool.open().result(60)\n"
        "pool.call(env, '__init__').result(60)\n"
        "pool.call(env, 'reset', Row('x', info={'kind': 'gil'}), 0).result(60)\n"
        "pool.call(env, 'step', 'hi')\n"
        "print(pool.pids()[0], flush=True)\n"
        "time.sleep(600)\n"
    )
    controller = subprocess.Popen([sys.executable, "-c", script], cwd=HERE, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(controller.stdout.readline())
        time.sleep(0.5)  # the step is under way, holding the process's interpreter
        controller.send_signal(signal.SIGKILL)
        controller.wait(timeout=10)
        assert wait_for(lambda: not alive(worker), 10), "the environment process outlived its controller"
    finally:
        controller.kill()
        controller.wait()


def test_env_workers_flag_and_what_cannot_run_in_a_process():
    assert EnvConfig(name="calculator").num_workers() == min(8, max(2, os.cpu_count() or 1))
    assert EnvConfig(name="calculator", workers=0).processes() is None  # the controller's threads
    assert isinstance(EnvConfig(name="calculator", workers=3).processes(), EnvWorkers)
    with pytest.raises(ConfigError, match="--env.workers -1 must be >= 0"):
        EnvConfig(name="calculator", workers=-1)
    main_cls = type("MainEnv", (), {"__module__": "__main__"})
    with pytest.raises(ValueError, match="defined in the __main__ script.*--env.workers 0"):
        EnvWorkers(main_cls, {}, 1)
    with pytest.raises(ValueError, match="cannot be sent to an environment process"):
        EnvWorkers(EnvConfig, {"lock": __import__("threading").Lock()}, 1)


# ---- through the real program ------------------------------------------------------------------------------------
def test_a_run_whose_environment_hangs_holding_the_interpreter_or_segfaults_finishes(tmp_path, capfd):
    """The issue's run: `--env mymod:HangEnvGIL --env.timeout-s 5` stopped at RL step 2 and never moved again. Here
    every step has a row whose step holds the interpreter and one whose step segfaults: the run finishes, those
    episodes are counted failed, the processes are replaced, and the model is saved."""
    from meshrl.config import GRPORunConfig
    from meshrl.controller import grpo
    from meshrl.controller.cli import parse_run_config

    argv = [
        "--model.flavor", "tiny", "--generator.engine", "transformers",
        "--generator.max-model-len", "96", "--trainer.num-procs", "1", "--trainer.micro-batch-size", "8",
        "--warmup.steps", "0", "--grpo.steps", "2", "--grpo.prompts-per-step", "4", "--grpo.group-size", "2",
        "--env", "user_faults:FaultEnv", "--env.num-train", "4", "--env.num-eval", "4", "--env.timeout-s", "2",
        "--env.workers", "2", "--env.max-turns", "2", "--eval.every", "0", "--eval.samples", "0",
        "--run.save-every", "0", "--run.call-timeout-s", "120", "--run.output-dir", str(tmp_path), "--run.name", "f",
    ]  # fmt: skip
    t0 = time.perf_counter()
    summary = grpo.main(parse_run_config(GRPORunConfig, argv=argv))
    took = time.perf_counter() - t0
    records = [json.loads(line) for line in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert len(rl) == 2 and (tmp_path / "f" / "final_model").is_dir()
    for r in rl:  # 4 of the 8 episodes hold or kill their process; others sharing a process may go with it
        assert 4 <= r["env_failures"] <= 8 and r["env_processes_replaced"] >= 1, r
        assert sum(r["reward_failures_by_kind"].values()) == r["env_failures"]
    err = capfd.readouterr().err
    assert "held its interpreter: FaultEnv.step took over 2s" in err and "died (killed by SIGSEGV)" in err
    assert summary["task"] == "env:user_faults:FaultEnv", summary["task"]
    print(f"run took {took:.1f}s")
