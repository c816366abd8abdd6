"""Vision-language models through the real programs (issue 34), on real Monarch meshes, the hf trainer and each
engine: meshrl's transformers engine here, and vLLM where torchvision loads and a GPU is there (vLLM's vision-language
models import torchvision, which this CPU build of torch cannot load; `bash bench/gpu_run.sh vision-vllm` runs them):

- Qwen2.5-VL, made by the program (--model.flavor tiny-qwen2.5-vl): GRPO on the drawn-shapes task with an SFT
  warm-up, then `python -m meshrl.controller.eval` on its exported model over JSONL rows whose images are PNG files
  (a separate images field, relative paths).
- Qwen3-VL: SFT on JSONL chat rows with image parts (file paths), then two GRPO steps from its export.

Each checks what only the programs show: the trainer and the engine score the sampled tokens of image prompts
alike (the run's logprob_diff_max), the versions advance, the export holds the processor files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from markers import needs_cuda, needs_torchvision, needs_vllm

ENGINES = ["transformers", pytest.param("vllm", marks=[needs_cuda, needs_torchvision, needs_vllm])]
COMMON = ["--trainer.num-procs", "1", "--trainer.micro-batch-size", "8", "--run.call-timeout-s", "180"]


def _engine_flags(engine: str) -> list[str]:
    """The generator flags for `engine`. float32 throughout (the GPU defaults would choose bf16, where the logprob
    bound below does not hold); vLLM eager, as a test needs no CUDA graphs (bench/vision_gpu.py runs them)."""
    flags = ["--generator.engine", engine, "--generator.dtype", "float32"]
    return flags + (["--generator.vllm.enforce-eager", "True"] if engine == "vllm" else [])


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _pictures(root, n: int):
    """n PNG files of 1-3 coloured squares, and the count of each."""
    from PIL import Image, ImageDraw

    root.mkdir(parents=True, exist_ok=True)
    counts = []
    for k in range(n):
        im = Image.new("RGB", (56, 56), "white")
        draw = ImageDraw.Draw(im)
        count = 1 + k % 3
        for j in range(count):
            draw.rectangle([4 + 17 * j, 20, 15 + 17 * j, 31], fill=("red", "blue", "green")[k % 3])
        im.save(root / f"pic{k}.png")
        counts.append(count)
    return counts


@pytest.mark.parametrize("engine", ENGINES)
def test_qwen2_5_vl_sft_warmup_then_grpo_on_shapes_and_eval_of_the_export_on_image_files(tmp_path, engine):
    from meshrl.config import EvalRunConfig, GRPORunConfig
    from meshrl.controller import eval as eval_program
    from meshrl.controller import grpo
    from meshrl.controller.cli import parse_run_config

    argv = [
        "--preset", "tiny-vision", *COMMON, "--model.dtype", "float32", *_engine_flags(engine),
        "--shapes.num-train", "64", "--shapes.num-eval", "8",
        "--warmup.steps", "2", "--warmup.batch-size", "8",
        "--grpo.steps", "2", "--grpo.prompts-per-step", "4", "--grpo.group-size", "2",
        "--eval.every", "0", "--run.output-dir", str(tmp_path), "--run.name", "rl",
    ]  # fmt: skip
    summary = grpo.main(parse_run_config(GRPORunConfig, argv=argv))
    rl = [r for r in _records(tmp_path / "rl") if r["phase"] == "rl"]
    assert [r["policy_version"] for r in rl] == [3, 4]  # 2 warm-up steps, then 2 RL steps
    assert all(r["logprob_diff_max"] < 1e-3 for r in rl), [r["logprob_diff_max"] for r in rl]
    final = tmp_path / "rl" / "final_model"
    for name in ("config.json", "preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (final / name).exists(), name
    assert "accuracy" in summary["eval_after_rl"]

    # Its export evaluated on rows of image files: a separate images field, paths relative to the data file.
    counts = _pictures(tmp_path / "data" / "img", 6)
    rows = [{"prompt": "How many shapes are there?", "images": [f"img/pic{k}.png"], "answer": str(c)}
            for k, c in enumerate(counts)]  # fmt: skip
    data = tmp_path / "data" / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [
        "--model.path", str(final), "--model.backend", "hf", *_engine_flags(engine),
        "--generator.max-model-len", "96", "--generator.max-tokens", "4",
        "--data.eval", str(data), "--data.images-field", "images", "--reward", "exact=1.0", "--eval.samples", "0",
        "--run.output-dir", str(tmp_path), "--run.name", "eval", "--run.call-timeout-s", "180",
    ]  # fmt: skip
    result = eval_program.main(parse_run_config(EvalRunConfig, argv=argv))
    assert 0.0 <= result["accuracy"] <= 1.0 and len(result["samples"]) == 5


@pytest.mark.parametrize("engine", ENGINES)
def test_qwen3_vl_sft_on_chat_rows_with_image_files_then_two_grpo_steps(tmp_path, engine):
    from meshrl.config import GRPORunConfig, SFTRunConfig
    from meshrl.controller import grpo, sft
    from meshrl.controller.cli import parse_run_config
    from meshrl.models.tiny_vlm import create_tiny_vlm

    base = create_tiny_vlm(tmp_path / "base", "qwen3_vl", vocab_size=320)
    counts = _pictures(tmp_path / "data" / "img", 24)
    chat = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": f"img/pic{k}.png"},
                                                   {"type": "text", "text": "How many squares?"}]},
                      {"role": "assistant", "content": str(c)}]}
        for k, c in enumerate(counts)
    ]  # fmt: skip
    (tmp_path / "data" / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    argv = [
        "--model.path", str(base), "--model.backend", "hf", "--model.dtype", "float32", *COMMON,
        "--data.train", str(tmp_path / "data" / "sft.jsonl"), "--data.eval", str(tmp_path / "data" / "sft.jsonl"),
        "--sft.batch-size", "8", "--sft.max-steps", "2", "--sft.no-eval-generate",
        "--run.output-dir", str(tmp_path), "--run.name", "sft",
    ]  # fmt: skip
    summary = sft.main(parse_run_config(SFTRunConfig, argv=argv))
    assert summary["steps"] == 2 and np.isfinite(summary["final_eval"]["eval_loss"])

    prompts = [{"messages": c["messages"][:1], "answer": c["messages"][1]["content"]} for c in chat]
    (tmp_path / "data" / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    argv = [
        "--model.path", summary["final_model"], "--model.backend", "hf", "--model.dtype", "float32", *COMMON,
        *_engine_flags(engine), "--generator.max-model-len", "96", "--generator.max-tokens", "4",
        "--data.train", str(tmp_path / "data" / "rl.jsonl"), "--data.eval", str(tmp_path / "data" / "rl.jsonl"),
        "--grpo.steps", "2", "--grpo.prompts-per-step", "4", "--grpo.group-size", "2", "--reward", "exact=1.0",
        "--eval.samples", "0", "--run.output-dir", str(tmp_path), "--run.name", "rl",
    ]  # fmt: skip
    grpo.main(parse_run_config(GRPORunConfig, argv=argv))
    rl = [r for r in _records(tmp_path / "rl") if r["phase"] == "rl"]
    assert [r["policy_version"] for r in rl] == [1, 2]
    assert all(r["logprob_diff_max"] < 1e-3 for r in rl), [r["logprob_diff_max"] for r in rl]
