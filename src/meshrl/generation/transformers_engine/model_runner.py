"""The device side of the transformers engine: the model, its static KV cache, prefill and decode steps, sampling on
the device, CUDA graphs. It runs what the scheduler planned (`Prefill`, `Compaction`, `Decode`) and returns what was
sampled, as host arrays; it never changes a `Sequence`.

- KV cache: one static tensor `[2, layers, slots, kv_heads, max_model_len, head_dim]`. Weight updates are in
  place, so the cache and the CUDA graphs stay valid across `load_weights`; `free_cache` / `allocate_cache` drop and
  re-make it for sleep mode. On GPU the cache lives at addresses reserved for good (`device_memory.RemappableBuffer`,
  CUDA virtual memory management): a level-1 sleep gives its physical memory back and keeps the CUDA graphs, which
  replay at the same addresses after wake-up. Without it (CPU, no VMM support, `remappable_kv_cache=False`) the
  cache is a torch tensor dropped and re-made, and the graphs (which baked its address) are recaptured on first use.
- Decode step: one token per row, attention over `[0, bucket)` of the cache with a per-row length mask. On GPU it
  is captured as CUDA graphs, one per (batch bucket, length bucket), replayed with static input buffers.
- Device loop: when no row uses top-k/top-p, one step = forward + sampling + logprob + position/step updates, all
  on the device (in the CUDA graph on GPU; the noise hash runs there too). Sampled tokens and logprobs go into a
  small on-device history that the host reads once per chunk of `sync_every` steps (fewer when a row reaches
  max_tokens sooner); stop tokens are checked then, so a row that stopped inside a chunk keeps decoding until the
  chunk ends (the scheduler drops its extra tokens). Rows that use top-k/top-p take the per-step path (sampling
  outside the graph, one host sync per step).
- Vision-language models (`vision` set: Qwen2.5-VL, Qwen3-VL): the decoder is the language model. A prefill with
  images runs the model's own multimodal forward (vision tower, image features into the image tokens, Qwen3-VL's
  deepstack features) with the prompts' 3-D rotary positions; a row then decodes at rotary position = its text
  position + its prompt's rope delta (`delta_buf`, moved with the row as `pos_buf` is). The image placeholders get
  -inf logits before any sampling (`suppress`), so they are never sampled and the logprobs are those of the
  distribution without them, as the trainer's.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Mapping
from collections.abc import Sequence as Seq

import numpy as np
import torch

from meshrl.generation.base import DEFAULT_CPU_KV_CACHE_BYTES
from meshrl.generation.transformers_engine.attention import ATTN_NAME, AttentionContext, register_attention, use_context
from meshrl.generation.transformers_engine.config import TransformersEngineConfig
from meshrl.generation.transformers_engine.device_memory import (
    CUDA_ERROR_OUT_OF_MEMORY,
    CudaDriverError,
    RemappableBuffer,
    mapped_bytes,
    vmm_supported,
)
from meshrl.generation.transformers_engine.kernels import (
    FP8,
    check_triton_attention,
    fp8_decode_launch,
    fuse_norms,
    triton_decode_supported,
)
from meshrl.generation.transformers_engine.sampler import sample, uniform_noise, uniform_noise_torch
from meshrl.generation.transformers_engine.scheduler import Compaction, Decode, Prefill
from meshrl.generation.transformers_engine.sequence import Sequence
from meshrl.models.hf_config import max_positions
from meshrl.models.vision import VisionInputs, is_vision_checkpoint

_NEG_INF = float("-inf")
GPU_FREE_FRACTION = 0.9
"""kv_cache_memory_bytes=None on GPU: the cache may take this fraction of what the device has free once the weights
are loaded (the rest is left for activations, logits and CUDA graphs)."""


def _buckets(limit: int, small: Seq[int], step: int) -> list[int]:
    out = sorted({b for b in small if b < limit} | set(range(step, limit, step)) | {limit})
    return out


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        config: TransformersEngineConfig,
        *,
        torch_dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        max_num_seqs: int,
        kv_cache_memory_bytes: int | None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        register_attention()
        self.config, self.torch_dtype, self.device = config, torch_dtype, device
        # Whether the KV cache can live at fixed addresses (checked before the model loads: True refuses to start
        # where it cannot).
        self.kv_vmm_fallback: str | None = self._vmm_fallback(config.remappable_kv_cache)
        if is_vision_checkpoint(model_dir):
            # Our attention in the language model only: the vision tower runs transformers' own, once per prefill.
            attn = {"": ATTN_NAME, "text_config": ATTN_NAME, "vision_config": "sdpa"}
            model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch_dtype, attn_implementation=attn)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, attn_implementation=ATTN_NAME)
        self.model = model.to(self.device).eval().requires_grad_(False)
        # A vision-language model's image inputs (None for a causal LM), its multimodal forward (`model.model`) and
        # the names its checkpoint (and the trainer) give its weights.
        self.vision = VisionInputs.from_model_dir(model_dir, model)
        self._mm_model = model.model if self.vision is not None else None
        self._saved_names: dict[str, str] = {}
        if self.vision is not None:
            from meshrl.models.hf_backend import checkpoint_names

            self._saved_names = checkpoint_names(model)
        cfg = model.config.get_text_config()
        layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if (
            layer_types != {"full_attention"}
            or getattr(cfg, "sliding_window", None)
            and getattr(cfg, "use_sliding_window", False)
        ):
            raise NotImplementedError(
                f"TransformersEngine supports full-attention models only; this one has {layer_types}"
            )
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(cfg, attr, None):
                raise NotImplementedError(
                    f"TransformersEngine does not apply {attr} (the model's logits are post-processed)"
                )
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.params = self._param_map()
        # -inf at the image placeholders, added to every logits row before sampling or scoring (vision only).
        self.suppress: torch.Tensor | None = None
        if self.vision is not None:
            self.suppress = torch.zeros(self.lm_head.weight.shape[0], dtype=torch_dtype, device=self.device)
            self.suppress[list(self.vision.placeholder_ids)] = _NEG_INF
            self._placeholders = torch.tensor(self.vision.placeholder_ids, device=self.device)
        # The attention mask handed to the decoder: an "already prepared" 4D mask, which transformers' mask
        # builders (`create_causal_mask` & co.) return as it is, in every model and version, so no mask is built
        # per forward (our attention function ignores it: it masks by itself). Not the per-layer-type dict that
        # Qwen2/Qwen3's forward accepts: Llama's and GPT-2's forwards call `.ndim` on the mask they get.
        self._mask_arg = torch.zeros(1, 1, 1, 1, dtype=torch_dtype, device=self.device)
        self.vocab_size = int(cfg.vocab_size)
        self.max_model_len = min(int(max_model_len), max_positions(cfg))  # GPT-2: n_positions
        self.num_layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        self._heads = heads
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self.kv_fp8 = config.kv_cache_dtype == "fp8"
        self.kv_dtype = FP8 if self.kv_fp8 else torch_dtype
        per_token = self.head_dim * torch.finfo(self.kv_dtype).bits // 8 + (4 if self.kv_fp8 else 0)  # + scale
        per_slot = 2 * self.num_layers * self.kv_heads * self.max_model_len * per_token
        budget = self._kv_budget(kv_cache_memory_bytes)
        slots = min(int(max_num_seqs), budget // per_slot)
        if slots < 1:
            what = "" if kv_cache_memory_bytes is not None else f" (kv_cache_memory_bytes=None: {budget} bytes here)"
            raise ValueError(
                f"kv_cache_memory_bytes={kv_cache_memory_bytes}{what} holds no sequence of max_model_len="
                f"{self.max_model_len} ({per_slot} bytes each); raise it or lower max_model_len"
            )
        self.num_slots = slots
        self.kv_cache_bytes = per_slot * slots
        self._ctx = AttentionContext()
        self.kv: torch.Tensor | None = None  # None while asleep (also with VMM: its addresses have no memory then)
        self.kv_scale: torch.Tensor | None = None  # fp8: float32 [2, layers, slots, kv_heads, max_model_len]
        self.logits_buf: torch.Tensor | None = None
        self._kv_mem: RemappableBuffer | None = None  # the cache's reserved addresses (VMM), or None
        self._kv_view: torch.Tensor | None = None  # the cache tensor over them, kept while asleep
        self._scale_view: torch.Tensor | None = None  # and the fp8 scales' tensor
        self.asleep_kept_bytes = 0  # device memory a sleep left besides the weights (free_cache)
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}  # (batch, length, device loop)
        self._graph_pool = None
        if self.kv_vmm_fallback is None:
            try:
                align = 256 if self.kv_fp8 else 0  # the fp8 scales start 256-byte aligned
                self._kv_mem = RemappableBuffer(self.kv_cache_bytes + align, self._device_index())
                self.allocate_cache()
            except Exception as e:  # noqa: BLE001 - unless required: a torch-allocated cache, and say why
                if config.remappable_kv_cache:
                    raise
                self.kv = self._kv_view = self.kv_scale = self._scale_view = None
                self._set_context_cache()
                if self._kv_mem is not None:
                    self._kv_mem.close()
                    self._kv_mem = None
                self.kv_vmm_fallback = f"{type(e).__name__}: {e}"
        if self.kv is None:
            self.allocate_cache()
        # Static decode inputs (CUDA graphs read these addresses).
        self.ids_buf = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.pos_buf = torch.zeros(slots, dtype=torch.long, device=self.device)
        # Vision: each row's rope delta (rotary position - text position after its prompt), moved as pos_buf is.
        self.delta_buf = torch.zeros(slots, dtype=torch.long, device=self.device) if self.vision is not None else None
        self.rows_buf = torch.arange(slots, device=self.device)
        self.iota = torch.arange(self.max_model_len, device=self.device)
        # Device-side decode loop: per-row sampling state, uploaded once per chunk, and the history of the chunk's
        # sampled tokens / logprobs, read by the host once per chunk.
        self.seedstep_buf = torch.zeros(2, slots, dtype=torch.long, device=self.device)  # [seed; tokens so far]
        self.temp_buf = torch.ones(slots, dtype=torch.float32, device=self.device)
        self.n_buf = torch.zeros(1, dtype=torch.long, device=self.device)  # running rows (bucket pad rows idle)
        self.k_buf = torch.zeros(1, dtype=torch.long, device=self.device)  # step within the chunk
        self.hist_tok = torch.zeros(config.sync_every, slots, dtype=torch.long, device=self.device)
        self.hist_lp = torch.zeros(config.sync_every, slots, dtype=torch.float32, device=self.device)
        self.use_graphs = bool(config.cuda_graphs) and self.device.type == "cuda"
        self.batch_buckets = _buckets(slots, (1, 2, 4, 8, 16, 24, 32, 48), 64 if slots > 64 else 16)
        # Decode attention reads the KV of [0, length bucket) for every row: finer buckets read less padding but
        # capture more graphs (one per batch bucket x length bucket).
        self.len_buckets = _buckets(self.max_model_len, (32, 64, 128, 256), int(config.len_bucket_step))
        self.graph_failures: list[str] = []
        self.stats = {"decode_steps": 0, "prefills": 0, "graph_replays": 0, "host_syncs": 0, "graph_captures": 0}
        self.attn_fallback: str | None = None
        self.attn_launch_fallback: str | None = None  # why an fp8 cache's tuned launch was not used
        self.attn_impl = self._choose_attn(config.attn_impl)
        self._ctx.attn_impl = self.attn_impl
        want_norm = self.device.type == "cuda" if config.fused_norm is None else bool(config.fused_norm)
        norm_model = self.model if self.vision is None else self.decoder  # the vision tower keeps its own norms
        self.norm_fallback = fuse_norms(norm_model, self.device, torch_dtype) if want_norm else None
        self.fused_norm = want_norm and self.norm_fallback is None

    def _device_index(self) -> int:
        if self.device.index is not None or self.device.type != "cuda":
            return self.device.index or 0
        return torch.cuda.current_device()

    def _vmm_fallback(self, want: bool | None) -> str | None:
        """None when the KV cache goes into a `RemappableBuffer`, else why not."""
        if want is False:
            return "remappable_kv_cache=False"
        why = vmm_supported(self.device)
        if why is not None and want:
            raise ValueError(f"generator.transformers.remappable_kv_cache=True, but on {self.device}: {why}")
        return why

    def _kv_budget(self, kv_cache_memory_bytes: int | None) -> int:
        if kv_cache_memory_bytes is not None:
            return int(kv_cache_memory_bytes)
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        # The weights are on the device already: this process may grow by what its share has left, and never past
        # (most of) what is free now. (What this process maps outside torch's allocator, e.g. another engine's
        # KV cache, counts in its share too: `memory_reserved` leaves it out.)
        free, total = torch.cuda.mem_get_info(self.device)
        held = torch.cuda.memory_reserved(self.device) + mapped_bytes(self._device_index())
        share = self.config.gpu_memory_utilization * total - held
        logits = self.vocab_size * 4 * 1024  # decode logits and sampling temporaries, about 1k rows' worth
        return int(max(min(share, free * GPU_FREE_FRACTION) - logits, 0))

    def _choose_attn(self, want: str) -> str:
        self._ctx.launch = fp8_decode_launch(self.head_dim) if self.kv_fp8 else {}
        if want != "auto":
            return want
        if self.device.type != "cuda":
            return "matmul"
        why = triton_decode_supported(self.head_dim, self._heads // self.kv_heads)
        if why is None:
            model = (self.device, self.torch_dtype, self._heads, self.kv_heads, self.head_dim, self.max_model_len)
            why = check_triton_attention(*model, fp8=self.kv_fp8, launch=self._ctx.launch)
            if why is not None and self._ctx.launch:  # e.g. more shared memory than this GPU has: the default launch
                self.attn_launch_fallback = why
                self._ctx.launch = {}
                why = check_triton_attention(*model, fp8=True)
        if why is None:
            return "triton"
        self.attn_fallback = why
        return "matmul"

    def _param_map(self) -> dict[str, torch.Tensor]:
        # load_weights copies into these in place: the same tensors while the weights stay where they are. A
        # vision-language model's weights also go by their checkpoint names (`model.layers.0...` for the module's
        # `model.language_model.layers.0...`, `visual...` for `model.visual...`): the names the trainer publishes.
        params = {k: v.data for k, v in self.model.state_dict(keep_vars=True).items()}
        for name, saved in self._saved_names.items():
            params[saved] = params[name]
        return params

    # ------------------------------------------------------------------ memory (sleep mode)

    @property
    def has_cache(self) -> bool:
        return self.kv is not None

    @property
    def remappable_kv(self) -> bool:
        """Whether the KV cache lives at reserved addresses (VMM) that a level-1 sleep keeps."""
        return self._kv_mem is not None

    @property
    def kv_mapped_bytes(self) -> int:
        """Device memory behind a `remappable_kv` cache now (its size rounded up to the VMM granularity; 0 while
        asleep or without VMM)."""
        return self._kv_mem.nbytes if self._kv_mem is not None and self._kv_mem.mapped else 0

    def allocate_cache(self) -> None:
        """The KV cache, zeroed, and the decode logits (unless kept). VMM: new memory at the cache's old addresses,
        so CUDA graphs kept by `free_cache(keep_graphs=True)` stay valid; else a new tensor, and graphs are
        captured again on first use."""
        shape = (2, self.num_layers, self.num_slots, self.kv_heads, self.max_model_len, self.head_dim)
        scale_shape = shape[:-1]
        if self._kv_mem is not None:
            try:
                self._kv_mem.map()
            except CudaDriverError as e:
                if e.code != CUDA_ERROR_OUT_OF_MEMORY:
                    raise
                self._release_memory()  # blocks torch's allocator keeps cached, as a torch allocation would
                self._kv_mem.map()
            if self._kv_view is None:
                self._kv_view = self._kv_mem.tensor(shape, self.kv_dtype)
                if self.kv_fp8:  # the scales follow the fp8 values in the same reserved range
                    offset = -(-self._kv_view.nbytes // 256) * 256
                    self._scale_view = self._kv_mem.tensor(scale_shape, torch.float32, offset=offset)
            # New physical memory holds anything (a NaN would leak through masked attention): zero it (fp8 as
            # bytes: fp8 tensors have no fill kernel on every torch build).
            (self._kv_view.view(torch.uint8) if self.kv_fp8 else self._kv_view).zero_()
            if self._scale_view is not None:
                self._scale_view.zero_()
            self.kv, self.kv_scale = self._kv_view, self._scale_view
        else:
            self.kv = torch.zeros(shape, dtype=torch.uint8 if self.kv_fp8 else self.kv_dtype, device=self.device)
            self.kv = self.kv.view(self.kv_dtype)
            self.kv_scale = torch.zeros(scale_shape, device=self.device) if self.kv_fp8 else None
        self._set_context_cache()
        if self.logits_buf is None:
            self.logits_buf = torch.zeros(self.num_slots, self.vocab_size, dtype=self.torch_dtype, device=self.device)

    def _set_context_cache(self) -> None:
        """Point the attention context at the cache's per-layer tensors (none while it is freed)."""
        self._ctx.k, self._ctx.v = (list(self.kv[0]), list(self.kv[1])) if self.kv is not None else ([], [])
        scale = self.kv_scale
        self._ctx.k_scale, self._ctx.v_scale = (list(scale[0]), list(scale[1])) if scale is not None else ([], [])

    def _copy_slots(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Copy the first `length` positions of the cache's slots `src` to slots `dst` (as bytes: fp8 tensors
        have no index_put kernel on every torch build)."""
        kv = self.kv.view(torch.uint8) if self.kv_fp8 else self.kv
        kv[:, :, dst, :, :length] = kv[:, :, src, :, :length]
        if self.kv_scale is not None:
            self.kv_scale[:, :, dst, :, :length] = self.kv_scale[:, :, src, :, :length]

    def free_cache(self, keep_graphs: bool = False) -> None:
        """Give the KV cache's memory back to the device. Idempotent (a deeper sleep calls it again).

        keep_graphs (level-1 sleep), with the cache at reserved addresses (VMM): only the cache's physical memory
        goes; the CUDA graphs, their private memory pool and the decode logits stay, so `allocate_cache` needs no
        recapture. That keeps resident, besides the weights, the graph pool (the activations and sampling
        temporaries of the largest captured bucket) and the logits buffer [slots, vocab]: hundreds of MiB at most
        for a large vocabulary; `asleep_kept_bytes` records it (torch's reserved bytes less the weights, on sleep).
        Otherwise (level 2: the weights move, and the graphs read their addresses; or no VMM): the graphs, their
        pool and the logits go too, and the graphs are captured again on first use."""
        keep = keep_graphs and self._kv_mem is not None
        if not keep:
            self._graphs.clear()
            self._graph_pool = None
            self.logits_buf = None
        self.kv = self.kv_scale = None
        self._set_context_cache()
        if self._kv_mem is not None:
            self._kv_mem.unmap()  # waits for the device first; self._kv_view stays, over addresses without memory
        self._release_memory()
        if self.device.type == "cuda":
            self.asleep_kept_bytes = max(int(torch.cuda.memory_reserved(self.device)) - self._weight_bytes(), 0)

    def _weight_bytes(self) -> int:
        seen: dict[int, int] = {}
        for t in self.params.values():
            if t.device.type == "cuda":
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def move_weights(self, device: torch.device) -> None:
        """Move the weights (level-2 sleep: to host memory; wake-up: back). Captured graphs read the old addresses:
        call with the cache freed."""
        assert not self._graphs, "free the cache (and its CUDA graphs) before moving the weights"
        self.model.to(device)
        self.params = self._param_map()
        self._release_memory()

    def _release_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ forward passes

    @contextlib.contextmanager
    def _mode(self, mode: str):
        with use_context(self._ctx, mode) as ctx:
            yield ctx

    def _hidden(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.decoder(input_ids=ids, position_ids=pos, attention_mask=self._mask_arg, use_cache=False)
        return out.last_hidden_state

    @torch.no_grad()
    def prefill(self, step: Prefill) -> tuple[np.ndarray, np.ndarray]:
        """Prefill `step`'s prompts into their slots, copy their KV to the other samples' slots, sample each
        admitted sequence's first token; (tokens [1, m], logprobs [1, m]) on the host."""
        logits, deltas = self._prefill(step.prompts, torch.tensor(step.prompt_rows, device=self.device), step.images)
        if step.copies:
            T = step.copy_len
            dst = torch.tensor([d for d, _ in step.copies], device=self.device)
            src = torch.tensor([s for _, s in step.copies], device=self.device)
            self._copy_slots(dst, src, T)
        pick = torch.tensor(step.pick, device=self.device)
        out = self._sample(logits[pick], step.seqs, step.rows)
        lens = np.array([len(r.prompt) for r in step.seqs], dtype=np.int64)
        self.pos_buf[torch.tensor(step.rows, device=self.device)] = torch.from_numpy(lens).to(self.device)
        if self.delta_buf is not None:  # every admitted row's, text prompts' (0) too: no stale delta stays
            self.delta_buf[torch.tensor(step.rows, device=self.device)] = deltas[pick]
        return out

    def _prefill(
        self, rows: list[list[int]], slots: torch.Tensor, images: Seq[tuple[bytes, ...]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run right-padded prompts, writing their KV into `slots`; return last-position logits (float32) and, for
        a vision-language model, each prompt's rope delta (else None)."""
        T = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        ids = ids.to(self.device, non_blocking=True)
        deltas = None
        with self._mode("prefill") as ctx:
            ctx.slots = slots
            if self.vision is not None and images is not None and any(images):
                h, deltas = self._mm_hidden(ids, rows, images)
            else:
                h = self._hidden(ids, self.iota[:T].expand(len(rows), T))
        if self.vision is not None and deltas is None:
            deltas = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        last = torch.tensor([len(r) - 1 for r in rows], device=self.device)
        self.stats["prefills"] += 1
        logits = self.lm_head(h[torch.arange(len(rows), device=self.device), last]).float()
        if self.suppress is not None:
            logits += self.suppress
        return logits, deltas

    def _mm_hidden(
        self, ids: torch.Tensor, rows: list[list[int]], images: Seq[tuple[bytes, ...]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The multimodal forward of right-padded rows `ids` (row i: tokens `rows[i]`, images `images[i]`): the
        model's own (vision tower, image features scattered into the image tokens, deepstack), at the rows' 3-D
        rotary positions (`VisionInputs.positions_of`; 1-D positions for a model without them). Returns the last
        hidden states and each row's rope delta (max rotary position + 1 - length: decode's rotary position is the
        text position + delta)."""
        B, T = ids.shape
        vision = self.vision
        pos = self.iota[:T].expand(3 if vision.rope_3d else 1, B, T).clone()
        deltas = torch.zeros(B, dtype=torch.long)
        for i, (r, own) in enumerate(zip(rows, images, strict=True)):
            if vision.rope_3d and own:
                rope = vision.positions_of(r, own)[1:]  # [3, n]
                n = len(r)
                deltas[i] = int(rope.max()) + 1 - n
                pos[:, i, :n] = rope.to(self.device)
                pos[:, i, n:] += deltas[i].item()  # padding continues the rotary positions (never read)
        pixels = {
            k: v.to(self.device, dtype=self.torch_dtype if v.is_floating_point() else v.dtype)
            for k, v in vision.pixels([b for own in images for b in own]).items()
        }
        out = self._mm_model(
            input_ids=ids, position_ids=pos if vision.rope_3d else pos[0], attention_mask=self._mask_arg,
            use_cache=False, **pixels,
        )  # fmt: skip
        return out.last_hidden_state, deltas.to(self.device)

    def compact(self, step: Compaction) -> None:
        if step.src:
            T = step.length
            src = torch.tensor(step.src, device=self.device)
            dst = torch.tensor(step.dst, device=self.device)
            self._copy_slots(dst, src, T)
            self.ids_buf[dst] = self.ids_buf[src]
            self.pos_buf[dst] = self.pos_buf[src]
            if self.delta_buf is not None:
                self.delta_buf[dst] = self.delta_buf[src]
        self.pos_buf[step.keep :] = 0
        if self.delta_buf is not None:
            self.delta_buf[step.keep :] = 0

    @torch.no_grad()
    def decode(self, step: Decode) -> tuple[np.ndarray, np.ndarray]:
        """Decode every running row; (tokens [steps, n], logprobs [steps, n]) on the host."""
        n = len(step.seqs)
        if step.steps is not None:
            return self._decode_chunk(step.seqs, step.max_len, step.steps)
        logits = self._decode(n, step.max_len)  # top-k / top-p: sample outside the graph
        out = self._sample(logits, step.seqs, list(range(n)))
        self.pos_buf[:n] += 1
        return out

    def _decode_forward(self, B: int, L: int) -> torch.Tensor:
        ctx = self._ctx
        ctx.rows, ctx.pos, ctx.length = self.rows_buf[:B], self.pos_buf[:B], L
        ctx.bias = torch.where(self.iota[None, :L] <= self.pos_buf[:B, None], 0.0, _NEG_INF)
        if self.delta_buf is None:
            h = self._hidden(self.ids_buf[:B, None], self.pos_buf[:B, None])
        else:  # rotary position = text position + the prompt's rope delta, the same on the three rotary rows
            h = self._hidden(self.ids_buf[:B, None], (self.pos_buf[:B] + self.delta_buf[:B])[:, None])
        out = self.logits_buf[:B]
        torch.matmul(h[:, 0], self.lm_head.weight.t(), out=out)
        if getattr(self.lm_head, "bias", None) is not None:
            out.add_(self.lm_head.bias)
        if self.suppress is not None:
            out.add_(self.suppress)
        return out

    def _device_step(self, B: int, L: int) -> None:
        """One decode step of rows [0, B) with sampling, logprob and bookkeeping on the device (no host sync):
        the body of the device-loop CUDA graphs. Rows >= n_buf (batch-bucket padding) do not advance."""
        logits = self._decode_forward(B, L)
        seeds, steps = self.seedstep_buf[0, :B], self.seedstep_buf[1, :B]
        tokens, logprobs = sample(logits, self.temp_buf[:B], None, None, uniform_noise_torch(seeds, steps))
        self.ids_buf[:B].copy_(tokens)
        self.hist_tok[:, :B][self.k_buf] = tokens[None]
        self.hist_lp[:, :B][self.k_buf] = logprobs[None]
        self.pos_buf[:B] += (self.rows_buf[:B] < self.n_buf).long()
        steps += 1
        self.k_buf += 1

    def _graph(self, n: int, max_len: int, device_loop: bool):
        """The CUDA graph for a step over rows [0, n) reading up to `max_len` (captured on first use), or None
        (no graphs: CPU, disabled, or a capture failed)."""
        if not self.use_graphs:
            return None
        B = next(b for b in self.batch_buckets if b >= n)
        L = next(b for b in self.len_buckets if b >= max_len)
        return self._graphs.get((B, L, device_loop)) or self._capture(B, L, device_loop)

    def _decode(self, n: int, max_len: int) -> torch.Tensor:
        """One decode step over rows [0, n) whose longest attention span is `max_len`; logits [n, V] (float32)."""
        self.stats["decode_steps"] += 1
        with self._mode("decode"):
            graph = self._graph(n, max_len, False)
            if graph is not None:
                graph.replay()
                self.stats["graph_replays"] += 1
                return self.logits_buf[:n].float()
            return self._decode_forward(n, max_len)[:n].float()

    def _capture(self, B: int, L: int, device_loop: bool):
        step = self._device_step if device_loop else self._decode_forward
        try:
            # Warm-up on the same inputs as the step about to run. Its KV writes are idempotent; the device
            # loop's state updates are undone, so the replay that follows does the real step.
            state = [self.ids_buf, self.pos_buf, self.seedstep_buf, self.k_buf]
            saved = [t.clone() for t in state] if device_loop else []
            step(B, L)
            for t, v in zip(state, saved, strict=False):
                t.copy_(v)
            torch.cuda.synchronize(self.device)
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                step(B, L)
            self._graphs[(B, L, device_loop)] = graph
            self.stats["graph_captures"] += 1
            return graph
        except Exception as e:  # noqa: BLE001 - fall back to eager decode steps, and say why
            self.graph_failures.append(f"{type(e).__name__}: {e}")
            self.use_graphs = False
            return None

    def _decode_chunk(self, running: list[Sequence], first: int, k_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """`k_steps` device-loop decode steps of every running row (the longest attention span `first` at the
        first), then one host read of what they sampled. `k_steps` <= config.sync_every (the history's length)."""
        n = len(running)
        ss = np.empty((2, n), dtype=np.int64)
        ss[0] = [r.seed for r in running]
        ss[1] = [len(r.tokens) for r in running]
        self.seedstep_buf[:, :n].copy_(torch.from_numpy(ss), non_blocking=True)
        temps = np.array([r.params.temperature for r in running], dtype=np.float32)
        self.temp_buf[:n].copy_(torch.from_numpy(temps), non_blocking=True)
        self.n_buf.fill_(n)
        self.k_buf.zero_()
        with self._mode("decode"):
            for k in range(k_steps):
                graph = self._graph(n, first + k, True)
                if graph is not None:
                    graph.replay()
                    self.stats["graph_replays"] += 1
                else:
                    self._device_step(n, first + k)
        self.stats["decode_steps"] += k_steps
        self.stats["host_syncs"] += 1
        toks = self.hist_tok[:k_steps, :n].cpu().numpy()  # the one synchronisation of the chunk
        lps = self.hist_lp[:k_steps, :n].cpu().numpy()
        return toks, lps

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Sample one token for each of `seqs` (rows `rows`) from `logits` [m, V]; they become the rows' next
        decode inputs. (tokens [1, m], logprobs [1, m]) on the host."""
        temp = torch.tensor([r.params.temperature for r in seqs], dtype=torch.float32)
        top_k = top_p = None
        if any(r.params.temperature > 0 and r.params.top_k != -1 for r in seqs):
            top_k = torch.tensor(
                [
                    r.params.top_k if (r.params.temperature > 0 and r.params.top_k != -1) else self.vocab_size
                    for r in seqs
                ]
            ).clamp_(max=self.vocab_size)
            top_k = top_k.to(self.device, non_blocking=True)
        if any(r.params.temperature > 0 and r.params.top_p < 1 for r in seqs):
            top_p = torch.tensor([r.params.top_p if r.params.temperature > 0 else 1.0 for r in seqs])
            top_p = top_p.to(self.device, non_blocking=True)
        seeds = np.array([r.seed for r in seqs], dtype=np.uint64)
        steps = np.array([len(r.tokens) for r in seqs], dtype=np.uint64)
        u = torch.from_numpy(uniform_noise(seeds, steps)).to(self.device, non_blocking=True)
        tokens, logprobs = sample(logits, temp.to(self.device, non_blocking=True), top_k, top_p, u)
        self.ids_buf[torch.tensor(rows, device=self.device)] = tokens
        host = torch.stack([tokens.double(), logprobs.double()]).cpu().numpy()
        return host[0:1].astype(np.int64), host[1:2]

    @torch.no_grad()
    def score(self, seqs: list[list[int]], images: Seq[tuple[bytes, ...]] | None = None) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t = 1 .. len-1 of each sequence (each of length >= 2), in one forward
        without the cache. Vision-language model: `images` per sequence; the placeholders are left out of the
        distribution (as in the trainer), and a placeholder target (an image token) scores 0, as the trainer's
        masked ones do."""
        T = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        for k, s in enumerate(seqs):
            ids[k, : len(s)] = torch.tensor(s)
        ids = ids.to(self.device)
        with self._mode("full"):
            if self.vision is not None and images is not None and any(images):
                h, _ = self._mm_hidden(ids, seqs, images)
            else:
                h = self._hidden(ids, self.iota[:T].expand(len(seqs), T))
        out = []
        for k, s in enumerate(seqs):
            logits = self.lm_head(h[k, : len(s) - 1]).float()
            target = ids[k, 1 : len(s)]
            if self.suppress is None:
                lp = torch.log_softmax(logits, dim=-1)
                out.append(lp.gather(1, target[:, None])[:, 0].tolist())
                continue
            lp = torch.log_softmax(logits + self.suppress, dim=-1).gather(1, target[:, None])[:, 0]
            out.append(lp.masked_fill(torch.isin(target, self._placeholders), 0.0).tolist())
        return out

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the model in place (cast to the model's dtype)."""
        params = self.params
        unknown = [k for k in state_dict if k not in params]
        if unknown:
            raise KeyError(f"load_weights: {len(unknown)} names are not weights of this model, e.g. {unknown[:3]}")
        same_dst, same_src = [], []
        for name, t in state_dict.items():
            p = params[name]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(t.shape)}, the model {tuple(p.shape)}")
            if t.device == p.device and t.dtype == p.dtype:
                same_dst.append(p)
                same_src.append(t.detach())
            else:
                p.copy_(t.detach().to(device=p.device, dtype=p.dtype), non_blocking=True)
        if same_dst:  # e.g. views of a same-GPU trainer's buffer: a few multi-tensor copy kernels, not ~300
            torch._foreach_copy_(same_dst, same_src, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def load_weight_pieces(self, pieces) -> None:
        """Copy each tensor's blocks into the matching slices of the model's weights (cast to the model's dtype)."""
        from meshrl.weight_sync.shards import block_slices

        params = self.params
        unknown = [k for k in pieces if k not in params]
        if unknown:
            raise KeyError(f"load_weights: {len(unknown)} names are not weights of this model, e.g. {unknown[:3]}")
        same_dst, same_src = [], []
        for name, (shape, _, blocks) in pieces.items():
            p = params[name]
            if tuple(p.shape) != tuple(shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(shape)}, the model {tuple(p.shape)}")
            for offsets, block in blocks:
                dst = p.data[block_slices(offsets, block)]
                if block.device == p.device and block.dtype == p.dtype:
                    same_dst.append(dst)
                    same_src.append(block)
                else:
                    dst.copy_(block.to(device=p.device, dtype=p.dtype), non_blocking=True)
        if same_dst:
            torch._foreach_copy_(same_dst, same_src, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        self._graphs.clear()
        self._graph_pool = None
        self.model = self.decoder = self.lm_head = None
        self.kv = self.kv_scale = self.logits_buf = self._kv_view = self._scale_view = None
        self.params = {}
        self._set_context_cache()
        self._release_memory()
        if self._kv_mem is not None:  # after every tensor over it (and every graph reading it) is gone
            self._kv_mem.close()
            self._kv_mem = None


__all__ = ["GPU_FREE_FRACTION", "ModelRunner"]
