"""`--run.gpu-defaults` (issue 33, item 5): on a machine with GPUs the command line fills in the GPU settings the user
left open; without GPUs nothing changes. Machines are described (`Machine`), not needed: no process, no GPU."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
import tyro

from meshrl import gpu_defaults
from meshrl.config import EvalRunConfig, GeneratorConfig, GRPORunConfig, ModelConfig, SFTRunConfig
from meshrl.configs import EVAL_PRESETS, PRESETS, SFT_PRESETS
from meshrl.controller.cli import parse_run_config
from meshrl.gpu_defaults import Machine, given_fields, resolve_gpu_defaults
from meshrl.placement import PlacementConfig, gpu_layout
from meshrl.run_dir import RunConfig


def _resolve(cfg, machine: Machine, *args: str):
    return resolve_gpu_defaults(cfg, given_fields(args), machine)


@pytest.mark.parametrize("gpus", [1, 2, 4])
@pytest.mark.parametrize("vllm", [True, False])
@pytest.mark.parametrize(
    ("path", "model_type", "titan", "backend"),
    [
        (None, None, True, "torchtitan"),  # a new Qwen3, torchtitan imports
        (None, None, False, "hf"),  # a new Qwen3, torchtitan does not import (../shared/GPU.md: torch 2.11)
        ("ckpt/q", "qwen3", True, "torchtitan"),
        ("ckpt/l", "llama", True, "hf"),  # torchtitan takes Qwen3 only
        ("ckpt/x", None, True, "hf"),  # config.json unreadable: any transformers causal LM
    ],
)
def test_grpo_on_a_machine_with_gpus(gpus, vllm, path, model_type, titan, backend):
    machine = Machine(gpus, vllm_cuda=vllm, torchtitan=titan, model_type=model_type)
    cfg, lines = resolve_gpu_defaults(GRPORunConfig(model=ModelConfig(path=path)), set(), machine)
    assert (cfg.trainer.device, cfg.model.dtype, cfg.generator.dtype) == ("cuda", "bfloat16", "bfloat16")
    assert cfg.model.backend == backend
    assert cfg.generator.engine == ("vllm" if vllm else "transformers")
    assert cfg.trainer.logprob_chunk_size == 4096 and cfg.placement.gpus == gpus
    layout = gpu_layout(gpus)  # the measured layout, through GRPORunConfig._lay_out_gpus
    assert (cfg.trainer.devices, cfg.generator.devices) == (layout.trainer_gpus, layout.generator_gpus)
    assert (cfg.grpo.max_staleness, cfg.trainer.micro_batch_size) == (layout.asynchronous, layout.micro_batch_size)
    # Nothing that changes numerics, and no compile: fp32 master weights, the exact KV cache.
    numerics = (cfg.trainer.master_dtype, cfg.trainer.compile, cfg.generator.transformers.kv_cache_dtype)
    assert numerics == ("float32", False, "auto")
    assert any(line.startswith(f"--model.backend {backend} (") for line in lines)
    assert len(lines) == 7 and all("(" in line for line in lines)  # each setting says why


@pytest.mark.parametrize(
    "cfg",
    [GRPORunConfig(), SFTRunConfig(), EvalRunConfig(), *(p() for p in (*PRESETS.values(), *SFT_PRESETS.values()))],
)
def test_no_gpus_change_nothing(cfg):
    before = dataclasses.replace(cfg)
    out, lines = resolve_gpu_defaults(cfg, set(), Machine(0, vllm_cuda=True, torchtitan=True, model_type="qwen3"))
    assert out is cfg and out == before and lines == []


def test_flags_given_win_in_every_spelling():
    args = [
        "--trainer.device=cuda", "--model.dtype", "float32", "--generator.engine", "transformers",
        "--model.backend", "hf", "--trainer.logprob_chunk_size", "0", "--placement.gpus", "1",
    ]  # fmt: skip
    assert {"trainer.device", "model.dtype", "trainer.logprob_chunk_size"} <= given_fields(args)
    cfg = tyro.cli(GRPORunConfig, args=args)
    out, lines = resolve_gpu_defaults(cfg, given_fields(args), Machine(4, vllm_cuda=True, torchtitan=True))
    assert (out.model.dtype, out.generator.engine, out.model.backend) == ("float32", "transformers", "hf")
    assert (out.trainer.logprob_chunk_size, out.placement.gpus, out.generator.dtype) == (0, 1, "bfloat16")
    assert lines == ["--generator.dtype bfloat16 (the engine computes in bf16, the weights cross in it)"]


def test_a_preset_counts_as_given_where_it_differs_from_the_defaults(monkeypatch):
    _describe(monkeypatch, gpus=2, vllm=True)
    presets = {"p": lambda: GRPORunConfig(generator=GeneratorConfig(engine="transformers", dtype="float32"))}
    cfg = parse_run_config(GRPORunConfig, argv=["--preset", "p"], presets=presets)
    # engine differs from the default (given); the dtype equals it, so it is resolved
    assert (cfg.generator.engine, cfg.generator.dtype, cfg.trainer.device) == ("transformers", "bfloat16", "cuda")
    cfg = parse_run_config(GRPORunConfig, argv=["--preset", "p", "--generator.engine", "vllm"], presets=presets)
    assert cfg.generator.engine == "vllm"


def test_a_cpu_preset_stays_on_cpu_and_says_why(monkeypatch, capsys):
    """The main job's preset hands weights over in host memory (--generator.weight-sync shm): with GPUs the config
    would be refused, so it runs as given, on CPU."""
    _describe(monkeypatch, gpus=2, vllm=True)
    cfg = parse_run_config(GRPORunConfig, argv=["--preset", "tiny-reverse"])
    assert cfg == PRESETS["tiny-reverse"]()
    assert "[meshrl] gpu defaults: not applied (2 GPU(s) seen)" in capsys.readouterr().out


def test_a_vision_model_takes_vllm_only_where_torchvision_imports_with_it(monkeypatch, tmp_path, capsys):
    """vLLM's vision-language models import torchvision: for a checkpoint with a vision tower (or a VLM flavor) the
    probe imports both, and a machine where vLLM alone imports keeps the transformers engine, saying why."""
    asked = _describe(monkeypatch, gpus=1, vllm=True)  # 'vllm' imports, 'vllm_vision' does not
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}))
    cfg = parse_run_config(GRPORunConfig, argv=["--model.path", str(vlm), "--model.backend", "hf"])
    assert asked == ["vllm_vision"] and cfg.generator.engine == "transformers"
    assert "torchvision, which its vision-language models import" in capsys.readouterr().out
    asked.clear()
    flavor = parse_run_config(GRPORunConfig, argv=["--model.flavor", "tiny-qwen2.5-vl", "--model.backend", "hf"])
    assert asked == ["vllm_vision"] and flavor.generator.engine == "transformers"
    asked.clear()
    text = parse_run_config(GRPORunConfig, argv=["--model.backend", "hf"])
    assert asked == ["vllm"] and text.generator.engine == "vllm"


@pytest.mark.parametrize("gpus", [1, 4])
def test_the_gpu_preset_takes_the_gpu_defaults(monkeypatch, gpus):
    """gpu-math states the job (a 'small' Qwen3 made in code, two-digit arithmetic, SFT then GRPO) and leaves every
    GPU setting to the defaults; on a CPU it stays a CPU config."""
    from meshrl.models.qwen3 import hf_config_dict

    _describe(monkeypatch, gpus=gpus, vllm=False)
    cfg = parse_run_config(GRPORunConfig, argv=["--preset", "gpu-math"])
    layout = gpu_layout(gpus)
    assert (cfg.trainer.device, cfg.model.dtype, cfg.model.backend, cfg.generator.engine) == (
        "cuda", "bfloat16", "hf", "transformers")  # fmt: skip
    assert (cfg.placement.gpus, cfg.trainer.devices, cfg.generator.devices) == (
        gpus, layout.trainer_gpus, layout.generator_gpus)  # fmt: skip
    assert (cfg.task, cfg.model.flavor, cfg.warmup.steps > 0, cfg.trainer.master_dtype) == (
        "arithmetic", "small", True, "float32")  # fmt: skip
    hf = hf_config_dict("small", 512)  # ~63M parameters: 16 layers of 512, tied embeddings
    layer = 512 * (512 + 2 * 256) + 512 * 512 + 3 * 512 * 2048
    assert 55e6 < hf["num_hidden_layers"] * layer + 512 * 512 < 70e6
    assert PRESETS["gpu-math"]().trainer.device == "cpu"


def test_switched_off_or_cpu_asked_for_or_other_hosts(monkeypatch, capsys):
    _describe(monkeypatch, gpus=2, vllm=True)
    off = parse_run_config(GRPORunConfig, argv=["--run.no-gpu-defaults"])
    assert off == GRPORunConfig(run=RunConfig(gpu_defaults=False))
    assert "gpu defaults: off (--run.no-gpu-defaults)" in capsys.readouterr().out
    assert parse_run_config(GRPORunConfig, argv=["--trainer.device", "cpu"]) == GRPORunConfig()
    hosts = GRPORunConfig(placement=PlacementConfig(kind="hosts", workers="tcp://a:1"))
    out, lines = _resolve(hosts, Machine(2), "--placement", "hosts")
    assert out is hosts and "other hosts" in lines[0]


def test_the_layout_is_left_to_flags_it_would_overwrite():
    """--grpo.max-staleness 0 given: the two-GPU layout would make the loop asynchronous, so no layout."""
    cfg, lines = _resolve(GRPORunConfig(), Machine(2), "--grpo.max-staleness", "0")
    assert cfg.placement.gpus is None and cfg.grpo.max_staleness == 0 and cfg.trainer.device == "cuda"
    assert "--placement.gpus left unset: --grpo.max-staleness given" in lines[-1]
    cfg, _ = _resolve(GRPORunConfig(grpo=dataclasses.replace(GRPORunConfig().grpo, max_staleness=1)), Machine(2))
    assert cfg.placement.gpus == 2  # a non-default value the layout keeps


def test_lora_trains_on_hf():
    cfg, lines = _resolve(GRPORunConfig(model=ModelConfig(backend="hf", lora_rank=8)), Machine(1, torchtitan=True))
    assert cfg.model.backend == "hf" and "LoRA" in next(line for line in lines if "backend" in line)


def test_sft_takes_a_rank_per_gpu_and_eval_only_the_generator():
    for gpus, ranks in ((1, 1), (2, 2), (4, 4), (8, 8), (3, 2)):
        cfg, _ = _resolve(SFTRunConfig(), Machine(gpus))
        assert (cfg.trainer.device, cfg.trainer.num_procs, cfg.trainer.logprob_chunk_size) == ("cuda", ranks, 4096)
    small = dataclasses.replace(SFTRunConfig(), sft=dataclasses.replace(SFTRunConfig().sft, batch_size=12))
    assert _resolve(small, Machine(8))[0].trainer.num_procs == 4  # splits 12 (and the micro-batch cap 32)
    cfg, lines = _resolve(EvalRunConfig(), Machine(2, vllm_cuda=False))
    assert (cfg.generator.engine, cfg.generator.dtype) == ("transformers", "bfloat16") and len(lines) == 2


def test_the_machine_is_probed_only_where_a_choice_is_open(monkeypatch, tmp_path):
    asked = _describe(monkeypatch, gpus=1, vllm=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cfg = GRPORunConfig(model=ModelConfig(path=str(tmp_path)))
    assert gpu_defaults.detect_machine(cfg, set()) == Machine(1, vllm_cuda=True, model_type="llama")
    assert asked == ["vllm"]  # a llama model: torchtitan's import does not matter
    asked.clear()
    gpu_defaults.detect_machine(GRPORunConfig(), {"generator.engine"})
    assert asked == ["torchtitan"]
    monkeypatch.setattr(gpu_defaults, "visible_gpus", lambda: 0)
    asked.clear()
    assert gpu_defaults.detect_machine(GRPORunConfig(), set()) == Machine(0) and asked == []


@pytest.mark.parametrize(
    ("cls", "argv"),
    [
        (GRPORunConfig, []),
        (GRPORunConfig, ["--preset", "tiny-reverse"]),
        (GRPORunConfig, ["--preset", "tiny-math", "--grpo.steps", "3"]),
        (SFTRunConfig, ["--preset", "tiny-reverse-sft"]),
        (EvalRunConfig, ["--model.path", "ckpt"]),
    ],
)
def test_on_this_cpu_machine_the_command_line_is_unchanged(cls, argv, capsys):
    """The real detection, here (no GPU): the same config as tyro alone gives, and nothing printed."""
    if gpu_defaults.visible_gpus():
        pytest.skip("this machine has GPUs")
    presets = {GRPORunConfig: PRESETS, SFTRunConfig: SFT_PRESETS, EvalRunConfig: EVAL_PRESETS}[cls]
    name = argv[1] if argv[:1] == ["--preset"] else "default"
    plain = tyro.cli(cls, default=presets[name](), args=[a for a in argv if a not in ("--preset", name)])
    assert parse_run_config(cls, argv=argv) == plain
    assert "gpu defaults" not in capsys.readouterr().out


def test_help_says_what_it_resolves_and_how_to_opt_out():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parse_run_config(GRPORunConfig, argv=["--help"])
    text = " ".join(out.getvalue().replace("│", " ").split())
    assert "--run.gpu-defaults, --run.no-gpu-defaults" in text
    for words in ("--trainer.device cuda", "bfloat16", "--placement.gpus N", "Without GPUs", "nothing changes"):
        assert words in text, words


def _describe(monkeypatch, *, gpus: int, vllm: bool) -> list[str]:
    """This process as a machine with `gpus` GPUs where vLLM imports or not (torchtitan never); returns the
    probes asked for."""
    asked: list[str] = []

    def imports(what: str) -> bool:
        asked.append(what)
        return vllm if what == "vllm" else False

    monkeypatch.setattr(gpu_defaults, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(gpu_defaults, "imports", imports)
    return asked
