"""GRPO with an environment in the loop, on real meshes (2 FSDP trainer processes, a generator; no reward
processes: the environment scores its episodes).

A run on the calculator environment logs the episode metrics; the trainer's logprobs equal the generator's at the
model tokens of every multi-turn episode (the parity check the single-turn loop logs); a run stopped mid-way and
resumed equals the straight run bitwise; a user's environment that raises or hangs costs its episodes, not the run.
"""

import json

import pytest

from meshrl.config import GRPORunConfig
from meshrl.controller.cli import parse_run_config
from meshrl.errors import ConfigError

STEPS = 4
FLAGS = [
    "--preset",
    "tiny-calculator",
    "--warmup.steps",
    "3",
    "--warmup.batch-size",
    "16",
    "--grpo.steps",
    str(STEPS),
    "--grpo.prompts-per-step",
    "2",
    "--grpo.group-size",
    "4",
    "--trainer.num-procs",  # one rank: environments are the point here (the 'flaky' run below takes two)
    "1",
    "--trainer.micro-batch-size",
    "8",
    "--generator.engine",
    "transformers",
    "--env.num-train",
    "40",
    "--env.num-eval",
    "4",
    "--env.batches",
    "2",
    "--eval.every",
    "2",
    "--eval.samples",
    "2",
    "--run.save-every",
    "2",
    "--run.call-timeout-s",
    "120",
]


