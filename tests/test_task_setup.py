"""The task seam without processes: rendering with the model's own tokenizer and chat template, the prompt budget,
reward specs ('task' meaning the task's verifier), and the checks that refuse a bad model directory at launch."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from meshrl.errors import ConfigError
from meshrl.rollout.render import RenderConfig, Renderer
from meshrl.tasks.base import Row, Task


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from meshrl.models.tiny_hf import create_tiny_chat_model

    return str(create_tiny_chat_model(tmp_path_factory.mktemp("m") / "qwen3", arch="qwen3", vocab_size=300))


def test_reverse_prompts_render_to_the_character_ids(tmp_path):
    """The built-in task through the model directory's tokenizer gives exactly the ids its CharTokenizer gives, so
    the main job trains on the same tokens as before the seam (and decodes completions back to the characters)."""
    from meshrl.tasks.reverse import ReverseTaskConfig, build_reverse_task

    cfg = ReverseTaskConfig()
    char = cfg.tokenizer()
    renderer = Renderer(char.to_hf())  # what the new model's directory holds
    assert not renderer.use_chat_template and renderer.eos_id == char.eos_id
    for row in build_reverse_task(cfg).train[:50]:
        assert renderer.prompt_ids(row) == char.encode(row.prompt)
        ids = char.encode(row.answer) + [char.eos_id]
        assert renderer.completion_text(ids) == row.answer
        assert renderer.demonstration_ids(row, row.answer) == (char.encode(row.prompt), ids)


def test_chat_rendering_system_prompt_and_thinking(chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    plain = Renderer.from_model_dir(chat_model)
    text = plain.prompt_text(Row("What is 2 + 3?"))
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    chat = Row([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    with_system = Renderer(tok, RenderConfig(system_prompt="Think first."))
    assert with_system.prompt_text(chat).startswith("<|im_start|>system\nBe brief.")  # the row's own system wins
    assert with_system.prompt_text(Row("Hi")).startswith("<|im_start|>system\nThink first.<|im_end|>")
    no_think = Renderer(tok, RenderConfig(enable_thinking=False))
    assert no_think.prompt_text(Row("Hi")).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Completions: the stop token that ended them is removed, special tokens skipped.
    ids = plain.encode("5") + [plain.eos_id]
    assert plain.completion_text(ids) == "5"
    assert set(plain.stop_token_ids) >= {tok.convert_tokens_to_ids("<|im_end|>")}
    off = Renderer(tok, RenderConfig(chat_template="off"))
    assert off.prompt_text(Row("Hi")) == "Hi"
    with pytest.raises(ValueError, match="chat template"):
        off.prompt_ids(chat)


def test_prompt_budget_drops_and_counts_never_truncates(chat_model):
    from meshrl.tasks.setup import PromptSet

    renderer = Renderer.from_model_dir(chat_model)
    rows = [Row("short?"), Row("a much longer question " * 20), Row("also short")]
    budget = max(len(renderer.prompt_ids(rows[0])), len(renderer.prompt_ids(rows[2])))
    prompts = PromptSet.render(rows, renderer, budget, "train")
    assert prompts.rows == [rows[0], rows[2]] and prompts.dropped == 1
    assert prompts.prompt_ids == [renderer.prompt_ids(rows[0]), renderer.prompt_ids(rows[2])]
    assert "1 dropped (prompt over" in prompts.describe("train")
    with pytest.raises(ConfigError, match="raise --generator.max-model-len"):
        PromptSet.render(rows[1:2], renderer, budget, "eval")


def test_reward_spec_task_alias_and_python_functions():
    from meshrl.tasks.setup import reward_weights

    task = Task("t", [Row("q", "1")], [Row("q", "1")], reward="exact=1", verifier="math_verify")
    weights, fns = reward_weights("task=1.0,format=0.1", task)
    assert weights == {"math_verify": 1.0, "format": 0.1} and fns == {}
    fn = lambda completion, row: 1.0  # noqa: E731
    weights, fns = reward_weights("format=0.2", task, {"mine": fn})
    assert weights == {"format": 0.2, "mine": 1.0} and fns == {"mine": fn}
    no_verifier = Task("d", [Row("q")], [Row("q")], reward="math_verify=1", verifier="")
    with pytest.raises(ConfigError, match="has no verifier of its own"):
        reward_weights("task=1", no_verifier)


def test_tokenizer_of_another_model_is_refused(chat_model, tmp_path):
    from meshrl.preflight import check_tokenizer_fits

    other = tmp_path / "other"
    shutil.copytree(chat_model, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 100  # the weights of a smaller-vocabulary model under this tokenizer
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="belong to different models"):
        check_tokenizer_fits(Renderer.from_model_dir(other), other)
    check_tokenizer_fits(Renderer.from_model_dir(chat_model), chat_model)  # its own: fine


def test_torchtitan_on_llama_is_refused_before_any_process(tmp_path):
    from meshrl.models.tiny_hf import create_tiny_chat_model

    llama = create_tiny_chat_model(tmp_path / "llama", arch="llama", vocab_size=300)
    cmd = [sys.executable, "-m", "meshrl.controller.grpo", "--model.path", str(llama), "--task", "reverse"]
    proc = subprocess.run(cmd + ["--run.output-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "loads Qwen3 checkpoints only" in proc.stderr and "--model.backend hf" in proc.stderr, proc.stderr[-2000:]
    assert "trainer processes" not in proc.stdout


def test_logprob_gap_between_trainer_and_generator_is_flagged(capsys):
    """A trainer that computes another model than the generator (dropout on, other weights) shows as a logprob gap:
    flagged loudly on every step where it exceeds rounding, silent otherwise."""
    from meshrl.controller.grpo import warn_on_logprob_gap

    warn_on_logprob_gap({"step": 3, "logprob_diff_mean": 2e-6, "logprob_diff_max": 1e-5})
    assert capsys.readouterr().err == ""
    warn_on_logprob_gap({"step": 4, "logprob_diff_mean": 2.9, "logprob_diff_max": 7.5})
    err = capsys.readouterr().err
    assert "WARNING" in err and "2.900 nats" in err and "dropout" in err and "step 4" in err


# ---- prompts over the budget: the advice can be followed (issue 31, item 5) ---------------------------------------


@pytest.fixture(scope="module")
def context_128(chat_model, tmp_path_factory):
    """The chat model with a 128-position context (max_position_embeddings in config.json)."""
    path = tmp_path_factory.mktemp("ctx") / "qwen3-128"
    shutil.copytree(chat_model, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 128
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _prepare(model_dir, rows, *flags):
    from controller.cli import parse_run_config
    from meshrl.config import GRPORunConfig
    from meshrl.tasks import build_task
    from meshrl.tasks.setup import TaskSetup

    argv = ["--model.path", model_dir, "--model.backend", "hf", "--reward", "exact", *flags]
    cfg = parse_run_config(GRPORunConfig, argv=argv)
    return TaskSetup.prepare(cfg, build_task(cfg, train_rows=rows, eval_rows=rows[:2]), model_dir)


def _words(text: str) -> str:
    return " ".join(text.split())


def test_every_prompt_too_long_when_the_context_is_full_says_raising_cannot_help(context_128):
    rows = [{"prompt": "count the words of this sentence " * (5 + i % 2), "answer": "1"} for i in range(64)]
    flags = ("--generator.max-model-len", "128", "--generator.max-tokens", "16")
    with pytest.raises(ConfigError) as e:
        _prepare(context_128, rows, *flags)
    message = _words(str(e.value))
    assert "every one of the 64 train prompts is longer than the 112-token prompt budget" in message, message
    assert "--generator.max-model-len 128 - --generator.max-tokens 16" in message, message
    assert re.search(r"prompts are \d+ to \d+ tokens", message), message
    assert "model's context is 128 positions (max_position_embeddings=128 in" in message, message
    assert "raising --generator.max-model-len cannot help" in message, message
    assert "a model with a longer context" in message and "shorter prompts" in message, message
    shortest = int(re.search(r"prompts are (\d+) to", message).group(1))
    assert shortest < 128 and f"lower --generator.max-tokens to {128 - shortest} or less" in message, message


def test_every_prompt_too_long_below_the_context_says_how_far_to_raise(chat_model):
    rows = [{"prompt": "count the words of this sentence " * 6, "answer": "1"}] * 4
    with pytest.raises(ConfigError) as e:
        _prepare(chat_model, rows, "--generator.max-model-len", "48", "--generator.max-tokens", "16")
    message = _words(str(e.value))
    n = int(re.search(r"prompts are (\d+) to", message).group(1))
    assert f"raise --generator.max-model-len to at least {n + 16}" in message, message
    assert "model's context is 256 positions" in message and "cannot help" not in message, message


def test_many_dropped_prompts_warn_with_lengths_and_the_context(context_128, capsys):
    short = [{"prompt": "2 + 2?", "answer": "4"}] * 8
    long = [{"prompt": "count the words of this sentence " * 12, "answer": "1"}] * 8
    setup = _prepare(context_128, short + long, "--generator.max-model-len", "128", "--generator.max-tokens", "16")
    assert len(setup.train) == 8 and setup.train.dropped == 8
    err = _words(capsys.readouterr().err)
    assert "8 of 16 train prompts (50%) are longer than the 112-token prompt budget" in err, err
    assert "--generator.max-model-len 128 - --generator.max-tokens 16" in err, err
    assert re.search(r"prompts are \d+ to \d+ tokens", err) and "model's context is 128 positions" in err, err
    assert "raising --generator.max-model-len cannot help" in err, err


def test_a_huge_prompt_is_dropped_by_its_characters_before_tokenising(chat_model, monkeypatch, capsys):
    """A 50 MB row took ~150 s of tokenising only to be dropped as too long (issue 31, item 17): its characters
    alone say it cannot fit, so it is dropped untokenised."""
    encoded = []
    real = Renderer.encode
    monkeypatch.setattr(Renderer, "encode", lambda self, text: encoded.append(len(text)) or real(self, text))
    huge = {"prompt": "how are you today? " * 250_000, "answer": "1"}  # 4.75 million characters
    rows = [{"prompt": "2 + 2?", "answer": "4"}] * 3 + [huge]
    setup = _prepare(chat_model, rows, "--generator.max-model-len", "64", "--generator.max-tokens", "16")
    assert len(setup.train) == 3 and setup.train.dropped == 1
    assert max(encoded) < 10_000, max(encoded)  # the huge prompt never reached the tokenizer
    err = _words(capsys.readouterr().err)
    assert "1 of 4 train prompts (25%) are longer than the 48-token prompt budget" in err, err
    assert "and 1 over 1248 characters (more than 48 tokens can hold; not tokenised)" in err, err
