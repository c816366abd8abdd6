"""Any causal LM through the real programs: SFT on chat rows, then two GRPO steps with the `hf` trainer backend, on
real Monarch meshes, for the two architectures furthest apart (small random checkpoints made with transformers, each
with a BPE tokenizer and a ChatML chat template trained in code): Qwen3 (rotary positions, untied head) generating on
vLLM and GPT-2 (learned positions, tied head, dropout in its config) on the transformers engine. Qwen2 and Llama ran
here too until the vision-language programs joined the suite (its 20-minute budget): tests/test_architectures.py
checks every engine on every one of the four against transformers in-process (logprobs, weight sync, export), at a
fraction of a program's cost. The exported model reloads in transformers and vLLM with the same logits, its
tokenizer files and chat template intact."""

from __future__ import annotations

import json

import pytest
import torch

ARCHS = ["qwen3", "gpt2"]
# One program run per architecture (a run costs ~25-45 s on 2 cores), one per engine.
ENGINE_OF = {"qwen3": "vllm", "gpt2": "transformers"}


def _rows(pairs):
    return [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]


PAIRS = [(a, b) for a in range(1, 9) for b in range(1, 5)]


@pytest.fixture(scope="module", params=ARCHS)
def sft_model(request, tmp_path_factory):
    """SFT (the program, from Python) on chat rows of a fresh tiny checkpoint: its exported final model."""
    from meshrl.config import SFTRunConfig
    from meshrl.controller import sft
    from meshrl.controller.cli import parse_run_config
    from meshrl.models.tiny_hf import create_tiny_chat_model

    arch, out = request.param, tmp_path_factory.mktemp(request.param)
    # dropout 0.1 in the config: the trainer must run without it (RL trainers do), so logprobs match the engines
    base = create_tiny_chat_model(out / "base", arch=arch, vocab_size=320, max_position_embeddings=128, dropout=0.1)
    chat = [
        {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}]}
        for r in _rows(PAIRS)
    ]
    argv = ["--model.path", str(base), "--model.backend", "hf", "--trainer.num-procs", "1"]
    argv += ["--trainer.micro-batch-size", "8", "--sft.batch-size", "8", "--sft.max-steps", "2"]
    argv += ["--sft.no-eval-generate", "--run.output-dir", str(out), "--run.name", "sft", "--run.call-timeout-s", "180"]
    summary = sft.main(parse_run_config(SFTRunConfig, argv=argv), train_rows=chat[:24], eval_rows=chat[24:])
    assert summary["steps"] == 2 and summary["final_eval"]["eval_loss"] > 0
    return arch, summary["final_model"]


def test_sft_then_two_grpo_steps(sft_model, tmp_path):
    from meshrl.config import GRPORunConfig
    from meshrl.controller import grpo
    from meshrl.controller.cli import parse_run_config

    arch, model_dir = sft_model
    engine = ENGINE_OF[arch]
    argv = [
        "--model.path", model_dir, "--model.backend", "hf",
        "--trainer.num-procs", "1", "--trainer.micro-batch-size", "8",
        "--generator.engine", engine, "--generator.max-model-len", "64", "--generator.max-tokens", "6",
        "--grpo.steps", "2", "--grpo.prompts-per-step", "4", "--grpo.group-size", "2",
        "--reward", "math_verify=1.0", "--eval.samples", "2",
        "--run.output-dir", str(tmp_path), "--run.name", "rl", "--run.call-timeout-s", "180",
    ]  # fmt: skip
    summary = grpo.main(
        parse_run_config(GRPORunConfig, argv=argv), train_rows=_rows(PAIRS[:24]), eval_rows=_rows(PAIRS[24:])
    )
    records = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["policy_version"] for r in rl] == [1, 2]
    # The trainer and the engine compute the same model (float32): dropout off, same weights after each sync.
    assert all(r["logprob_diff_max"] < 1e-3 for r in rl), [r["logprob_diff_max"] for r in rl]
    assert "pass@2" in summary["eval_after_rl"]
    _check_export(summary["final_checkpoint"], tmp_path / "rl" / "final_model")  # reloaded by transformers and vLLM


def _check_export(_resumable, final_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshrl.generation.vllm_engine import VLLMEngine
    from meshrl.policy import target_logprobs

    tok = AutoTokenizer.from_pretrained(final_model)
    assert tok.chat_template and (final_model / "chat_template.jinja").exists()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    seq = tok(text, add_special_tokens=False)["input_ids"] + tok("5", add_special_tokens=False)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(final_model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = target_logprobs(hf(torch.tensor([seq])).logits, torch.tensor([seq]))[0]
    engine = VLLMEngine(str(final_model), max_model_len=64, kv_cache_memory_bytes=16 * 2**20)
    try:
        (got,) = engine.prompt_logprobs([seq])
    finally:
        engine.shutdown()
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-4)
