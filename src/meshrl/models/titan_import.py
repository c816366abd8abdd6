"""Importing torchtitan's Qwen3 without paying for kernels a run does not use.

`torchtitan.models.common.attention` calls `torch.compile` twice while it is imported (flex attention and its
block-mask builder). Making those wrappers imports torch's inductor compiler, ~2 CPU-seconds per process on the
2-core CPU machine, in every trainer rank and in a controller that makes a model, although the SDPA kernel that CPU
runs use never calls them. `import_torchtitan_qwen3` imports torchtitan with those two wrappers made on first call
instead; `compile_deferred_kernels` makes them at once (what a run of the flex kernel or a compiled model does
before anything is traced, so that dynamo never meets a wrapper that is not made yet). torch.compile itself only
wraps: the compilation happens at the first call in both cases, so what runs is the same.

    import_torchtitan_qwen3()           # before any other torchtitan import of the process
    from torchtitan.models.qwen3 import Qwen3Model
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading

import torch

_lock = threading.Lock()


class DeferredCompile:
    """`torch.compile(fn, **kwargs)`, made at the first call or at `materialize()`."""

    def __init__(self, compile_fn, fn, kwargs: dict) -> None:
        # torch.compile reads its options when called: keep them as they are now, not as a caller may change them.
        self._compile, self._fn = compile_fn, fn
        self._kwargs = {k: dict(v) if isinstance(v, dict) else v for k, v in kwargs.items()}
        self._compiled = None
        functools.update_wrapper(self, fn)

    def materialize(self):
        with _lock:
            if self._compiled is None:
                self._compiled = self._compile(self._fn, **self._kwargs)
        return self._compiled

    def __call__(self, *args, **kwargs):
        return self.materialize()(*args, **kwargs)


def deferring(compile_fn):
    """`compile_fn` (torch.compile), except that a plain function's wrapper is a `DeferredCompile`. With
    TORCHDYNAMO_DISABLE=1 (meshrl's CPU vLLM engine sets it) torch.compile gives the function back at once, without
    inductor: that answer is taken now, as the variable reads now, not at a later first call."""

    def compile(model=None, **kwargs):
        if inspect.isfunction(model) and os.environ.get("TORCHDYNAMO_DISABLE", "") != "1":
            return DeferredCompile(compile_fn, model, kwargs)
        return compile_fn(model, **kwargs) if model is not None else compile_fn(**kwargs)

    return compile


def import_torchtitan_qwen3():
    """`torchtitan.models.qwen3`, imported (once per process) with the torch.compile calls its import makes on plain
    functions deferred (`DeferredCompile`). ImportError as the plain import raises it."""
    if (module := sys.modules.get("torchtitan.models.qwen3")) is not None:  # None there: the import raises
        return module
    real = torch.compile
    with _lock:
        torch.compile = deferring(real)
        try:
            import torchtitan.models.qwen3 as module
        finally:
            torch.compile = real
    return module


def compile_deferred_kernels() -> None:
    """Put the real torch.compile wrappers in place of the deferred ones: before a model with flex attention or a
    compiled model runs (dynamo traces into these functions; it must find them as torchtitan made them)."""
    import_torchtitan_qwen3()
    from torchtitan.models.common import attention

    for owner, name in ((attention.FlexAttention, "_compiled_flex_attn"), (attention, "_compiled_create_block_mask")):
        value = getattr(owner, name)
        if isinstance(value, DeferredCompile):
            setattr(owner, name, value.materialize())
