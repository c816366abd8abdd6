"""The transformers engine's own settings (`--generator.transformers.*`). Imports neither torch nor transformers, so
`meshrl.config` can nest it cheaply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshrl.errors import ConfigError

ATTN_IMPLS = ("auto", "triton", "sdpa", "matmul")
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass
class TransformersEngineConfig:
    """Settings of `TransformersEngine` that the generator's shared ones (dtype, max_model_len, max_num_seqs,
    kv_cache_memory_bytes) do not cover.

        TransformersEngine(model_dir, TransformersEngineConfig(cuda_graphs=False), max_model_len=512)
    """

    attn_impl: Literal["auto", "triton", "sdpa", "matmul"] = "auto"
    """Decode attention: 'triton' (one kernel per layer reading each row's keys/values once for all query heads
    that share them, up to the row's length; GPU), 'sdpa' (torch SDPA with a length mask), 'matmul' (two batched
    matmuls over the length bucket), or 'auto' (triton on GPU when it is installed and agrees with matmul on a
    self-check at start, else matmul)."""
    cuda_graphs: bool = True
    """Capture decode steps as CUDA graphs (GPU only; one per batch bucket x length bucket, captured on first use)."""
    fused_norm: bool | None = None
    """Replace Llama/Qwen RMSNorm by one Triton kernel each (checked against the model's own at start). None: on GPU."""
    sync_every: int = 16
    """Decode steps between host reads of the sampled tokens (stop checks) when no row uses top-k/top-p; 1 reads
    after every step."""
    max_prefill_tokens: int = 16384
    """Token budget of one batched prefill (distinct prompts x the longest of them)."""
    gpu_memory_utilization: float = 0.5
    """With kv_cache_memory_bytes unset on a GPU: the fraction of the device's total memory this engine's process may
    hold (weights + KV cache + logits), as vLLM's setting of that name; the KV cache takes what is left of it (and
    of the free memory). 0.5 leaves the other half to a trainer on the same GPU (which gets the cache's memory too
    while the generator sleeps: controller/memory.py); raise it (0.9) for a GPU of its own."""
    len_bucket_step: int = 256
    """Spacing of the attention-length buckets past 256 tokens: finer buckets read less padding but capture more
    CUDA graphs."""
    remappable_kv_cache: bool | None = None
    """Put the KV cache at virtual addresses reserved for the engine's lifetime (CUDA virtual memory management), so
    a level-1 sleep gives its memory back but keeps the CUDA graphs (no recapture on wake-up; the graphs' memory
    pool and the decode logits stay resident: hundreds of MiB at most). None: on a GPU whose driver supports it,
    else a plain torch tensor (the reason in the engine's `kv_vmm_fallback`); True: required (start-up fails
    where it cannot be used); False: a plain torch tensor, dropped on sleep with the graphs."""

    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """What the KV cache stores. 'auto': the model's dtype (exact). 'fp8': float8 e4m3 with one float32 scale per
    token and kv head (each key / value vector divided by its largest magnitude / 448): half the bytes of a bf16
    cache (a quarter of float32), so twice the sequences fit, and decode attention, which reads the whole cache
    every step, ran 1.3-1.5x faster at 1-2k tokens of context on an H100 (bench/decode_attention.py). Changes
    numerics: sampled tokens follow a policy whose keys and values are rounded to 3 mantissa bits (up to 6 %
    relative error per element); the trainer's logprobs do not see the rounding. Prompt attention during prefill
    uses the exact keys."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"generator.transformers.kv_cache_dtype={self.kv_cache_dtype!r}; use one of {list(KV_CACHE_DTYPES)}"
            )
        if self.attn_impl not in ATTN_IMPLS:
            raise ConfigError(f"generator.transformers.attn_impl={self.attn_impl!r}; use one of {list(ATTN_IMPLS)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"generator.transformers.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.remappable_kv_cache not in (None, True, False):
            raise ConfigError(
                f"generator.transformers.remappable_kv_cache={self.remappable_kv_cache!r}; use true, false or None"
            )
        for name in ("sync_every", "max_prefill_tokens", "len_bucket_step"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"generator.transformers.{name}={getattr(self, name)} must be >= 1")


__all__ = ["ATTN_IMPLS", "KV_CACHE_DTYPES", "TransformersEngineConfig"]