def _records(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    drop = ("time_", "tokens_per_s", "env_time_per_episode_s", "memory/")  # measurements, not what is trained
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


def _refused(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        parse_run_config(GRPORunConfig, argv=argv)
    said = " ".join((str(e.value.code) + capsys.readouterr().err).replace("│", " ").split())
    assert message in said, said


def test_env_flags(capsys):
    cfg = parse_run_config(GRPORunConfig, argv=["--env", "guess_number", "--env.max-turns", "6"])
    assert (cfg.env.name, cfg.env.max_turns) == ("guess_number", 6)
    assert parse_run_config(GRPORunConfig, argv=["--env=calculator"]).env.name == "calculator"
    with pytest.raises(ConfigError, match="unknown"):
        parse_run_config(GRPORunConfig, argv=["--env", "chess"]).env.factory()
    _refused(capsys, ["--env", "guess_number", "--env.kwargs", "{high: 3"], "--env.kwargs '{high: 3' is not JSON")
    with pytest.raises(ConfigError, match="high"):
        parse_run_config(GRPORunConfig, argv=["--env", "guess_number", "--env.kwargs", '{"high": 0}']).env.factory()
    with pytest.raises(ConfigError, match="not a meshrl.envs.Environment"):
        parse_run_config(GRPORunConfig, argv=["--env", "json:loads"]).env.factory()
    _refused(capsys, ["--env", "calculator", "--env.max-tokens", "512"], "env.max_tokens=512 is over")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("envs_e2e")


@pytest.fixture(scope="module")
def straight(out):
    from meshrl.controller import grpo

    summary = grpo.main(parse_run_config(GRPORunConfig, argv=[*FLAGS, "--run.output-dir", str(out), "--run.name", "a"]))
    return out / "a", summary


def test_calculator_run_logs_episodes_and_trainer_matches_generator(straight):
    run_dir, summary = straight
    records = _records(run_dir)
    rl = [r for r in records if r["phase"] == "rl"]
    assert len(rl) == STEPS
    for r in rl:
        assert r["logprob_diff_max"] < 1e-4, r  # every model token of every episode, all turns
        assert r["turns_per_episode"] >= 1 and r["model_tokens_per_episode"] == r["completion_len_mean"]
        assert r["episode_tokens_mean"] > r["model_tokens_per_episode"]  # prompt and observations, loss-free
        assert any(k.startswith("env/") for k in r) and r["env_failures"] == 0  # the environment's own counts
        assert sum(v for k, v in r.items() if k.startswith("finish/")) == pytest.approx(1.0)
    raw = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["env_time_per_episode_s"] >= 0 for r in raw if r["phase"] == "rl")
    evals = [r for r in records if r["phase"] == "eval"]
    assert [e["when"] for e in evals] == ["before_rl", "during_rl", "after_rl"]
    for e in evals:
        assert "pass@2" in e and "turns_per_episode" in e and e["samples"][0].startswith("user: Use <tool>")
    assert summary["task"] == "env:calculator"


def test_resumed_env_run_equals_the_straight_run_bitwise(out, straight):
    import torch

    from meshrl.controller import grpo
    from meshrl.models.qwen3 import load_hf_state_dict

    a, summary_a = straight
    argv = [*FLAGS, "--run.output-dir", str(out), "--run.name", "b"]
    stopped = grpo.main(parse_run_config(GRPORunConfig, argv=[*argv, "--run.stop-at-step", "2"]))
    assert stopped["stopped_at"] == 2
    summary_b = grpo.main(parse_run_config(GRPORunConfig, argv=[*argv, "--run.resume", "latest"]))
    b = out / "b"
    assert _records(b) == _records(a)  # episodes, rewards, losses, evaluations: bitwise
    assert summary_b["eval_accuracy_after_rl"] == summary_a["eval_accuracy_after_rl"]
    wa, wb = load_hf_state_dict(a / "final_model"), load_hf_state_dict(b / "final_model")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_failing_environment_costs_its_episodes_not_the_run(out):
    from meshrl.controller import grpo

    kinds = ["ok", "raise", "hang", "ok"]
    train = [{"prompt": f"say {i}", "answer": "1", "kind": k} for i, k in enumerate(kinds)]  # one epoch a step
    held_out = [{"prompt": f"say {i}", "answer": "1", "kind": k} for i, k in enumerate(kinds)]
    argv = [
        *FLAGS[FLAGS.index("--grpo.steps") :],
        "--warmup.steps", "0", "--grpo.steps", "2", "--grpo.prompts-per-step", "4", "--grpo.group-size", "2",
        "--env", "user_envs:FlakyEnv", "--env.timeout-s", "1", "--env.max-turns", "3",
        "--model.flavor", "tiny", "--generator.max-model-len", "96", "--eval.samples", "0",
        "--trainer.num-procs", "2", "--run.output-dir", str(out), "--run.name", "flaky",
    ]  # fmt: skip
    summary = grpo.main(parse_run_config(GRPORunConfig, argv=argv), train_rows=train, eval_rows=held_out)
    rl = [r for r in _records(out / "flaky") if r["phase"] == "rl"]
    assert len(rl) == 2
    for r in rl:  # 4 prompts x 2 episodes, one prompt raising and one hanging: 4 episodes fail each step
        assert r["env_failures"] == 4 and r["reward_failures_by_kind"] == {"env_error": 2, "env_timeout": 2}
        assert r["finish/env_error"] == r["finish/env_timeout"] == 0.25
    assert summary["eval_before_rl"]["env_failures"] == 2
    assert summary["eval_accuracy_after_rl"] == 0.5  # the two working rows end at turn 2 with reward 1


def test_controller_api_runs_episodes_and_trains_on_them(straight):
    """The same from Python: `Controller.run_episodes`, then the episodes' datums through forward / forward_backward."""
    import numpy as np

    from meshrl.advantages import compute_advantages
    from meshrl.controller.api import Controller
    from meshrl.envs.calculator import CalculatorEnv
    from meshrl.types import LossSpec, OptimParams

    run_dir, _ = straight
    cfg = parse_run_config(GRPORunConfig, argv=FLAGS)
    rows = [{"prompt": r.prompt, "answer": r.answer, **r.info} for r in CalculatorEnv.rows("eval", 2, 0)]
    with Controller.start(cfg, model_dir=str(run_dir / "final_model")) as ctl:
        episodes = ctl.run_episodes(CalculatorEnv, rows, group_size=4, max_turns=3, seed=5)
        again = ctl.run_episodes("calculator", rows, group_size=4, max_turns=3, seed=5)
        # the class in this process's threads, the name in environment processes: the same episodes
        assert [e.tokens.tokens for e in episodes] == [e.tokens.tokens for e in again]
        assert list(ctl._env_processes) and all(p is not None for p in ctl._env_processes.values())
        rewards = [e.outcome.reward for e in episodes]
        advantages = compute_advantages(
            "group_mean", rewards, 4, turn_rewards=[e.outcome.turn_rewards for e in episodes]
        )
        data = [e.tokens.datum(a) for e, a in zip(episodes, advantages, strict=True)]
        trainer_logprobs = ctl.forward(data).result()
        for d, lp in zip(data, trainer_logprobs, strict=True):
            mask = np.asarray(d.loss_mask) > 0
            assert np.abs(np.asarray(lp)[mask] - np.asarray(d.old_logprobs)[mask]).max() < 1e-4
        loss = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data))
        result = ctl.forward_backward(data, loss, step=OptimParams(lr=1e-4)).result()
        assert result.optim is not None and np.isfinite(result.loss)


