"""meshrl's 'transformers' generation engine: continuous batching over a preallocated KV cache, for any transformers
causal LM whose attention goes through transformers' attention interface (Qwen2/Qwen3, Llama, Mistral, GPT-2, ...:
rotary or learned absolute position embeddings alike, since positions go in as `position_ids`), and for the
vision-language models whose language model is one (Qwen2.5-VL, Qwen3-VL: image prompts, `generate(..., images=)`).
Nothing here imports vLLM or torchtitan, so it runs on the GPU machine's preinstalled torch.

One job per file, as nano-vllm's `engine/`:

| file               | job                                                                                  |
| ------------------ | ------------------------------------------------------------------------------------ |
| `config.py`        | `TransformersEngineConfig`, the engine's own settings (`--generator.transformers.*`) |
| `engine.py`        | `TransformersEngine`: validation, `generate` = schedule -> run -> postprocess, sleep / wake    |
| `sequence.py`      | `Sequence`: one completion in the making                                             |
| `scheduler.py`     | admission into KV slots, compaction of running rows, decode chunks (host side only)  |
| `model_runner.py`  | the model, the static KV cache, prefill / decode steps, CUDA graphs                  |
| `device_memory.py` | `RemappableBuffer`: the KV cache at fixed addresses (CUDA VMM), freed while asleep   |
| `sampler.py`       | counter-based noise, two-level inverse CDF, `sample` (temperature / top-k / top-p)   |
| `attention.py`     | the KV attention function registered with transformers, and its context              |
| `kernels.py`       | Triton decode attention and fused RMSNorm, with their self-checks                    |

Importing this package imports neither torch nor transformers until `TransformersEngine` is used (`meshrl.config`
nests the config).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshrl.generation.transformers_engine.config import TransformersEngineConfig

if TYPE_CHECKING:
    from meshrl.generation.transformers_engine.engine import TransformersEngine

__all__ = ["TransformersEngine", "TransformersEngineConfig"]


def __getattr__(name: str) -> Any:
    if name == "TransformersEngine":
        from meshrl.generation.transformers_engine.engine import TransformersEngine

        return TransformersEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
