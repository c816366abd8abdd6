"""`--placement.gpus N`: the layout measured fastest for N GPUs of one machine (issues 32, 33), filled in where the user
placed nothing, refused where it cannot apply. Config only: no process, no GPU."""

import dataclasses

import pytest

from meshrl.config import GRPORunConfig
from meshrl.controller.cli import parse_run_config
from meshrl.errors import ConfigError
from meshrl.placement import gpu_layout
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
    assert "1 trainer rank(s) on GPU [0], 1 generator(s) on GPU [1], max-staleness 1, micro-batches of up to 128" in (
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


def test_four_and_eight_gpus_split_half_trainer_ranks_half_generators():
    cfg = _cfg("--placement.gpus", "4", "--trainer.micro-batch-size", "32")
    assert (cfg.trainer.num_procs, cfg.trainer.devices) == (1, [0])  # the preset's one rank, as given
    plain = parse_run_config(GRPORunConfig, argv=["--trainer.device", "cuda", "--placement.gpus", "4"])
    assert (plain.trainer.num_procs, plain.trainer.devices) == (2, [0, 1])
    assert (plain.generator.num_replicas, plain.generator.devices, plain.grpo.max_staleness) == (2, [2, 3], 1)
    assert plain.trainer.micro_batch_size == 256  # 128 per rank: the cap counts sequences over all ranks
    assert "measured 0.29x" in plain.gpu_layout_note()
    eight = parse_run_config(GRPORunConfig, argv=["--trainer.device", "cuda", "--placement.gpus", "8"])
    assert (eight.trainer.devices, eight.generator.devices) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert (eight.generator.num_replicas, eight.trainer.micro_batch_size, eight.grpo.max_staleness) == (4, 512, 1)
    assert "not measured yet" in eight.gpu_layout_note()


@pytest.mark.parametrize(
    "gpus, trainer, generators",
    [(1, [0], [0]), (2, [0], [1]), (3, [0], [1, 2]), (4, [0, 1], [2, 3]), (6, [0, 1], [2, 3, 4, 5]),
     (8, [0, 1, 2, 3], [4, 5, 6, 7]), (16, [0, 1, 2, 3, 4, 5, 6, 7], list(range(8, 16)))],
)  # fmt: skip
def test_every_gpu_count_gets_a_layout_using_every_gpu_once(gpus, trainer, generators):
    layout = gpu_layout(gpus)
    assert (layout.trainer_gpus, layout.generator_gpus, layout.asynchronous) == (trainer, generators, gpus > 1)
    assert sorted(set(trainer) | set(generators)) == list(range(gpus))  # no GPU idle
    assert 256 % len(trainer) == 0  # a power of two ranks: the usual batch sizes split evenly over them


def test_trainer_ranks_on_every_gpu_are_colocated_with_a_generator_each():
    cfg = parse_run_config(
        GRPORunConfig, argv=["--trainer.device", "cuda", "--placement.gpus", "4", "--trainer.num-procs", "4"]
    )
    assert (cfg.trainer.devices, cfg.generator.devices, cfg.generator.num_replicas) == ([0, 1, 2, 3], [0, 1, 2, 3], 4)
    assert (cfg.grpo.max_staleness, cfg.trainer.micro_batch_size) == (0, 128)  # synchronous, 32 per rank
    assert "colocated" in cfg.gpu_layout_note()
    # the user's trainer rank count: generators take the other GPUs
    cfg = parse_run_config(
        GRPORunConfig, argv=["--trainer.device", "cuda", "--placement.gpus", "4", "--trainer.num-procs", "1"]
    )
    assert (cfg.trainer.devices, cfg.generator.devices, cfg.grpo.max_staleness) == ([0], [1, 2, 3], 1)
    assert cfg.generator.num_replicas == 3 and "not a measured layout" in cfg.gpu_layout_note()


def test_placement_layout_names_split_or_colocated_for_any_count():
    coloc = parse_run_config(
        GRPORunConfig, argv=["--trainer.device", "cuda", "--placement.gpus", "2", "--placement.layout", "colocated"]
    )
    assert (coloc.trainer.devices, coloc.generator.devices, coloc.grpo.max_staleness) == ([0, 1], [0, 1], 0)
    assert coloc.trainer.micro_batch_size == 64 and "colocated" in coloc.gpu_layout_note()
    # a rank for each of 2 GPUs, given as a flag, though 2 is also the CPU default of --trainer.num-procs
    ranks = parse_run_config(GRPORunConfig, argv=["--placement.gpus", "2", "--trainer.num-procs", "2"])
    assert (ranks.trainer.devices, ranks.generator.devices, ranks.grpo.max_staleness) == ([0, 1], [0, 1], 0)
    split = parse_run_config(
        GRPORunConfig, argv=["--placement.gpus", "2", "--trainer.num-procs=2", "--placement.layout", "auto"]
    )
    assert (split.trainer.devices, split.generator.devices) == ([0], [1])  # the layout flag, when given, decides
    for gpus, trainer in ((2, [0]), (4, [0, 1]), (8, [0, 1, 2, 3])):
        split = gpu_layout(gpus, layout="split")
        assert (split.trainer_gpus, split.asynchronous) == (trainer, True)
        assert gpu_layout(gpus, layout="colocated").generator_gpus == list(range(gpus))
    with pytest.raises(ConfigError, match="--placement.layout split with --placement.gpus 1: splitting needs a GPU"):
        gpu_layout(1, layout="split")
    placement = GRPORunConfig().placement
    with pytest.raises(ConfigError, match=r"--placement.layout 'ring': use one of auto, split, colocated"):
        dataclasses.replace(placement, gpus=2, layout="ring")
    with pytest.raises(ConfigError, match="--placement.layout colocated lays out --placement.gpus N"):
        dataclasses.replace(placement, layout="colocated")


def test_layouts_that_cannot_apply_are_refused_naming_the_flag():
    base = GRPORunConfig()
    with pytest.raises(ConfigError, match=r"--placement.gpus 0: give 1 or more GPUs"):
        dataclasses.replace(base.placement, gpus=0)
    # --placement.gpus implies the trainer's device: a user need not also say --trainer.device cuda.
    implied = dataclasses.replace(base, placement=dataclasses.replace(base.placement, gpus=2))
    assert implied.trainer.device == "cuda" and implied.trainer.devices == [0]
    trainer = dataclasses.replace(base.trainer, device="cuda", num_procs=4)
    with pytest.raises(ConfigError, match="--placement.gpus 2 with --trainer.num-procs 4: one trainer rank per GPU"):
        dataclasses.replace(base, trainer=trainer, placement=dataclasses.replace(base.placement, gpus=2))
    with pytest.raises(ConfigError, match="--placement.gpus lays out the GPUs of this machine.*--placement process"):
        dataclasses.replace(base.placement, gpus=2, kind="process")


def test_more_gpus_than_this_process_sees_is_a_config_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match=r"--placement.gpus 2, but this process sees 1 GPU \(CUDA_VISIBLE_DEVICES"):
        check_gpu_count(2)
    check_gpu_count(1)
