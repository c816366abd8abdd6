"""The vLLM engine's own settings (`--generator.vllm.*`). Imports neither torch nor vLLM, so `meshrl.config` can nest
it cheaply; `VLLMEngine` resolves the None defaults once it knows the device."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.errors import ConfigError


@dataclass
class VLLMEngineConfig:
    """Settings of `VLLMEngine` that the generator's shared ones (dtype, max_model_len, max_num_seqs,
    kv_cache_memory_bytes) do not cover.

        VLLMEngine(model_dir, VLLMEngineConfig(tensor_parallel_size=2), max_model_len=4096)
    """

    enforce_eager: bool | None = None
    """Run the model eagerly instead of with CUDA graphs / torch.compile. None: eager on CPU, graphs on GPU."""
    gpu_memory_utilization: float = 0.5
    """GPU: the fraction of the device's memory the engine may take (weights + KV cache + activations); with
    kv_cache_memory_bytes=None the KV cache gets what is left of it after the weights."""
    tensor_parallel_size: int = 1
    """GPUs the model is sharded over (one engine replica)."""
    enable_sleep_mode: bool | None = None
    """Let `sleep` free the KV cache (and weights) while a colocated trainer trains. None: on for GPU; vLLM has no
    sleep mode on CPU (sleep / wake_up are then no-ops)."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV of shared prompt prefixes (the samples of a group). None: vLLM's default."""
    enable_chunked_prefill: bool = False
    """Split long prompts over scheduler steps. Off: on CPU a seeded request that is prefilled in parts makes vLLM
    rewind its sampling generator, which the CPU build cannot do (batches over 4096 prompt tokens crashed), and
    per-request seeds are how meshrl makes sampling reproducible."""
    max_num_batched_tokens: int | None = None
    """Tokens one scheduler step may process. None: max(4096, max_model_len) without chunked prefill (a step must
    hold the longest prompt), vLLM's default with it."""

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"generator.vllm.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"generator.vllm.tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"generator.vllm.max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")


__all__ = ["VLLMEngineConfig"]
