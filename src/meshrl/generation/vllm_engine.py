"""A thin, token-in / token-out wrapper around an in-process vLLM engine.

No Monarch here: the Generator actor owns one `VLLMEngine` and calls it. vLLM is imported lazily (inside
`VLLMEngine.__init__`) so that importing this module never needs vLLM (the GPU machine may lack it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from collections.abc import Mapping
from typing import Any

import torch

from meshrl.errors import ConfigError
from meshrl.generation.base import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    DTYPES,
    check_prompts,
    check_sleep_level,
    check_tokens,
    process_memory,
)
from meshrl.generation.vllm_config import VLLMEngineConfig
from meshrl.generation.vllm_worker_ext import encode_object, encode_weights
from meshrl.models.hf_config import read_config, stop_token_ids
from meshrl.models.vision import image_token_id, is_vision_checkpoint, placeholder_ids
from meshrl.types import Completion, SamplingParams

# These must be in the environment before vLLM is imported (and read), hence module level, and setdefault so
# a launcher can still override them:
# - VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the engine core in this process: ~3 s to start instead of 15-25 s
#   on CPU, and it is the only mode that works inside a daemonic process (a Monarch actor), which may not
#   spawn children.
# - TORCHDYNAMO_DISABLE=1 skips a 10-20 s torch.compile at start-up (vLLM's CPU path still compiles a few
#   helpers even with enforce_eager=True); eager is plenty for the model sizes this project runs on CPU.
# - VLLM_LOGGING_LEVEL=ERROR: with token-id I/O vLLM warns on every weight reload (rotary buffers and a tied
#   lm_head are, correctly, not in the pushed weights) and at start (no tokenizer for chat templates).
# On GPU the multiprocess engine and compilation (CUDA graphs) are what make vLLM fast: keep them.
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

WORKER_EXTENSION = "meshrl.generation.vllm_worker_ext.WeightUpdateExtension"


def collapse_runs(ids: list[int], token: int | None) -> list[int]:
    """`ids` with every run of `token` shortened to one (expanded image placeholders -> one per image)."""
    return [t for i, t in enumerate(ids) if t != token or i == 0 or ids[i - 1] != token]


_SUPPRESSED = -1.0e9  # the logit bias of a token the model may not write (exp underflows to 0 in any dtype)
_UPDATE_METHOD = "meshrl_update_weights"  # method of WeightUpdateExtension called through collective_rpc


def _finish_reason(reason: str | None) -> str:
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop"
    raise RuntimeError(f"vLLM finished a request with finish_reason={reason!r}; expected 'stop' or 'length'")


def _logprob_of(entry: Mapping[int, Any], token_id: int) -> float:
    """One position of vLLM's per-token logprobs dict ({token_id: Logprob}) -> float for `token_id`."""
    if token_id not in entry:
        raise RuntimeError(f"vLLM returned no logprob for token {token_id} (got ids {list(entry)})")
    return float(entry[token_id].logprob)


@contextlib.contextmanager
def _keep_default_group(group):
    """An in-process vLLM engine's shutdown destroys the default torch.distributed process group, whoever made it
    (`cleanup_dist_env_and_memory`): a trainer (or test) in the same process that made it first would lose it.
    While this is active, destroying `group` (the pre-existing default group) is skipped; vLLM's own groups go."""
    if group is None:
        yield
        return
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def keep_outer(g=None):
        if g is None or g is group:
            return
        destroy(g)

    dist.destroy_process_group = keep_outer
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


