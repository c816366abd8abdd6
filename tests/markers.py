"""The skip markers the test files share (import them; do not define local copies).

`needs_cuda` also puts a test in the `gpu` lane: tests/conftest.py adds the `gpu` marker to every test that carries
it, so `pytest -m gpu` selects exactly the tests that need CUDA (and on a CPU machine they are skipped, not failed).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
"""The test needs a CUDA device: skipped on CPU, and in the `gpu` lane."""


needs_two_gpus = pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices of one host"
)
"""The test needs two GPUs (cross-GPU weight sync, the split layout): skipped elsewhere, and in the `gpu` lane."""


def _torchvision_error() -> str | None:
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # ImportError, or the RuntimeError of a CUDA build on the CPU torch
        return f"{type(e).__name__}: {e}"
    return None


TORCHVISION_ERROR = _torchvision_error()
needs_torchvision = pytest.mark.skipif(
    TORCHVISION_ERROR is not None,
    reason=f"vLLM's vision-language models and the Qwen-VL processors import torchvision ({TORCHVISION_ERROR})",
)
"""The test needs torchvision, which no build loads beside the CPU machines' torch (tests/test_vlm_models.py says
why): vLLM's vision-language models import it. Such tests run on the GPU machine (bench/gpu_run.sh vision-vllm)."""


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
"""The test runs vLLM (e.g. a program with --generator.engine vllm): the GPU machine's preinstalled stack lacks it."""


def is_needs_cuda(mark: pytest.Mark) -> bool:
    """Whether `mark` is `needs_cuda` or `needs_two_gpus` (a skipif mark compares by value, so this holds wherever
    it was applied)."""
    return mark in (needs_cuda.mark, needs_two_gpus.mark)