def test_eval_program_evaluates_a_checkpoint_on_an_environment(straight, out):
    from meshrl.config import EvalRunConfig
    from meshrl.controller import eval as eval_program

    run_dir, summary = straight
    argv = [
        "--model.path", str(run_dir / "final_model"), "--env", "calculator", "--env.num-eval", "4",
        "--env.max-turns", "3", "--eval.samples", "2", "--generator.engine", "transformers",
        "--generator.max-model-len", "128", "--generator.max-tokens", "16", "--run.output-dir", str(out),
        "--run.name", "evaluated",
    ]  # fmt: skip
    result = eval_program.main(parse_run_config(EvalRunConfig, argv=argv))
    assert result["task"] == "env:calculator" and result["num_prompts"] == 4
    assert result["accuracy"] == summary["eval_accuracy_after_rl"]  # the same greedy episodes as the run's last eval
    assert "pass@2" in result and "turns_per_episode" in result


def test_env_with_a_rubric_in_the_asynchronous_loop_resumes_bitwise(out):
    """`--reward` with `--env`: the rubric's score of each episode's last answer adds to the environment's reward.
    `--grpo.max-staleness 1`: the next step's episodes are played while the trainer trains, every call pinned to
    the weights they started on. A run stopped with a round in flight and resumed equals the straight run bitwise."""
    from meshrl.controller import grpo
    from meshrl.rollout_recorder import read_rollouts

    argv = [
        *FLAGS, "--grpo.steps", "3", "--warmup.steps", "0", "--eval.every", "0", "--eval.samples", "0",
        "--run.save-every", "0",
        "--grpo.max-staleness", "1", "--reward", "user_rewards:contains_answer=0.5", "--log.rollouts-every", "1",
        "--run.output-dir", str(out),
    ]  # fmt: skip
    grpo.main(parse_run_config(GRPORunConfig, argv=[*argv, "--run.name", "rubric_async"]))
    a = out / "rubric_async"
    rl = [r for r in _records(a) if r["phase"] == "rl"]
    assert [r["staleness_max"] for r in rl] == [0, 1, 1]  # sampled one version behind, after the first step
    assert all("reward/user_rewards:contains_answer" in r and "turns_per_episode" in r for r in rl)
    lines = read_rollouts(a)
    assert lines and all("messages" in line for line in lines)
    for line in lines:  # the environment's turns, plus half the rubric's verdict on the last answer
        part = line["reward_parts"]["user_rewards:contains_answer"] if line["error"] is None else 0.0
        assert line["reward"] == pytest.approx(sum(line["turn_rewards"]) + 0.5 * part)
    stopped = grpo.main(
        parse_run_config(GRPORunConfig, argv=[*argv, "--run.name", "rubric_b", "--run.stop-at-step", "2"])
    )
    assert stopped["stopped_at"] == 2
    state = json.loads((out / "rubric_b" / "checkpoints" / "step_00000002" / "controller.json").read_text())
    assert list(state["rollouts"]) == ["2"] and state["rollouts"]["2"]["episodes"]  # the round in flight, played
    grpo.main(parse_run_config(GRPORunConfig, argv=[*argv, "--run.name", "rubric_b", "--run.resume", "latest"]))
    assert _records(out / "rubric_b") == _records(a)


def test_a_hung_environment_step_does_not_keep_the_process_alive(tmp_path):
    """A step abandoned at --env.timeout-s keeps its thread, not the process: the program exits when it is done
    (issue 31, item 16: a finished run waited forever to join its abandoned worker threads)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = (
        "from user_envs import HangsForAMinute\n"
        "from meshrl.rollout.episode import EpisodeRenderer\n"
        "from meshrl.rollout.render import RenderConfig, Renderer\n"
        "from meshrl.rollout.runner import EpisodeLimits, EpisodeRunner\n"
        "from meshrl.tasks.base import Row\n"
        "from meshrl.tokenizer import default_corpus, train_bpe_tokenizer\n"
        "tok = train_bpe_tokenizer(default_corpus(50), 300)\n"
        "er = EpisodeRenderer(Renderer(tok, RenderConfig(), stop_token_ids=[tok.eos_token_id]))\n"
        "run = EpisodeRunner(HangsForAMinute, er, None, EpisodeLimits(2, 128, 8, timeout_s=0.5))\n"
        "print(run.demonstrations([Row('x', answer='1')])[0], flush=True)\n"
    )
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50, cwd=Path(__file__).parent
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("env_timeout: ") and time.perf_counter() - t0 < 40
