"""Real RL tasks end to end, as a user runs them: a checkpoint with its own BPE tokenizer and chat template, prompt
rows from files or Python lists, rewards by name / import path / Python function, a verifier that raises and one
that hangs, evaluation with mean@k and pass@k, and the standalone eval program on the exported model. Real
Monarch meshes, real transformers models, meshrl's transformers engine (vLLM is covered in test_architectures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
QUESTIONS = [(a, b) for a in range(1, 10) for b in range(1, 6)]


def _rows(pairs):
    # GSM8K's layout: the reference answer ends with '#### <number>'.
    return [{"question": f"What is {a} + {b}?", "answer": f"{a} plus {b} is {a + b}. #### {a + b}"} for a, b in pairs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from meshrl.models.tiny_hf import create_tiny_checkpoint
    from meshrl.tokenizer import default_corpus, train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(default_corpus(), vocab_size=320)
    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "qwen3", arch="qwen3", tokenizer=tokenizer))


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    for name, pairs in (("train.jsonl", QUESTIONS[:36]), ("test.jsonl", QUESTIONS[36:])):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in _rows(pairs)))
    return d


COMMON = [
    "--model.backend", "hf",
    "--trainer.num-procs", "1",
    "--trainer.micro-batch-size", "8",
    "--generator.engine", "transformers",
    "--generator.max-model-len", "96",
    "--generator.max-tokens", "12",
    "--grpo.prompts-per-step", "4",
    "--grpo.group-size", "2",
    "--run.call-timeout-s", "180",
]  # fmt: skip


# built-in verifiers, one that raises, one that hangs, and a group reward (all from the user's module by import path)
REWARDS = ["math_verify=1.0", "format=0.1", "user_rewards:raises=0.5", "user_rewards:hangs=0.5"]
REWARDS += ["user_rewards:shortest_wins=0.1"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, model_dir, data_files):
    """The issue's first command, plus a verifier that raises and one that hangs."""
    out = tmp_path_factory.mktemp("runs")
    cmd = [
        sys.executable, "-m", "meshrl.controller.grpo", *COMMON,
        "--model.path", model_dir,
        "--data.train", str(data_files / "train.jsonl"),
        "--data.eval", str(data_files / "test.jsonl"),
        "--data.prompt-field", "question",
        "--data.answer-field", "answer",
        "--reward", ",".join(REWARDS),
        "--scoring.timeout-s", "1",
        "--grpo.steps", "2",
        "--eval.every", "1",
        "--eval.samples", "2",
        "--run.output-dir", str(out),
        "--run.name", "cli",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / "cli", proc.stdout


def test_cli_run_on_data_files_with_failing_verifiers(cli_run):
    run_dir, stdout = cli_run
    assert "task data: train: 36 prompts; eval: 9 prompts" in stdout
    assert "correct = math_verify >= 1" in stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]  # the run went on past every failing sample
    for r in rl:
        kinds = r["reward_failures_by_kind"]
        assert kinds["user_rewards:raises: error"] == 8 and kinds["user_rewards:hangs: timeout"] == 8
        assert r["reward/user_rewards:raises"] == 0.0 and r["reward/user_rewards:hangs"] == 0.0
        assert {"reward/math_verify", "reward/format", "accuracy_sampled"} <= r.keys()
        # the group reward saw each group of 2 whole: at least one of the two is the shortest
        assert r["reward/user_rewards:shortest_wins"] >= 0.5
    evals = [r for r in records if r["phase"] == "eval"]
    assert [r["when"] for r in evals] == ["before_rl", "during_rl", "after_rl"]
    assert all({"accuracy", "mean@2", "pass@1", "pass@2", "reward_failures"} <= r.keys() for r in evals)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "pass@2" in summary["eval_after_rl"]
    # The exported model keeps its tokenizer files and chat template.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run_dir / "final_model")
    assert tok.chat_template and tok.eos_token == "<|im_end|>"


