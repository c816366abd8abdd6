"""The 'transformers' engine under its historical import path: the code lives in
`meshrl.generation.transformers_engine` (one job per file); this module re-exports its public names."""

from __future__ import annotations

from meshrl.generation.transformers_engine.attention import ATTN_NAME
from meshrl.generation.transformers_engine.config import TransformersEngineConfig
from meshrl.generation.transformers_engine.engine import HFEngine
from meshrl.generation.transformers_engine.kernels import (
    decode_attention_triton,
    rmsnorm_triton,
    triton_decode_supported,
)
from meshrl.generation.transformers_engine.sampler import inverse_cdf, sample, uniform_noise, uniform_noise_torch

__all__ = [
    "ATTN_NAME",
    "HFEngine",
    "TransformersEngineConfig",
    "decode_attention_triton",
    "inverse_cdf",
    "rmsnorm_triton",
    "sample",
    "triton_decode_supported",
    "uniform_noise",
    "uniform_noise_torch",
]
