"""Generation backends. Importing this package never imports vLLM (the GPU machine may not have it).

`VLLMEngine` is resolved lazily: `from meshrl.generation import VLLMEngine` imports `vllm_engine`, which
itself imports vLLM only when an engine is constructed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshrl.generation.vllm_engine import VLLMEngine

__all__ = ["VLLMEngine"]


def __getattr__(name: str) -> Any:
    if name == "VLLMEngine":
        from meshrl.generation.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
