"""Bad configs fail at launch (before any process is spawned) with messages that say what to change."""

import subprocess
import sys

import pytest

from meshrl.config import (
    ConfigError,
    GeneratorConfig,
    GRPOConfig,
    GRPORunConfig,
    TrainerConfig,
    validate_batch_arithmetic,
)
from meshrl.configs import PRESETS
from meshrl.controller.cli import parse_run_config
from meshrl.data.prompts import DataConfig
from meshrl.tasks.reverse import ReverseTaskConfig


def test_presets_are_valid():
    for name, preset in PRESETS.items():
        cfg = preset()
        assert isinstance(cfg, GRPORunConfig), name


def test_micro_batch_size_is_a_cap_not_a_divisor():
    """16 samples a step with the default cap of 32 were refused as 'not divisible' (issue 31, item 6): a cap larger
    than the batch is the batch, and a batch it does not divide takes one more, smaller call."""
    cfg = GRPORunConfig(trainer=TrainerConfig(num_procs=2), grpo=GRPOConfig(prompts_per_step=8, group_size=2))
    assert (
        cfg.trainer.micro_batch_size == 32
        and validate_batch_arithmetic(global_batch_size=16, micro_batch_size=32, dp=2, what="x") == 1
    )
    assert validate_batch_arithmetic(global_batch_size=30, micro_batch_size=4, dp=2, what="x") == 8
    with pytest.raises(ConfigError, match=r"global_batch_size=30 .* does not split evenly over trainer.num_procs=4"):
        GRPORunConfig(
            trainer=TrainerConfig(num_procs=4, micro_batch_size=4),
            grpo=GRPOConfig(prompts_per_step=15, group_size=2),
        )


def test_micro_batch_not_divisible_by_dp():
    with pytest.raises(ConfigError, match=r"micro_batch_size=5 is not divisible by trainer.num_procs=2"):
        TrainerConfig(num_procs=2, micro_batch_size=5)


def test_prompt_plus_completion_longer_than_engine_limit():
    with pytest.raises(ConfigError, match="max_model_len=16.*raise max_model_len to at least 18"):
        GRPORunConfig(generator=GeneratorConfig(max_model_len=16, max_tokens=12), reverse=ReverseTaskConfig(max_len=5))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ReverseTaskConfig(num_train=0), "training set is empty"),
        (lambda: GRPORunConfig(reward="math_verify=heavy"), "math_verify=heavy"),
        (
            lambda: GRPORunConfig(task="reverse", data=DataConfig(train="rows.jsonl")),
            "--data.train is given but --task is 'reverse'",
        ),
        (lambda: GRPOConfig(group_size=1), "at least 2 completions"),
        (lambda: GeneratorConfig(temperature=0.0), "temperature > 0"),
        (lambda: GRPOConfig(clip_low=1.5), "clip_low=1.5"),
    ],
)
def test_bad_values_are_named(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_cli_overrides_and_presets(capsys):
    cfg = parse_run_config(
        GRPORunConfig,
        argv=["--preset", "tiny-reverse", "--grpo.steps", "7", "--trainer.micro-batch-size", "32"],
    )
    assert cfg.grpo.steps == 7 and cfg.trainer.micro_batch_size == 32
    with pytest.raises(SystemExit, match="unknown preset"):
        parse_run_config(GRPORunConfig, argv=["--preset", "huge"])
    with pytest.raises(SystemExit):
        parse_run_config(GRPORunConfig, argv=["--grpo.prompts-per-step", "3", "--grpo.group-size", "3"])
    out = capsys.readouterr()
    assert "does not split evenly over trainer.num_procs=2" in " ".join((out.out + out.err).split())


def test_cli_help_lists_every_section():
    out = subprocess.run(
        [sys.executable, "-m", "meshrl.controller.grpo", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for field in (
        "--grpo.group-size",
        "--trainer.micro-batch-size",
        "--generator.max-model-len",
        "--optim.lr",
        "--warmup.steps",
        "--task",
        "--reward",
        "--data.train",
        "--data.prompt-field",
        "--data.on-bad-row",
        "--reasoning-gym.size",
        "--render.system-prompt",
        "--scoring.timeout-s",
        "--eval.samples",
        "--reverse.num-train",
        "--model.path",
        "--env.name",
        "--env.max-turns",
        "--env.kwargs",
    ):
        assert field in out.stdout, field
    assert "tiny-reverse" in out.stdout  # the presets are listed


def test_every_config_field_has_help_text():
    """tyro shows a field's docstring as its --help text: every field of every program's config has one."""
    import dataclasses

    from tyro import _docstrings

    from meshrl.config import EvalRunConfig, SFTRunConfig

    def undocumented(cls, seen):
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(default):
                if type(default) not in seen:
                    seen.add(type(default))
                    yield from undocumented(type(default), seen)
            elif not _docstrings.get_field_docstring(cls, f.name, ()):
                yield f"{cls.__name__}.{f.name}"

    missing = sorted({name for c in (GRPORunConfig, SFTRunConfig, EvalRunConfig) for name in undocumented(c, set())})
    assert missing == []
