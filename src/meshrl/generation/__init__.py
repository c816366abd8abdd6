"""Generation engines behind one protocol (`base.Engine`): `VLLMEngine` (vllm_engine.py) and meshrl's own
'transformers' engine `TransformersEngine` (transformers_engine/), each with its config passed whole
(`VLLMEngineConfig`, `TransformersEngineConfig`). Importing this package never imports vLLM (the GPU machine may
not have it), torch or transformers: the engines are resolved lazily, and vllm_engine itself imports vLLM only
when an engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshrl.generation.transformers_engine.config import TransformersEngineConfig
from meshrl.generation.vllm_config import VLLMEngineConfig

if TYPE_CHECKING:
    from meshrl.generation.base import Engine
    from meshrl.generation.transformers_engine.engine import TransformersEngine
    from meshrl.generation.vllm_engine import VLLMEngine

__all__ = ["Engine", "TransformersEngine", "TransformersEngineConfig", "VLLMEngine", "VLLMEngineConfig"]

_LAZY = {
    "Engine": "meshrl.generation.base",
    "TransformersEngine": "meshrl.generation.transformers_engine.engine",
    "VLLMEngine": "meshrl.generation.vllm_engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
