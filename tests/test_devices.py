"""Pinning processes to GPUs (meshrl.devices): which GPU each trainer rank and generator replica sees, checked
without a GPU (the pinning is an environment variable set before CUDA starts)."""

from __future__ import annotations

import pytest
from markers import needs_cuda

from meshrl.config import ConfigError, GeneratorConfig, TrainerConfig
from meshrl.devices import device_of, pin_process


def test_each_role_gets_its_devices():
    trainer, generator = [0, 1], [2, 3]
    assert [device_of(trainer, r) for r in range(2)] == [0, 1]
    assert [device_of(generator, r) for r in range(4)] == [2, 3, 2, 3]  # more replicas than GPUs: they share
    assert device_of(None, 5) is None


def test_pin_process_restricts_what_the_process_sees(monkeypatch):
    # setenv first: monkeypatch records (and later restores) only variables it touched, and delenv of an unset one
    # records nothing, so what pin_process sets would leak into later tests' spawned processes.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert pin_process([0, 1], 1) == 1
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and os.environ["LOCAL_RANK"] == "0"
    # Under a scheduler that already restricted the job, indices point into what it was given.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert pin_process([1], 0) == 1 and os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='4,6' gives this job 2"):
        pin_process([2], 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert pin_process(None, 0) is None and os.environ["CUDA_VISIBLE_DEVICES"] == "3"  # unset: untouched


def test_device_flags_are_checked():
    with pytest.raises(ConfigError, match="one GPU per rank"):
        TrainerConfig(num_procs=2, device="cuda", devices=[0])
    with pytest.raises(ConfigError, match="trainer.device='cpu'"):
        TrainerConfig(num_procs=1, devices=[0])
    with pytest.raises(ConfigError, match="generator.devices"):
        GeneratorConfig(devices=[-1])
    assert TrainerConfig(num_procs=2, device="cuda", devices=[0, 1]).devices == [0, 1]
    with pytest.raises(ConfigError, match="offload_optimizer.*trainer.device='cpu'"):
        TrainerConfig(num_procs=1, offload_optimizer=True)
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        TrainerConfig(num_procs=1, max_tokens_per_micro_batch=1)


def test_cli_places_trainer_and_generator_apart():
    import tyro

    from meshrl.config import GRPORunConfig

    cfg = tyro.cli(
        GRPORunConfig,
        args=["--trainer.device", "cuda", "--trainer.num-procs", "1", "--trainer.devices", "0",
              "--generator.devices", "1"],
    )  # fmt: skip
    assert device_of(cfg.trainer.devices, 0) != device_of(cfg.generator.devices, 0)


def test_machine_identity_is_shared_by_the_processes_of_this_machine():
    """The controller kills a frozen trainer's pids only when they are its own machine's (machine_identity)."""
    import subprocess
    import sys

    from meshrl.devices import machine_identity

    out = subprocess.run(
        [sys.executable, "-c", "from meshrl.devices import machine_identity; print(machine_identity())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == machine_identity() and machine_identity().count("/") == 2


def test_float32_on_a_gpu_turns_off_tf32_convolutions_and_nothing_else_does(monkeypatch):
    import torch

    from meshrl.devices import ieee_float32_convolutions

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # torch's default; restored after the test
    assert not ieee_float32_convolutions("float32", "cpu") and torch.backends.cudnn.allow_tf32
    assert not ieee_float32_convolutions("bfloat16", "cuda:0") and torch.backends.cudnn.allow_tf32
    assert ieee_float32_convolutions("float32", "cuda:0") and not torch.backends.cudnn.allow_tf32
    assert torch.backends.cudnn.conv.fp32_precision in ("ieee", "none")  # torch's reads of either API still work


@needs_cuda
def test_a_float32_patch_embedding_convolution_equals_its_matmul_on_a_gpu(monkeypatch):
    """A vision tower's patch embedding as transformers runs it (Conv3d, stride = kernel) and as vLLM does (a
    float32 matmul over the flattened patches) agree once float32 convolutions are IEEE; TF32 (torch's default for
    cuDNN) left them ~1e-3 apart relative on an H100 at the real tower's size."""
    import torch

    from meshrl.devices import ieee_float32_convolutions

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    gen = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv3d(3, 1280, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False).cuda()
    x = torch.randn(256, 3, 2, 14, 14, generator=gen).cuda()
    matmul = x.flatten(1) @ conv.weight.flatten(1).T
    ieee_float32_convolutions("float32", "cuda")
    torch.testing.assert_close(conv(x).flatten(1), matmul, rtol=1e-5, atol=1e-5)
