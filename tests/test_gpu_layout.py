"""`--placement.gpus N`: the layout measured fastest for N GPUs of one machine (issue 32), filled in where the user
placed nothing, refused where it cannot apply. Config only: no process, no GPU."""

import dataclasses

import pytest

from meshrl.config import GRPORunConfig
from meshrl.controller.cli import parse_run_config
from meshrl.errors import ConfigError
from meshrl.preflight import check_gpu_count

GPU = [
    "--preset",
    "tiny-reverse",
    "--trainer.num-procs",
    "1",
    "--trainer.device",
    "cuda",
    "--generator.weight-sync",
    "auto",
]


def _cfg(*flags: str) -> GRPORunConfig:
    return parse_run_config(GRPORunConfig, argv=[*GPU, *flags])


def test_two_gpus_split_trainer_and_generator_and_run_ahead():
    cfg = _cfg("--placement.gpus", "2")
    assert (cfg.trainer.devices, cfg.generator.devices, cfg.grpo.max_staleness) == ([0], [1], 1)
    assert cfg.trainer.micro_batch_size == 64  # the preset's
    # Left at its default, the micro-batch cap grows: the trainer has its GPU to itself.
    plain = parse_run_config(GRPORunConfig, argv=["--trainer.device", "cuda", "--placement.gpus", "2"])
    assert (plain.trainer.num_procs, plain.trainer.micro_batch_size) == (1, 128)  # the defaults are CPU's
    assert "trainer on GPU [0], generators on GPU [1], max-staleness 1, micro-batches of up to 128" in (
        plain.gpu_layout_note()
    )
    # a copy (as the programs make with dataclasses.replace) keeps the same layout
    again = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name="copy"))
    assert (again.trainer.devices, again.generator.devices, again.grpo.max_staleness) == ([0], [1], 1)


def test_one_gpu_shares_it_synchronously():
    cfg = _cfg("--placement.gpus", "1")
    assert (cfg.trainer.devices, cfg.generator.devices, cfg.grpo.max_staleness) == ([0], [0], 0)
    assert cfg.trainer.micro_batch_size == 64  # the preset's: a shared GPU keeps it


def test_what_the_user_placed_wins():
    cfg = _cfg("--placement.gpus", "2", "--generator.devices", "0", "--grpo.max-staleness", "0")
    assert (cfg.trainer.devices, cfg.generator.devices, cfg.grpo.max_staleness) == ([0], [0], 0)  # shared: no async
    assert cfg.trainer.micro_batch_size == 64
    cfg = _cfg("--placement.gpus", "2", "--trainer.devices", "1", "--generator.devices", "0")
    assert (cfg.trainer.devices, cfg.generator.devices, cfg.grpo.max_staleness) == ([1], [0], 1)
    assert _cfg().placement.gpus is None and _cfg().gpu_layout_note() is None  # unset: nothing changes


def test_layouts_that_cannot_apply_are_refused_naming_the_flag():
    base = GRPORunConfig()
    with pytest.raises(ConfigError, match=r"--placement.gpus 4: layouts are measured for \[1, 2\].*--trainer.devices"):
        dataclasses.replace(base.placement, gpus=4)
    with pytest.raises(ConfigError, match="--placement.gpus 2 lays out GPUs, but --trainer.device is 'cpu'"):
        dataclasses.replace(base, placement=dataclasses.replace(base.placement, gpus=2))
    trainer = dataclasses.replace(base.trainer, device="cuda", num_procs=4)
    with pytest.raises(ConfigError, match="lays out one trainer rank.*--trainer.devices"):
        dataclasses.replace(base, trainer=trainer, placement=dataclasses.replace(base.placement, gpus=2))
    with pytest.raises(ConfigError, match="--placement.gpus lays out the GPUs of this machine.*--placement process"):
        dataclasses.replace(base.placement, gpus=2, kind="process")


def test_more_gpus_than_this_process_sees_is_a_config_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match=r"--placement.gpus 2, but this process sees 1 GPU \(CUDA_VISIBLE_DEVICES"):
        check_gpu_count(2)
    check_gpu_count(1)