def test_eval_program_on_the_exported_model(cli_run, data_files, tmp_path):
    run_dir, _ = cli_run
    cmd = [
        sys.executable, "-m", "meshrl.controller.eval",
        "--model.path", str(run_dir / "final_model"),
        "--data.eval", str(data_files / "test.jsonl"),
        "--data.prompt-field", "question",
        "--generator.engine", "transformers",
        "--generator.max-model-len", "96",
        "--generator.max-tokens", "12",
        "--eval.samples", "3",
        "--eval.pass-k", "1", "3",
        "--run.output-dir", str(tmp_path),
        "--run.name", "ev",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert result["num_prompts"] == 9 and {"accuracy", "mean@3", "pass@1", "pass@3"} <= result.keys()
    assert result["pass@1"] == pytest.approx(result["mean@3"])  # pass@1 is the mean over samples
    assert result["pass@3"] >= result["pass@1"]


def test_python_api_rows_and_reward_functions(model_dir, tmp_path, capsys):
    """main(cfg, train_rows=..., eval_rows=..., reward_fns=...) with functions that exist only in this process: a
    closure and a function registered with @register_reward here. Both reach the reward processes (they travel with
    the Rubric) and score every sample."""
    from meshrl.config import GRPORunConfig
    from meshrl.controller import grpo
    from meshrl.controller.cli import parse_run_config
    from meshrl.rewards import register_reward

    target = "7"

    @register_reward("mentions_seven_here")
    def mentions_seven(completion: str, row: dict) -> float:
        return float(target in completion)

    argv = [*COMMON, "--model.path", model_dir, "--grpo.steps", "1", "--reward", "mentions_seven_here=0.5"]
    argv += ["--data.prompt-field", "question", "--scoring.num-procs", "2"]  # rows split over 2 reward processes
    argv += ["--run.output-dir", str(tmp_path), "--run.name", "py"]
    cfg = parse_run_config(GRPORunConfig, argv=argv)
    summary = grpo.main(
        cfg,
        train_rows=_rows(QUESTIONS[:20]),
        eval_rows=_rows(QUESTIONS[40:44]),
        reward_fns={"length_is_short": lambda completion, row: float(len(completion) < 8)},
    )
    (rl,) = [json.loads(x) for x in (tmp_path / "py" / "metrics.jsonl").read_text().splitlines() if '"rl"' in x]
    assert rl["reward_failures"] == 0
    assert {"reward/mentions_seven_here", "reward/length_is_short"} <= rl.keys()
    assert "+ 2 reward processes" in capsys.readouterr().out
    assert summary["task"] == "data"


def test_unknown_reward_fails_at_launch_naming_it(model_dir, tmp_path):
    cmd = [
        sys.executable, "-m", "meshrl.controller.grpo", *COMMON,
        "--model.path", model_dir, "--task", "reasoning_gym:chain_sum",
        "--reward", "task=1.0,no_such_module_xyz:fn=0.5",
        "--run.output-dir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode != 0
    assert "no_such_module_xyz" in proc.stderr and "PYTHONPATH" in proc.stderr, proc.stderr[-2000:]
    assert "trainer processes" not in proc.stdout  # refused before any process started


def test_tiny_math_preset_from_a_new_model(tmp_path):
    """The tiny-math preset's path, shortened: the program trains a BPE tokenizer with a chat template on the task's
    rows, makes a new random model with it, warms up on '\\boxed{}' demonstrations and runs GRPO on math-verify."""
    from meshrl.config import GRPORunConfig
    from meshrl.controller import grpo
    from meshrl.controller.cli import parse_run_config

    argv = ["--preset", "tiny-math", "--arithmetic.num-train", "300", "--arithmetic.num-eval", "8"]
    argv += ["--warmup.steps", "3", "--warmup.batch-size", "16", "--grpo.steps", "1", "--grpo.prompts-per-step", "4"]
    argv += ["--trainer.micro-batch-size", "16", "--eval.samples", "2", "--run.output-dir", str(tmp_path)]
    # One trainer rank and the transformers engine, as the rest of this module (the preset's 2 ranks and vLLM: the
    # program's path is the point here; 2 ranks with vLLM run in test_grpo_e2e, vLLM on a BPE chat model in
    # test_architectures_e2e). ~20 CPU-s less on 2 cores.
    argv += ["--trainer.num-procs", "1", "--generator.engine", "transformers"]
    summary = grpo.main(parse_run_config(GRPORunConfig, argv=argv + ["--run.name", "m", "--run.call-timeout-s", "180"]))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "m" / "base_model")
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and len(tok) <= 512
    assert summary["task"] == "arithmetic" and {"mean@2", "pass@2"} <= summary["eval_after_rl"].keys()
    records = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records].count("warmup") == 3 and "reward/math_verify" in records[-2]