class VLLMEngine:
    """vLLM `LLM` built from an HF-format directory, driven with token ids only. Implements
    `meshrl.generation.base.Engine`.

        engine = VLLMEngine(model_dir, VLLMEngineConfig(tensor_parallel_size=2), max_model_len=4096)

    `config`: the engine's own settings (`VLLMEngineConfig`); its fields may also be passed as keyword overrides
    (`VLLMEngine(model_dir, enforce_eager=True)`). `max_num_seqs` None: vLLM's default. `kv_cache_memory_bytes`
    None: 64 MiB on CPU (vLLM-CPU's own sizing refuses to start here); on GPU vLLM sizes the cache from
    `gpu_memory_utilization` (an explicit size bypasses vLLM's memory profiling).

    Logprobs are "processed" (vLLM's `logprobs_mode="processed_logprobs"`): the log-probability of each
    sampled token under the distribution it was actually sampled from (after temperature, top-k and top-p).
    Greedy requests (temperature 0) report the plain log_softmax of the logits.
    """

    loads_in_workers = True  # weights are copied inside vLLM's workers (see base.Engine)

    def __init__(
        self,
        model_dir: str,
        config: VLLMEngineConfig | None = None,
        *,
        dtype: str = "float32",
        max_model_len: int = 256,
        max_num_seqs: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        **overrides: Any,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise FileNotFoundError(
                f"{model_dir!r} has no config.json; VLLMEngine needs an HF-format model directory "
                "(config.json + *.safetensors + tokenizer files), e.g. written by save_pretrained"
            )
        self.config = cfg = dataclasses.replace(config or VLLMEngineConfig(), **overrides)
        on_gpu = torch.cuda.is_available()
        # vLLM's (first) worker runs on this process's current CUDA device.
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu")
        self.supports_sleep = on_gpu if cfg.enable_sleep_mode is None else bool(cfg.enable_sleep_mode)
        if self.supports_sleep and not on_gpu:
            raise ConfigError(
                "generator.vllm.enable_sleep_mode=True, but vLLM has no sleep mode on CPU; leave it unset (None)"
            )
        if kv_cache_memory_bytes is None and not on_gpu:
            kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        if on_gpu and dtype == "float32":
            # vLLM's Triton attention kernels (the decoder's TRITON_ATTN and the vision encoder's) call tl.dot without
            # a precision, and Triton then multiplies float32 in TF32 (10-bit mantissa): on one H100 a tiny Qwen2.5-VL's
            # sampled-token logprobs differed from the trainer's by 1.6e-3 that way. float32 is the parity setting, so
            # its dots are IEEE here (Triton reads the variable when it compiles, in this process and vLLM's). A
            # value the user set wins.
            os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
        from vllm import LLM  # lazy: see module docstring

        # A default process group that exists before the engine (a trainer's, in the same process) is not vLLM's:
        # shutdown keeps it (see `shutdown`).
        self._outer_group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None

        self.model_dir = model_dir
        self.dtype = dtype
        self.torch_dtype = DTYPES[dtype]
        chunked = cfg.enable_chunked_prefill
        vision = is_vision_checkpoint(model_dir)
        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            # Explicit KV size: vLLM-CPU's default sizing reads one NUMA node's memory and refuses to start
            # here. On GPU it bypasses memory profiling (gpu_memory_utilization is then unused); None there lets
            # vLLM size the cache from gpu_memory_utilization instead.
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            seed=seed,
            enforce_eager=(not on_gpu) if cfg.enforce_eager is None else cfg.enforce_eager,
            enable_sleep_mode=self.supports_sleep,
            enable_prefix_caching=cfg.enable_prefix_caching,
            # Whole prompts per scheduler step by default (VLLMEngineConfig.enable_chunked_prefill says why); the
            # step budget must then hold the longest prompt.
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=(
                cfg.max_num_batched_tokens
                if cfg.max_num_batched_tokens is not None or chunked
                else max(4096, max_model_len)
            ),
            # Token ids in and out; no detokenisation. A vision-language model's multimodal processor needs the
            # tokenizer (vLLM refuses to build it without one); outputs are still not detokenised (detokenize=False).
            skip_tokenizer_init=not vision,
            # meshrl sends images, never videos: no video budget in vLLM's encoder profiling and cache.
            **({"limit_mm_per_prompt": {"video": 0}} if vision and "video_token_id" in read_config(model_dir) else {}),
            logprobs_mode="processed_logprobs",  # logprobs after temperature / top-k / top-p
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
        )
        _skip_inprocess_teardown_at_exit(self.llm)
        model_config = self.llm.llm_engine.model_config
        self._max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        # Every request also stops at the checkpoint's eos ids (generation_config's, config's, the tokenizer's),
        # as the transformers engine does: without a tokenizer (skip_tokenizer_init) vLLM knows only some of them.
        self.eos_ids = frozenset(stop_token_ids(model_dir))
        # A vision-language model never writes an image placeholder (the trainer would take a sampled one for an
        # image slot): suppressed here, and left out of the trainer's distribution too (meshrl.models.vision).
        self.placeholder_ids: tuple[int, ...] = ()
        self.image_token_id: int | None = None
        if vision:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(model_dir))
            self.placeholder_ids, self.image_token_id = placeholder_ids(config), image_token_id(config)
        self._sleep_level = 0
        self._asleep: set[str] = set()  # vLLM memory tags still asleep: "weights", "kv_cache"
        self._weights_discarded = False  # level 2 until weights are loaded again

    # ------------------------------------------------------------------ properties

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    # ------------------------------------------------------------------ validation

    # ------------------------------------------------------------------ generation

    def _vllm_params(self, params: SamplingParams, n: int, seed: int | None):
        from vllm import SamplingParams as VSamplingParams

        greedy = params.temperature == 0
        return VSamplingParams(
            n=n,
            max_tokens=params.max_tokens,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if (greedy or params.top_k == -1) else params.top_k,  # vLLM: 0 disables top-k
            stop_token_ids=sorted(self.eos_ids.union(int(t) for t in params.stop_token_ids)),
            seed=None if greedy else seed,
            logprobs=0,  # only the sampled token's logprob
            detokenize=False,
            # Applied before the processed logprobs are taken: the sampled tokens' logprobs are those of the
            # distribution without the placeholders, as the trainer's are.
            logit_bias={t: _SUPPRESSED for t in self.placeholder_ids} or None,
        )

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        policy_version: int,
        images: list[tuple[bytes, ...]] | None = None,
    ) -> list[list[Completion]]:
        """Sample `params.n` completions per prompt. Returns one list of `Completion`s per prompt, in order.

        temperature 0 is greedy (the n completions are then identical). With `params.seed` set, prompt i's
        sample j uses seed `params.seed + i * n + j`, so a call is reproducible and no two samples share
        noise. `images`: per prompt, its encoded images (the prompt holds their expanded image tokens).
        """
        prompts = check_prompts(prompts, params.max_tokens, self._max_model_len, self.vocab_size)
        if not prompts:
            return []
        self.wake_up()

        greedy = params.temperature == 0
        n_req = 1 if greedy else params.n  # vLLM refuses n > 1 for greedy; we replicate instead
        vparams = [
            self._vllm_params(params, n_req, None if params.seed is None else params.seed + i * params.n)
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(self._inputs(prompts, images), vparams, use_tqdm=False)

        results: list[list[Completion]] = []
        for prompt, out in zip(prompts, outputs, strict=True):
            comps = []
            for o in sorted(out.outputs, key=lambda o: o.index):
                token_ids = [int(t) for t in o.token_ids]
                if o.logprobs is None or len(o.logprobs) != len(token_ids):
                    raise RuntimeError(
                        f"vLLM returned {0 if o.logprobs is None else len(o.logprobs)} logprob entries for "
                        f"{len(token_ids)} tokens"
                    )
                logprobs = [_logprob_of(e, t) for e, t in zip(o.logprobs, token_ids, strict=True)]
                comps.append(
                    Completion(
                        prompt_ids=list(prompt),
                        token_ids=token_ids,
                        logprobs=logprobs,
                        finish_reason=_finish_reason(o.finish_reason),
                        policy_version=policy_version,
                    )
                )
            if greedy and params.n > 1:
                c = comps[0]
                comps = [
                    Completion(
                        list(c.prompt_ids),
                        list(c.token_ids),
                        list(c.logprobs),
                        c.finish_reason,
                        c.policy_version,
                    )
                    for _ in range(params.n)
                ]
            results.append(comps)
        return results

    def _inputs(self, prompts: list[list[int]], images: list[tuple[bytes, ...]] | None) -> list[Any]:
        """vLLM's prompts: token ids, and a prompt's images as PIL images (`multi_modal_data`). Our ids hold the
        expanded image tokens (meshrl.models.vision `expand`: what the trainer sees); vLLM wants one placeholder per
        image and expands them itself (given expanded ones, vLLM 0.32 expands the first run again and reads the
        rest as text, silently: measured), so each run is collapsed to one here. Its expansion equals ours (the
        same image processor: tests/test_vlm_models.py)."""
        from vllm.inputs import TokensPrompt

        if images is None or not any(images):
            return [TokensPrompt(prompt_token_ids=p) for p in prompts]
        if not self.placeholder_ids:
            raise ValueError(f"prompts with images, but {self.model_dir} is not a vision-language checkpoint")
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} image lists for {len(prompts)} prompts; give one per prompt")
        from meshrl.rollout.images import from_wire

        out = []
        for p, own in zip(prompts, images, strict=True):
            prompt = TokensPrompt(prompt_token_ids=collapse_runs(p, self.image_token_id) if own else p)
            if own:
                prompt["multi_modal_data"] = {"image": [from_wire(b) for b in own]}
            out.append(prompt)
        return out

    def prompt_logprobs(
        self, sequences: list[list[int]], images: list[tuple[bytes, ...]] | None = None
    ) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t = 1 .. len(seq)-1 of each sequence (raw logits, temperature 1).

        Sequences may be up to `max_model_len` long. vLLM needs room for one generated token, so the engine
        is fed `seq[:-1]`: its prompt logprobs give positions 1 .. len-2 and the logprob of `seq[-1]` at the
        first generated position (asked for with `logprob_token_ids`) gives the last one. `images`: per sequence,
        its encoded images. Prompt logprobs are vLLM's raw ones: with image placeholders they include the
        placeholders' share of the distribution, which the trainer leaves out (a trained model gives them next to
        nothing; a random one a few percent: up to 0.033 nats lower on one H100, tests/test_vllm_engine_vision.py).
        """
        from vllm import SamplingParams as VSamplingParams

        sequences = [[int(t) for t in s] for s in sequences]
        for i, s in enumerate(sequences):
            check_tokens("sequence", i, s, self.vocab_size)
            if len(s) > self._max_model_len:
                raise ValueError(
                    f"sequence {i} has {len(s)} tokens > max_model_len={self._max_model_len}; truncate it or "
                    f"build the engine with max_model_len >= {len(s)}"
                )
        todo = [i for i, s in enumerate(sequences) if len(s) >= 2]
        results: list[list[float]] = [[] for _ in sequences]
        if not todo:
            return results
        self.wake_up()
        vparams = [
            VSamplingParams(
                max_tokens=1,
                temperature=0.0,
                prompt_logprobs=0,
                logprob_token_ids=[sequences[i][-1]],
                logprobs=1,  # must equal len(logprob_token_ids)
                detokenize=False,
            )
            for i in todo
        ]
        outputs = self.llm.generate(
            self._inputs([sequences[i][:-1] for i in todo], None if images is None else [images[i] for i in todo]),
            vparams,
            use_tqdm=False,
        )
        for i, out in zip(todo, outputs, strict=True):
            s = sequences[i]
            plp = out.prompt_logprobs or []  # [None, {tok: Logprob}, ...] for s[:-1]
            if len(plp) != len(s) - 1:
                raise RuntimeError(f"vLLM returned {len(plp)} prompt logprob entries for {len(s) - 1} tokens")
            vals = [_logprob_of(plp[t], s[t]) for t in range(1, len(s) - 1)]
            last = out.outputs[0].logprobs
            if not last:
                raise RuntimeError("vLLM returned no logprobs for the last position")
            vals.append(_logprob_of(last[0], s[-1]))
            results[i] = vals
        return results

    # ------------------------------------------------------------------ weights

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the weights in place with HF-named tensors (cast to the engine dtype).

        `lm_head.weight` may be absent when embeddings are tied (the tied head is then refreshed from the new
        embeddings). The prefix cache is reset afterwards: cached KV blocks were computed by the old weights.
        """
        if not state_dict:
            raise ValueError("load_weights got an empty state dict")
        self._wake_weights()
        n = len(state_dict)
        blobs = encode_weights((name, t.to(dtype=self.torch_dtype)) for name, t in state_dict.items())
        # Pickled bytes, not tensors: multiprocess engines send collective_rpc args as msgpack without types.
        counts = self.llm.collective_rpc(_UPDATE_METHOD, args=(blobs,))
        if any(c != n for c in counts):
            raise RuntimeError(f"weight update reached the workers incompletely: {counts} of {n}")
        self._weights_discarded = False
        self._drop_stale_caches()

    def load_weight_pieces(self, pieces) -> None:
        """vLLM's workers take whole tensors: the blocks are put together here first."""
        from meshrl.weight_sync.shards import whole_tensors

        self.load_weights(whole_tensors(pieces))

    def load_weights_ipc(self, handle, version: int | None = None) -> int:
        """Like `load_weights`, from a same-GPU trainer's shared buffer (`meshrl.weight_sync.shared_buffer`; on CPU its
        /dev/shm backing): each worker opens `handle` once and copies GPU to GPU, with no trip through host
        memory. Loads `version` (None: the latest published) and returns the version loaded."""
        n = len(handle.layout.specs)
        version = None if version is None else int(version)
        self._wake_weights()
        # Pickled bytes, not the dataclass: multiprocess engines send collective_rpc args as msgpack without types.
        results = self.llm.collective_rpc(_UPDATE_METHOD + "_ipc", args=(encode_object(handle), version))
        versions, counts = {v for v, _ in results}, [c for _, c in results]
        if any(c != n for c in counts):
            raise RuntimeError(f"weight update reached the workers incompletely: {counts} of {n}")
        if len(versions) != 1:  # with version=None, workers reading while a newer one lands could disagree
            raise RuntimeError(f"vLLM workers loaded different weight versions {sorted(versions)}; pass a version")
        self._weights_discarded = False
        self._drop_stale_caches()
        return versions.pop()

    def _drop_stale_caches(self) -> None:
        """After new weights: cached KV blocks (prefix cache) and, for a vision-language model, cached image
        encodings were computed by the old weights. vLLM keeps an image's encoder output by the image's hash, and
        RL prompts show the same images again step after step: without the reset the new policy would sample from
        the old vision tower's features (and a worker-side miss of an entry the scheduler still lists is an error
        in vLLM 0.33: 'Encoder cache miss')."""
        self.llm.reset_prefix_cache()
        self._reset_encoder_cache()

    def _reset_encoder_cache(self) -> None:
        if self.image_token_id is not None:  # only vision-language models have one
            self.llm.llm_engine.reset_encoder_cache()

    # ------------------------------------------------------------------ sleep mode (colocated trainer)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep: level 1 discards the KV cache and offloads the weights to host memory, level 2 discards
        both (load weights before generating again). A no-op without sleep support (CPU: `supports_sleep` False).
        Deeper than the current level only."""
        level = check_sleep_level(level)
        if not self.supports_sleep or level <= self._sleep_level:
            return
        if self._sleep_level:  # level 1 -> 2: vLLM sleeps from awake only
            self.wake_up()
        self.llm.sleep(level=level)
        self._sleep_level, self._asleep = level, {"weights", "kv_cache"}
        self._weights_discarded = level == 2

    def _wake_weights(self) -> None:
        """Weights back on the device (for a load while asleep); the KV cache stays freed until `wake_up`."""
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")

    def wake_up(self) -> None:
        """Re-allocate what `sleep` freed. After a level-2 sleep the weights must have been loaded since."""
        if not self._sleep_level:
            return
        if self._weights_discarded:
            raise RuntimeError(
                "the vLLM engine slept at level 2 (weights discarded) and no weights were loaded since: "
                "load_weights / pull_weights before generating"
            )
        self.llm.wake_up(tags=sorted(self._asleep))
        self._sleep_level, self._asleep = 0, set()
        self._reset_encoder_cache()  # encoder outputs held across a sleep are not trusted

    def memory(self) -> dict[str, Any]:
        """`base.process_memory` of the engine's device, plus 'sleep_level'. On GPU vLLM's engine core usually runs
        in its own process: its memory shows in 'device_used_bytes', not in this process's allocated bytes."""
        out = process_memory(self.device)
        out["sleep_level"] = self._sleep_level
        return out

    # ------------------------------------------------------------------ teardown

    def shutdown(self) -> None:
        """Free the engine (best effort). The object is unusable afterwards."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None  # type: ignore[assignment]
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        with contextlib.suppress(Exception), _keep_default_group(self._outer_group):  # best effort teardown
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        del llm, engine, core
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _skip_inprocess_teardown_at_exit(llm: Any) -> None:
    """vLLM tears an in-process engine (the engine core in this process, as on CPU) down at interpreter exit: a
    weakref finaliser unfreezes the whole heap, destroys its process groups and runs gc.collect, which took ~5 s of
    every generator process's stop, and so of every run's end. The process is ending and the OS frees all of it, so
    that finaliser does not run at exit (`shutdown` still runs it on demand). A multiprocess engine's finaliser,
    which ends the engine core's process, is left as it is."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None and type(client).__name__ == "InprocClient":
        finalizer.atexit = False
