"""`TransformersEngine`: requests in, completions out. Each iteration of `generate` reads

    scheduler.schedule_*()  ->  runner.prefill / compact / decode  ->  scheduler.postprocess_*()

(scheduler.py decides, model_runner.py runs on the device). Implements `meshrl.generation.base.Engine`.

A vision-language checkpoint (Qwen2.5-VL, Qwen3-VL) generates from image prompts: the prompt ids hold the expanded
image tokens (`meshrl.models.vision`: `VisionInputs.expand`), `images[i]` prompt i's encoded images:

    engine = TransformersEngine(vlm_dir, max_model_len=512)
    groups = engine.generate([ids], SamplingParams(n=4, max_tokens=64), 0, images=[(wire_image(pil).data,)])
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Mapping
from typing import Any

import torch

from meshrl.devices import ieee_float32_convolutions
from meshrl.generation.base import DTYPES, check_prompts, check_sleep_level, check_tokens, process_memory
from meshrl.generation.transformers_engine.config import TransformersEngineConfig
from meshrl.generation.transformers_engine.model_runner import ModelRunner
from meshrl.generation.transformers_engine.scheduler import Scheduler
from meshrl.generation.transformers_engine.sequence import Sequence
from meshrl.models.hf_config import stop_token_ids
from meshrl.types import Completion, SamplingParams

DEFAULT_MAX_NUM_SEQS = 256


class TransformersEngine:
    """A transformers model with a static KV cache, continuous batching and (on GPU) CUDA-graph decode steps.

        engine = TransformersEngine(model_dir, TransformersEngineConfig(attn_impl="sdpa"), max_model_len=512)

    `config`: the engine's own settings (`TransformersEngineConfig`); its fields may also be passed as keyword
    overrides (`TransformersEngine(model_dir, attn_impl="sdpa")`). `max_num_seqs` (None: 256): slots of the KV cache
    (sequences decoded together); it is lowered to what `kv_cache_memory_bytes` holds. `kv_cache_memory_bytes`
    None: 64 MiB on CPU; on GPU 90 % of what the device has free once the weights are loaded. `device` None: this
    process's current CUDA device, else the CPU.
    """

    loads_in_workers = False  # weights are copied in this process (see base.Engine)
    supports_sleep = True

    def __init__(
        self,
        model_dir: str,
        config: TransformersEngineConfig | None = None,
        *,
        dtype: str = "float32",
        max_model_len: int = 256,
        max_num_seqs: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        device: str | torch.device | None = None,
        **overrides: Any,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise FileNotFoundError(
                f"{model_dir!r} has no config.json; TransformersEngine needs an HF-format model directory "
                "(config.json + *.safetensors), e.g. written by save_pretrained"
            )
        self.config = dataclasses.replace(config or TransformersEngineConfig(), **overrides)
        self.model_dir, self.dtype, self.torch_dtype = model_dir, dtype, DTYPES[dtype]
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        ieee_float32_convolutions(dtype, self.device)  # as the trainer's, so that both compute alike
        self.runner = ModelRunner(
            model_dir,
            self.config,
            torch_dtype=self.torch_dtype,
            device=self.device,
            max_model_len=max_model_len,
            max_num_seqs=DEFAULT_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
        )
        self.vocab_size = self.runner.vocab_size
        # A vision-language model's image inputs (`meshrl.models.vision.VisionInputs`), None for a causal LM.
        self.vision = self.runner.vision
        self.placeholder_ids: tuple[int, ...] = self.vision.placeholder_ids if self.vision is not None else ()
        self._max_model_len = self.runner.max_model_len
        self.num_slots = self.runner.num_slots
        self.kv_cache_bytes = self.runner.kv_cache_bytes
        self.sync_every = self.config.sync_every
        self.max_prefill_tokens = self.config.max_prefill_tokens
        self._rng = random.Random(seed)
        # Every request stops at these (with its own stop_token_ids): generation_config's eos ids, config's and the
        # tokenizer's, as `meshrl.models.hf_config.stop_token_ids` unions them.
        self.eos_ids = frozenset(stop_token_ids(model_dir))
        self._sleep_level = 0
        self._ipc_receiver = None  # load_weights_ipc's, opened on first use

    # ------------------------------------------------------------------ properties

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    # What the runner chose at start (benchmarks and tests read them here).
    model = property(lambda self: self.runner.model)
    stats = property(lambda self: self.runner.stats)
    attn_impl = property(lambda self: self.runner.attn_impl)
    attn_fallback = property(lambda self: self.runner.attn_fallback)
    attn_launch_fallback = property(lambda self: self.runner.attn_launch_fallback)
    fused_norm = property(lambda self: self.runner.fused_norm)
    norm_fallback = property(lambda self: self.runner.norm_fallback)
    use_graphs = property(lambda self: self.runner.use_graphs)
    graph_failures = property(lambda self: self.runner.graph_failures)
    remappable_kv = property(lambda self: self.runner.remappable_kv)
    kv_vmm_fallback = property(lambda self: self.runner.kv_vmm_fallback)

    # ------------------------------------------------------------------ validation

    def _check_images(
        self, seqs: list[list[int]], images: list[tuple[bytes, ...]] | None, what: str
    ) -> list[tuple[bytes, ...]]:
        """One tuple of images per sequence (empty for none); a vision-language model's sequences must hold exactly
        the image tokens their images make."""
        if images is None:
            images = [()] * len(seqs)
        elif len(images) != len(seqs):
            raise ValueError(f"{len(images)} image lists for {len(seqs)} {what}s; give one per {what}")
        images = [tuple(own or ()) for own in images]
        if self.vision is None:
            if any(images):
                raise ValueError(f"{what}s with images, but {self.model_dir} is not a vision-language checkpoint")
            return images
        for i, (s, own) in enumerate(zip(seqs, images, strict=True)):
            self.vision.check(s, own, f"{what} {i}")
        return images

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        policy_version: int,
        images: list[tuple[bytes, ...]] | None = None,
    ) -> list[list[Completion]]:
        """Sample `params.n` completions per prompt. Returns one list of `Completion`s per prompt, in order.

        temperature 0 is greedy (the n completions are then identical). With `params.seed` set, prompt i's
        sample j uses seed `params.seed + i * n + j`: a call is reproducible and no two samples share noise.
        A sleeping engine wakes up first. `images`: per prompt, its encoded images (a vision-language model; the
        prompt holds their expanded image tokens; an empty tuple for a text prompt). A vision-language model never
        samples an image placeholder: the logprobs are those of the distribution without them, as the trainer's.
        """
        prompts = check_prompts(prompts, params.max_tokens, self._max_model_len, self.vocab_size)
        if not prompts:
            return []
        images = self._check_images(prompts, images, "prompt")
        self.wake_up()
        greedy = params.temperature == 0
        n_run = 1 if greedy else params.n
        stop = frozenset(int(t) for t in params.stop_token_ids) | self.eos_ids
        seqs = []
        for i, p in enumerate(prompts):
            for j in range(n_run):
                seed = self._rng.getrandbits(63) if params.seed is None else params.seed + i * params.n + j
                seqs.append(Sequence(i, p, seed, params, stop, images=images[i]))
        scheduler = Scheduler(
            seqs, num_slots=self.num_slots, max_prefill_tokens=self.max_prefill_tokens, sync_every=self.sync_every
        )
        while not scheduler.is_finished():
            self.step(scheduler)
        results: list[list[Completion]] = [[] for _ in prompts]
        for r in seqs:
            c = Completion(list(r.prompt), r.tokens, r.logprobs, r.finish_reason or "length", policy_version)
            results[r.prompt_index].append(c)
        if greedy and params.n > 1:
            results = [
                [Completion(list(c.prompt_ids), list(c.token_ids), list(c.logprobs), c.finish_reason, c.policy_version)
                 for _ in range(params.n)]
                for (c,) in results
            ]  # fmt: skip
        return results

    def step(self, scheduler: Scheduler) -> None:
        """One iteration of continuous batching: admit queued sequences into free slots (one batched prefill),
        close the holes finished rows left, then decode every running row (one step, or a chunk of device-loop
        steps). Finished rows leave at once; their slots are reused on the next iteration."""
        if (prefill := scheduler.schedule_prefill()) is not None:
            scheduler.postprocess_prefill(prefill, *self.runner.prefill(prefill))
        if (compaction := scheduler.schedule_compaction()) is not None:
            self.runner.compact(compaction)
        if (decode := scheduler.schedule_decode()) is not None:
            scheduler.postprocess_decode(decode, *self.runner.decode(decode))

    # ------------------------------------------------------------------ scoring

    def prompt_logprobs(
        self, sequences: list[list[int]], images: list[tuple[bytes, ...]] | None = None
    ) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t = 1 .. len(seq)-1 of each sequence (raw logits, temperature 1).

        `images`: per sequence, its encoded images (a vision-language model). As in the trainer, a vision-language
        model's image placeholders are left out of the distribution, and an image token as a target scores 0."""
        sequences = [[int(t) for t in s] for s in sequences]
        for i, s in enumerate(sequences):
            check_tokens("sequence", i, s, self.vocab_size)
            if len(s) > self._max_model_len:
                raise ValueError(
                    f"sequence {i} has {len(s)} tokens > max_model_len={self._max_model_len}; truncate it or "
                    f"build the engine with max_model_len >= {len(s)}"
                )
        images = self._check_images(sequences, images, "sequence")
        results: list[list[float]] = [[] for _ in sequences]
        todo = [i for i, s in enumerate(sequences) if len(s) >= 2]
        if todo:
            self.wake_up()
        budget = max(1, self.max_prefill_tokens)
        start = 0
        while start < len(todo):  # chunks of sequences within the prefill token budget
            end = start + 1
            while (
                end < len(todo) and (end + 1 - start) * max(len(sequences[j]) for j in todo[start : end + 1]) <= budget
            ):
                end += 1
            chunk = self.runner.score([sequences[j] for j in todo[start:end]], [images[j] for j in todo[start:end]])
            for k, lp in enumerate(chunk):
                results[todo[start + k]] = lp
            start = end
        return results

    # ------------------------------------------------------------------ weights

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the model in place (cast to the engine dtype). The KV cache and the
        captured CUDA graphs stay valid (same storage). `lm_head.weight` may be absent when tied. Works while
        asleep (level 2: into the weights held in host memory)."""
        if not state_dict:
            raise ValueError("load_weights got an empty state dict")
        self.runner.load_weights(state_dict)

    def load_weight_pieces(self, pieces) -> None:
        """`load_weights` from each tensor's blocks (`weight_sync.shards.WeightPieces`), copied straight into the
        weights: no whole tensor is put together first (with several trainer ranks every weight comes in blocks)."""
        if not pieces:
            raise ValueError("load_weight_pieces got no weights")
        self.runner.load_weight_pieces(pieces)

    def load_weights_ipc(self, handle, version: int | None = None) -> int:
        """`load_weights` from a trainer's shared flat buffer (`meshrl.weight_sync.shared_buffer`: a same-GPU CUDA
        buffer or its /dev/shm backing on CPU), opened once in this process and kept; returns the version loaded."""
        from meshrl.weight_sync.shared_buffer import SharedBufferReceiver

        rx = self._ipc_receiver
        if rx is None or rx.handle.control_path != handle.control_path:
            if rx is not None:
                rx.close()
            rx = self._ipc_receiver = SharedBufferReceiver(handle)
        return rx.load_into(self, version)

    # ------------------------------------------------------------------ sleep mode (colocated trainer)

    def sleep(self, level: int = 1) -> None:
        """Level 1: free the KV cache (the weights stay on the device, and `load_weights` still works). With the
        cache at reserved addresses (`remappable_kv`: CUDA VMM) only its memory goes, and the CUDA graphs and the
        decode logits stay for the wake-up; else the decode logits and the graphs go too. Level 2: also the graphs
        and the logits, and the weights move to host memory. Deeper than the current level only; `wake_up` (or the
        next `generate`) undoes it."""
        level = check_sleep_level(level)
        if level <= self._sleep_level:
            return
        # Level 1 -> 2 too: the graphs a level-1 sleep kept read the weights' addresses, which move now.
        self.runner.free_cache(keep_graphs=level == 1)
        if level == 2:
            self.runner.move_weights(torch.device("cpu"))
        self._sleep_level = level

    def wake_up(self) -> None:
        """Weights back on the device (after level 2), a zeroed KV cache (at its old addresses with
        `remappable_kv`, where the graphs a level-1 sleep kept replay as they are); CUDA graphs dropped are
        captured again on first use. Generation afterwards equals generation without the sleep. No-op when awake."""
        if self._sleep_level == 0:
            return
        if self._sleep_level == 2:
            self.runner.move_weights(self.device)
        self.runner.allocate_cache()
        self._sleep_level = 0

    def memory(self) -> dict[str, Any]:
        """`base.process_memory` of the engine's device, plus 'kv_cache_bytes' (0 while asleep) and 'sleep_level'.
        A `remappable_kv` cache's memory, which torch's allocator does not see, is counted in 'allocated_bytes' and
        'reserved_bytes' while mapped (as a torch-allocated cache would be)."""
        out = process_memory(self.device)
        if self.runner.remappable_kv and self.runner.has_cache:
            out["allocated_bytes"] += self.runner.kv_mapped_bytes
            out["reserved_bytes"] += self.runner.kv_mapped_bytes
        out["kv_cache_bytes"] = self.kv_cache_bytes if self.runner.has_cache else 0
        out["sleep_level"] = self._sleep_level
        return out

    # ------------------------------------------------------------------ teardown

    def shutdown(self) -> None:
        """Free the model, the cache and the graphs. The object is unusable afterwards."""
        if self._ipc_receiver is not None:
            self._ipc_receiver.close()
            self._ipc_receiver = None
        self.runner.shutdown()


__all__ = ["DEFAULT_MAX_NUM_SEQS", "TransformersEngine"]
