"""Generation engine 'transformers': continuous batching over a preallocated KV cache, for any transformers
causal LM whose attention goes through transformers' attention interface (Qwen2/Qwen3, Llama, Mistral, GPT-2, ...:
rotary or learned absolute position embeddings alike, since positions go in as `position_ids`).

Same interface as `VLLMEngine` (`generate`, `prompt_logprobs`, `load_weights`, `max_model_len`, `shutdown`), and
nothing here imports vLLM or torchtitan, so it runs on the GPU machine's preinstalled torch.

How it works:
- The model is loaded with `attn_implementation="meshrl_kv"`, an attention function registered with
  transformers' `AttentionInterface`: the model's own projections, norms and RoPE run unchanged; only the
  attention reads and writes our cache. RoPE (or GPT-2's position table) gets each row's true position through
  `position_ids`; the mask the model passes along is a placeholder (our attention masks by itself).
- KV cache: one static tensor `[2, layers, slots, kv_heads, max_model_len, head_dim]`, allocated once. A
  running sequence owns one slot. Rows are kept contiguous (a finished row's slot is refilled by a new request
  or, when the queue is empty, by moving the last row into it), so a decode step runs over slots `[0, n)`.
- Continuous batching: each iteration admits queued requests into free slots (one batched, right-padded
  prefill; the `n` samples of a prompt share one prefill and copy its KV), then runs one decode step for every
  running row. Finished rows leave at once; their slots are reused on the next iteration.
- Decode step: one token per row, attention over `[0, bucket)` of the cache with a per-row length mask, done
  with two batched matmuls (GQA without repeating KV). On GPU it is captured as CUDA graphs, one per (batch
  bucket, length bucket), replayed with static input buffers; weights are updated in place, so the graphs and
  the cache stay valid across `load_weights`.
- Sampling: temperature, top-k, top-p; logprobs are "processed" (of the distribution actually sampled from,
  after temperature/top-k/top-p), greedy reports the plain log-softmax, like the vLLM engine. Noise is a
  counter-based hash of (request seed, step), so a seeded request is reproducible whatever else is in the
  batch, and no two samples share noise. The draw is the inverse CDF at that one uniform, found in two levels
  (blocks of 128 tokens, then inside the block) instead of a cumulative sum over the whole vocabulary.
- Decode loop without a host round trip per token: when no running row uses top-k/top-p (greedy and plain
  temperature sampling, what RL uses), one decode step = forward + sampling + logprob + position/step updates,
  all on the device (in the CUDA graph on GPU; the noise hash runs there too). Sampled tokens and logprobs go
  into a small on-device history; the host reads it once every `sync_every` steps (fewer when a row reaches
  max_tokens sooner: that is known on the host) and checks stop tokens then. A row that stopped inside such a
  chunk keeps decoding until the chunk ends (its extra tokens are dropped); its slot is refilled after it.
  Rows that use top-k/top-p take the per-step path (sampling outside the graph, one host sync per step).
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from meshrl.models.hf_config import max_positions, stop_token_ids
from meshrl.types import Completion, SamplingParams

ATTN_NAME = "meshrl_kv"
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------------------------
# the attention function the model calls (transformers' AttentionInterface)


class _Ctx:
    """What the attention function needs for the forward being run (set by the engine around each forward)."""

    mode: str = "full"  # "full" (no cache), "prefill" (write rows `slots`), "decode" (write at `pos`)
    k: list[torch.Tensor] = []
    v: list[torch.Tensor] = []
    slots: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    length: int = 0
    attn_impl: str = "matmul"  # decode attention: "matmul" | "sdpa" | "triton"


_ACTIVE: list[_Ctx] = []


def _kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, H, T, D], key/value [B, Hkv, T, D] (after RoPE) -> ([B, T, H, D], None)."""
    if not _ACTIVE:
        raise RuntimeError(f"attention '{ATTN_NAME}' called outside HFEngine (no KV cache is set)")
    ctx = _ACTIVE[-1]
    if ctx.mode == "decode":
        li = module.layer_idx
        kc, vc = ctx.k[li], ctx.v[li]  # [S, Hkv, L, D]
        B, H, _, D = query.shape
        Hkv = kc.shape[1]
        kc[ctx.rows, :, ctx.pos] = key[:, :, 0]
        vc[ctx.rows, :, ctx.pos] = value[:, :, 0]
        scale = scaling if scaling is not None else D**-0.5
        if ctx.attn_impl == "triton":
            out = decode_attention_triton(query[:, :, 0], kc, vc, ctx.pos, ctx.length, scale)
            return out.reshape(B, 1, H, D), None
        if ctx.attn_impl == "sdpa":  # the G query heads of a kv head as G query positions: MHA over Hkv heads
            q = query.reshape(B, Hkv, H // Hkv, D)
            mask = ctx.bias[:, None, None, :].to(q.dtype)
            out = F.scaled_dot_product_attention(
                q, kc[:B, :, : ctx.length], vc[:B, :, : ctx.length], attn_mask=mask, scale=scale
            )
            return out.reshape(B, 1, H, D), None
        k = kc[:B, :, : ctx.length]
        v = vc[:B, :, : ctx.length]
        q = query.reshape(B, Hkv, H // Hkv, D)  # query head h reads kv head h // (H / Hkv), as repeat_kv
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, L]
        probs = torch.softmax(scores + ctx.bias[:, None, None, :], dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [B, Hkv, G, D]
        return out.reshape(B, 1, H, D), None
    if ctx.mode == "prefill":
        li = module.layer_idx
        T = key.shape[2]
        ctx.k[li][ctx.slots, :, :T] = key
        ctx.v[li][ctx.slots, :, :T] = value
    # Causal attention over the (right-padded) rows themselves: padding only follows the real tokens.
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _kv_attention)
    with contextlib.suppress(Exception):  # older transformers: models build masks themselves
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)


# ---------------------------------------------------------------------------------------------------------------
# decode attention as one Triton kernel (GPU): each program reads one (row, kv head)'s keys and values once, for
# all G query heads that share them, with an online softmax over blocks of keys, up to the row's own length.


_TRITON: dict = {}


def _decode_kernel():
    if "kernel" in _TRITON:
        return _TRITON["kernel"]
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        Q, K, V, POS, OUT, LSE, scale,
        sqb, sqh, skb, skh, skn, svb, svh, svn, sob, soh, sos, slb, slh,
        CHUNK, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kh = tl.program_id(1)
        s = tl.program_id(2)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        gmask = offs_g < G
        heads = kh * G + offs_g
        q = tl.load(Q + b * sqb + heads[:, None] * sqh + offs_d[None, :], mask=gmask[:, None], other=0.0)
        length = tl.load(POS + b).to(tl.int32) + 1
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, length)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        kbase = K + b * skb + kh * skh
        vbase = V + b * svb + kh * svh
        for n0 in range(start, end, BLOCK_N):
            n = n0 + offs_n
            nmask = n < end
            k = tl.load(kbase + n[:, None] * skn + offs_d[None, :], mask=nmask[:, None], other=0.0)
            if IEEE:  # float32 engines: no TF32 rounding in the dots
                qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                qk = tl.dot(q, tl.trans(k)) * scale
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vbase + n[:, None] * svn + offs_d[None, :], mask=nmask[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        nonempty = l_i > 0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        optr = OUT + b * sob + heads[:, None] * soh + s * sos + offs_d[None, :]
        tl.store(optr, out.to(OUT.dtype.element_ty), mask=gmask[:, None])
        if SPLIT > 1:
            lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
            tl.store(LSE + b * slb + heads * slh + s, lse, mask=gmask)

    _TRITON["kernel"] = kernel
    return kernel


def decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, length: int, scale: float
) -> torch.Tensor:
    """q [B, H, D] (the new token of each row), caches [slots, Hkv, max_len, D] (rows [0, B) used), pos [B]: row
    b attends to keys [0, pos[b]] (its new key already written). `length` (>= every pos + 1) sizes the work split.
    Returns [B, H, D] in q's dtype. GQA: query head h reads kv head h // (H / Hkv)."""
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode_attention_triton needs the last dimension contiguous")
    block_n = 64
    # Enough programs to fill the GPU: with few rows, split each row's keys over several programs.
    split = max(1, min(-(-length // 256), -(-1024 // max(1, B * Hkv))))
    per_split = -(-length // split)
    chunk = -(-per_split // block_n) * block_n
    if split > 1:
        out = torch.empty(B, H, split, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, split, dtype=torch.float32, device=q.device)
    else:
        out = torch.empty(B, H, 1, D, dtype=q.dtype, device=q.device)
        lse = out  # unused
    _decode_kernel()[(B, Hkv, split)](
        q, k_cache, v_cache, pos, out, lse, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0) if split > 1 else 0, lse.stride(1) if split > 1 else 0, chunk,
        G=G, D=D, BLOCK_G=max(16, triton_next_pow2(G)), BLOCK_N=block_n, SPLIT=split,
        IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if split == 1:
        return out[:, :, 0]
    w = torch.softmax(lse, dim=-1)
    return (out * w[..., None]).sum(2).to(q.dtype)


def _rmsnorm_kernel():
    if "rmsnorm" in _TRITON:
        return _TRITON["rmsnorm"]
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        y = (x * (1.0 / tl.sqrt(var + eps))).to(X.dtype.element_ty)  # hidden_states.to(input_dtype)
        w = tl.load(W + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * y.to(tl.float32)  # weight * hidden (computed in float, rounded once)
        tl.store(Y + row * stride_y + cols, out.to(Y.dtype.element_ty), mask=mask)

    _TRITON["rmsnorm"] = kernel
    return kernel


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm (`weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)`) as one
    kernel instead of ~7 (it runs 4 times per decoder layer; in a decode step its launches add up)."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton_next_pow2(N)
    _rmsnorm_kernel()[(x2.shape[0],)](
        x2, weight, y, x2.stride(0), y.stride(0), N, float(eps), BLOCK=block, num_warps=4 if block >= 1024 else 1
    )
    return y.view(x.shape)


_FUSABLE_NORMS = {"Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm"}


def _fused_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rmsnorm_triton(hidden_states, self.weight, self.variance_epsilon)


def triton_next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def triton_decode_supported(head_dim: int, group: int) -> str | None:
    """None if the Triton decode attention can run here, else why not."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim={head_dim} is not a power of two >= 16"
    if group > 64:
        return f"{group} query heads per kv head"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


# ---------------------------------------------------------------------------------------------------------------
# sampling


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def uniform_noise(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per row from (seed, step): counter-based, so independent of batch composition."""
    with np.errstate(over="ignore"):
        h = _splitmix64(_splitmix64(seeds.astype(np.uint64)) ^ steps.astype(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) / float(2**53)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_SM = (_signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    x = x + _SM[0]  # int64 arithmetic wraps, as uint64 does: same bits as the numpy version
    x = (x ^ _srl(x, 30)) * _SM[1]
    x = (x ^ _srl(x, 27)) * _SM[2]
    return x ^ _srl(x, 31)


def uniform_noise_torch(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`uniform_noise` on int64 tensors, on their device (bit-identical to the numpy version; graph-capturable)."""
    h = _splitmix64_t(_splitmix64_t(seeds) ^ steps)
    return _srl(h, 11).double() / float(2**53)


_BLOCK = 128  # tokens per block of the two-level inverse CDF (151936 = 128 x 1187)


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """Index of the last entry > 0 in each row of `x` [n, m] (0 if none)."""
    idx = torch.arange(x.shape[-1], device=x.device)
    return torch.where(x > 0, idx, 0).amax(-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of `probs` [n, V] (float32, >= 0), the first token whose cumulative mass exceeds
    `u` x total (u [n] in [0, 1)). Two levels (sums of blocks of 128, then the cumulative sum inside the chosen
    block) instead of a cumulative sum over V. Never returns a token of zero probability. No host sync."""
    n, V = probs.shape
    blk = min(_BLOCK, V)
    pad = (-V) % blk
    if pad:
        probs = F.pad(probs, (0, pad))
    nb = probs.shape[1] // blk
    blocks = probs.view(n, nb, blk)
    sums = blocks.sum(-1)  # [n, nb]
    csum = sums.cumsum(-1)
    target = (u.to(torch.float32) * csum[:, -1])[:, None]  # [n, 1]
    b = torch.searchsorted(csum, target, right=True)
    b = torch.minimum(b, _last_positive(sums)[:, None])  # rounding at the top end: stay on mass
    before = csum.gather(1, b) - sums.gather(1, b)  # [n, 1]: mass of the blocks before b
    inner = blocks.gather(1, b[:, :, None].expand(n, 1, blk))[:, 0]  # [n, blk]
    j = torch.searchsorted(inner.cumsum(-1) + before, target, right=True)
    j = torch.minimum(j, _last_positive(inner)[:, None])
    return (b * blk + j)[:, 0].clamp_(max=V - 1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [n, V] (any float dtype; the math is float32); return (tokens [n],
    processed logprobs [n], float32).

    temperature 0 is greedy (argmax; logprob = plain log-softmax). `top_k` [n] (V for off) and `top_p` [n]
    (1 for off) may be None when no row uses them. The sample is the inverse CDF at `u` [n] (in [0, 1)).
    Without top-k/top-p nothing here synchronises with the host (it runs inside the decode CUDA graph)."""
    greedy = temperature == 0
    # float32 in one pass (a bf16 tensor over a float32 one promotes): no separate upcast copy
    scaled = logits / torch.where(greedy, 1.0, temperature).float()[:, None]
    if top_k is not None:
        kmax = int(top_k.max())
        kth = torch.topk(scaled, kmax, dim=-1).values.gather(1, (top_k - 1).clamp(max=kmax - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, _NEG_INF)
    if top_p is not None:
        sorted_l, idx = scaled.sort(dim=-1, descending=True)
        probs = sorted_l.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above: keep while it is below top_p
        sorted_l = sorted_l.masked_fill(before >= top_p[:, None], _NEG_INF)
        scaled = torch.empty_like(scaled).scatter_(1, idx, sorted_l)
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    drawn = inverse_cdf(torch.exp(scaled - lse), u)
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    return tokens, (scaled.gather(1, tokens[:, None]) - lse)[:, 0]


# ---------------------------------------------------------------------------------------------------------------
# the engine


@dataclass
class _Request:
    prompt_index: int
    prompt: list[int]
    seed: int
    params: SamplingParams
    stop: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def _buckets(limit: int, small: Sequence[int], step: int) -> list[int]:
    out = sorted({b for b in small if b < limit} | set(range(step, limit, step)) | {limit})
    return out


class HFEngine:
    """A transformers model with a static KV cache, continuous batching and (on GPU) CUDA-graph decode steps.

    `max_num_seqs`: slots of the KV cache (sequences decoded together); it is lowered to what
    `kv_cache_memory_bytes` holds when that is given. `cuda_graphs`: capture decode steps on GPU.
    `sync_every`: decode steps between host reads of the sampled tokens (stop checks) when no row uses
    top-k/top-p; 1 reads after every step. `attn_impl`: decode attention — "triton" (one kernel per layer that
    reads each row's keys/values once for all query heads sharing them, up to the row's length; GPU), "sdpa"
    (torch SDPA with a length mask), "matmul" (two batched matmuls over the length bucket), or "auto" (triton
    on GPU when it is available and agrees with matmul on a self-check at start, else matmul;
    `attn_fallback` says why when it falls back).
    """

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 256,
        max_num_seqs: int = 256,
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        device: str | torch.device | None = None,
        cuda_graphs: bool = True,
        max_prefill_tokens: int = 16384,
        len_bucket_step: int = 256,
        sync_every: int = 16,
        attn_impl: str = "auto",
        fused_norm: bool | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise FileNotFoundError(
                f"{model_dir!r} has no config.json; HFEngine needs an HF-format model directory "
                "(config.json + *.safetensors), e.g. written by save_pretrained"
            )
        from transformers import AutoModelForCausalLM

        _register_attention()
        self.model_dir, self.dtype, self.torch_dtype = model_dir, dtype, _DTYPES[dtype]
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.torch_dtype, attn_implementation=ATTN_NAME)
        self.model = model.to(self.device).eval().requires_grad_(False)
        cfg = model.config.get_text_config()
        layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if (
            layer_types != {"full_attention"}
            or getattr(cfg, "sliding_window", None)
            and getattr(cfg, "use_sliding_window", False)
        ):
            raise NotImplementedError(f"HFEngine supports full-attention models only; this one has {layer_types}")
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(cfg, attr, None):
                raise NotImplementedError(f"HFEngine does not apply {attr} (the model's logits are post-processed)")
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        # The attention mask handed to the decoder: an "already prepared" 4D mask, which transformers' mask
        # builders (`create_causal_mask` & co.) return as it is, in every model and version, so no mask is built
        # per forward (our attention function ignores it: it masks by itself). Not the per-layer-type dict that
        # Qwen2/Qwen3's forward accepts: Llama's and GPT-2's forwards call `.ndim` on the mask they get.
        self._mask_arg = torch.zeros(1, 1, 1, 1, dtype=self.torch_dtype, device=self.device)
        self.vocab_size = int(cfg.vocab_size)
        self._max_model_len = min(int(max_model_len), max_positions(cfg))  # GPT-2: n_positions
        self.num_layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        self._heads = heads
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        per_slot = 2 * self.num_layers * self.kv_heads * self._max_model_len * self.head_dim
        per_slot *= torch.finfo(self.torch_dtype).bits // 8
        slots = int(max_num_seqs)
        if kv_cache_memory_bytes is not None:
            slots = min(slots, int(kv_cache_memory_bytes) // per_slot)
        if slots < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={kv_cache_memory_bytes} holds no sequence of max_model_len="
                f"{self._max_model_len} ({per_slot} bytes each); raise it or lower max_model_len"
            )
        self.num_slots = slots
        self.kv_cache_bytes = per_slot * slots
        # The cache: allocated once, never re-allocated (weight updates and CUDA graphs rely on it).
        self.kv = torch.zeros(
            2, self.num_layers, slots, self.kv_heads, self._max_model_len, self.head_dim,
            dtype=self.torch_dtype, device=self.device,
        )  # fmt: skip
        self._ctx = _Ctx()
        self._ctx.k, self._ctx.v = list(self.kv[0]), list(self.kv[1])
        # Static decode inputs (CUDA graphs read these addresses).
        self.ids_buf = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.pos_buf = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.rows_buf = torch.arange(slots, device=self.device)
        self.iota = torch.arange(self._max_model_len, device=self.device)
        self.logits_buf = torch.zeros(slots, self.vocab_size, dtype=self.torch_dtype, device=self.device)
        # Device-side decode loop (see the module docstring): per-row sampling state, uploaded once per chunk,
        # and the history of the chunk's sampled tokens / logprobs, read by the host once per chunk.
        if int(sync_every) < 1:
            raise ValueError(f"sync_every={sync_every} must be >= 1")
        self.sync_every = int(sync_every)
        self.seedstep_buf = torch.zeros(2, slots, dtype=torch.long, device=self.device)  # [seed; tokens so far]
        self.temp_buf = torch.ones(slots, dtype=torch.float32, device=self.device)
        self.n_buf = torch.zeros(1, dtype=torch.long, device=self.device)  # running rows (bucket pad rows idle)
        self.k_buf = torch.zeros(1, dtype=torch.long, device=self.device)  # step within the chunk
        self.hist_tok = torch.zeros(self.sync_every, slots, dtype=torch.long, device=self.device)
        self.hist_lp = torch.zeros(self.sync_every, slots, dtype=torch.float32, device=self.device)
        self.use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.batch_buckets = _buckets(slots, (1, 2, 4, 8, 16, 24, 32, 48), 64 if slots > 64 else 16)
        # Decode attention reads the KV of [0, length bucket) for every row: finer buckets read less padding but
        # capture more graphs (one per batch bucket x length bucket).
        self.len_buckets = _buckets(self._max_model_len, (32, 64, 128, 256), int(len_bucket_step))
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}  # (batch, length, device loop)
        self._graph_pool = None
        self.graph_failures: list[str] = []
        self.max_prefill_tokens = int(max_prefill_tokens)
        self._rng = random.Random(seed)
        # Every request stops at these (with its own stop_token_ids): generation_config's eos ids, config's and the
        # tokenizer's, as `meshrl.models.hf_config.stop_token_ids` unions them.
        self.eos_ids = frozenset(stop_token_ids(model_dir))
        self.stats = {"decode_steps": 0, "prefills": 0, "graph_replays": 0, "host_syncs": 0}
        self.attn_fallback: str | None = None
        self.attn_impl = self._choose_attn(attn_impl)
        self._ctx.attn_impl = self.attn_impl
        self.norm_fallback: str | None = None
        self.fused_norm = self._fuse_norms(self.device.type == "cuda" if fused_norm is None else bool(fused_norm))

    def _fuse_norms(self, want: bool) -> bool:
        """Replace the forward of the model's RMSNorm modules (this engine's instances only) by one Triton
        kernel each, after checking it against the module's own forward."""
        if not want:
            return False
        norms = [m for m in self.model.modules() if type(m).__name__ in _FUSABLE_NORMS and hasattr(m, "weight")]
        if not norms or not all(hasattr(m, "variance_epsilon") for m in norms):
            self.norm_fallback = "no Llama/Qwen-style RMSNorm modules in this model"
            return False
        try:
            import triton  # noqa: F401

            g = torch.Generator(device=self.device).manual_seed(0)
            for m in {m.weight.shape[0]: m for m in norms}.values():
                x = 3 * torch.randn(37, m.weight.shape[0], generator=g, device=self.device, dtype=self.torch_dtype)
                ref, got = m(x).float(), rmsnorm_triton(x, m.weight, m.variance_epsilon).float()
                rel = float(((got - ref).abs() / (ref.abs() + 1e-2)).max())
                if not rel < 0.02:
                    self.norm_fallback = f"fused RMSNorm disagrees with the model's (max rel diff {rel:.3g})"
                    return False
        except Exception as e:  # noqa: BLE001 - any failure: keep the model's own norms
            self.norm_fallback = f"fused RMSNorm failed its self-check: {type(e).__name__}: {str(e)[:300]}"
            return False
        import types

        for m in norms:
            m.forward = types.MethodType(_fused_norm_forward, m)
        return True

    def _choose_attn(self, want: str) -> str:
        if want not in ("auto", "triton", "sdpa", "matmul"):
            raise ValueError(f"attn_impl={want!r}; use 'auto', 'triton', 'sdpa' or 'matmul'")
        if want != "auto":
            return want
        if self.device.type != "cuda":
            return "matmul"
        why = triton_decode_supported(self.head_dim, self._heads // self.kv_heads)
        if why is None:
            why = self._check_triton_attention()
        if why is None:
            return "triton"
        self.attn_fallback = why
        return "matmul"

    def _check_triton_attention(self) -> str | None:
        """Triton decode attention against the matmul formulation on random data of this model's shapes."""
        try:
            g = torch.Generator(device=self.device).manual_seed(0)
            B, L, H, Hkv, D = 5, min(self._max_model_len, 300), self._heads, self.kv_heads, self.head_dim
            kc, vc = (torch.randn(B, Hkv, L, D, generator=g, device=self.device, dtype=self.torch_dtype) for _ in "kv")
            q = torch.randn(B, H, D, generator=g, device=self.device, dtype=self.torch_dtype)
            pos = torch.tensor([0, 1, L // 2, L - 2, L - 1][:B], device=self.device)
            got = decode_attention_triton(q, kc, vc, pos, L, D**-0.5).float()
            bias = torch.where(torch.arange(L, device=self.device)[None] <= pos[:, None], 0.0, _NEG_INF)
            qq = q.float().reshape(B, Hkv, H // Hkv, D)
            probs = torch.softmax(qq @ kc.float().transpose(-1, -2) * D**-0.5 + bias[:, None, None], -1)
            ref = (probs @ vc.float()).reshape(B, H, D)
            err = float((got - ref).abs().max())
            if not err < 0.05:
                return f"triton decode attention disagrees with matmul (max abs diff {err:.3g})"
            return None
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            return f"triton decode attention failed its self-check: {type(e).__name__}: {str(e)[:300]}"

    # ------------------------------------------------------------------ properties

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    # ------------------------------------------------------------------ validation

    def _check_tokens(self, what: str, index: int, ids: Sequence[int]) -> None:
        if len(ids) == 0:
            raise ValueError(f"{what} {index} is empty; every {what} needs at least one token id")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(
                f"{what} {index} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:8]}"
                f"{' ...' if len(bad) > 8 else ''}"
            )

    # ------------------------------------------------------------------ forward passes

    @contextlib.contextmanager
    def _mode(self, mode: str):
        self._ctx.mode = mode
        _ACTIVE.append(self._ctx)
        try:
            yield self._ctx
        finally:
            _ACTIVE.pop()

    def _hidden(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.decoder(input_ids=ids, position_ids=pos, attention_mask=self._mask_arg, use_cache=False)
        return out.last_hidden_state

    @torch.no_grad()
    def _prefill(self, rows: list[list[int]], slots: torch.Tensor) -> torch.Tensor:
        """Run right-padded prompts, writing their KV into `slots`; return last-position logits (float32)."""
        T = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        ids = ids.to(self.device, non_blocking=True)
        pos = self.iota[:T].expand(len(rows), T)
        with self._mode("prefill") as ctx:
            ctx.slots = slots
            h = self._hidden(ids, pos)
        last = torch.tensor([len(r) - 1 for r in rows], device=self.device)
        self.stats["prefills"] += 1
        return self.lm_head(h[torch.arange(len(rows), device=self.device), last]).float()

    def _decode_forward(self, B: int, L: int) -> torch.Tensor:
        ctx = self._ctx
        ctx.rows, ctx.pos, ctx.length = self.rows_buf[:B], self.pos_buf[:B], L
        ctx.bias = torch.where(self.iota[None, :L] <= self.pos_buf[:B, None], 0.0, _NEG_INF)
        h = self._hidden(self.ids_buf[:B, None], self.pos_buf[:B, None])
        out = self.logits_buf[:B]
        torch.matmul(h[:, 0], self.lm_head.weight.t(), out=out)
        if getattr(self.lm_head, "bias", None) is not None:
            out.add_(self.lm_head.bias)
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

    @torch.no_grad()
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
            return graph
        except Exception as e:  # noqa: BLE001 - fall back to eager decode steps, and say why
            self.graph_failures.append(f"{type(e).__name__}: {e}")
            self.use_graphs = False
            return None

    @torch.no_grad()
    def _decode_chunk(self, running: list[_Request], pos: np.ndarray, k_steps: int) -> None:
        """`k_steps` device-loop decode steps of every running row, then one host read of what they sampled:
        tokens after a row's stop token are dropped (the row stopped there)."""
        n = len(running)
        ss = np.empty((2, n), dtype=np.int64)
        ss[0] = [r.seed for r in running]
        ss[1] = [len(r.tokens) for r in running]
        self.seedstep_buf[:, :n].copy_(torch.from_numpy(ss), non_blocking=True)
        temps = np.array([r.params.temperature for r in running], dtype=np.float32)
        self.temp_buf[:n].copy_(torch.from_numpy(temps), non_blocking=True)
        self.n_buf.fill_(n)
        self.k_buf.zero_()
        first = int(pos[:n].max()) + 1
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
        pos[:n] += k_steps
        stops = frozenset().union(*{id(r.stop): r.stop for r in running}.values())
        hit_rows = set(np.flatnonzero(np.isin(toks, list(stops)).any(0)).tolist()) if stops else set()
        tok_rows, lp_rows = toks.T.tolist(), lps.T.tolist()
        for i, r in enumerate(running):
            t, lp = tok_rows[i], lp_rows[i]
            cut = next((k + 1 for k, x in enumerate(t) if x in r.stop), 0) if i in hit_rows else 0
            if cut:
                r.tokens += t[:cut]
                r.logprobs += lp[:cut]
                r.finish_reason = "stop"
            else:
                r.tokens += t
                r.logprobs += lp
                if len(r.tokens) >= r.params.max_tokens:
                    r.finish_reason = "length"

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams, policy_version: int) -> list[list[Completion]]:
        """Sample `params.n` completions per prompt. Returns one list of `Completion`s per prompt, in order.

        temperature 0 is greedy (the n completions are then identical). With `params.seed` set, prompt i's
        sample j uses seed `params.seed + i * n + j`: a call is reproducible and no two samples share noise.
        """
        prompts = [[int(t) for t in p] for p in prompts]
        for i, p in enumerate(prompts):
            self._check_tokens("prompt", i, p)
            if len(p) + params.max_tokens > self._max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens and max_tokens={params.max_tokens}, which together "
                    f"exceed max_model_len={self._max_model_len}; shorten/filter the prompt, lower "
                    f"max_tokens, or build the engine with max_model_len >= {len(p) + params.max_tokens}"
                )
        if not prompts:
            return []
        greedy = params.temperature == 0
        n_run = 1 if greedy else params.n
        stop = frozenset(int(t) for t in params.stop_token_ids) | self.eos_ids
        requests = []
        for i, p in enumerate(prompts):
            for j in range(n_run):
                seed = self._rng.getrandbits(63) if params.seed is None else params.seed + i * params.n + j
                requests.append(_Request(i, p, seed, params, stop))
        self._run(requests)
        results: list[list[Completion]] = [[] for _ in prompts]
        for r in requests:
            c = Completion(list(r.prompt), r.tokens, r.logprobs, r.finish_reason or "length", policy_version)
            results[r.prompt_index].append(c)
        if greedy and params.n > 1:
            results = [
                [Completion(list(c.prompt_ids), list(c.token_ids), list(c.logprobs), c.finish_reason, c.policy_version)
                 for _ in range(params.n)]
                for (c,) in results
            ]  # fmt: skip
        return results

    def _run(self, requests: list[_Request]) -> None:
        """Continuous batching: admit into free slots, decode all running rows, retire finished ones."""
        queue = deque(requests)
        running: list[_Request] = []  # row r of the batch lives in slot r
        pos = np.zeros(self.num_slots, dtype=np.int64)  # CPU mirror of pos_buf
        holes: list[int] = []  # rows whose request finished (their slots are free)
        while queue or running:
            if queue and (holes or len(running) < self.num_slots):
                rows = self._admit(queue, running, pos, holes)
                taken = set(rows)
                holes = [h for h in holes if h not in taken] + self._retire(running, rows)
            if holes:
                self._compact(running, holes, pos)
                holes = []
            if running:
                n = len(running)
                if all(r.params.temperature == 0 or (r.params.top_k == -1 and r.params.top_p >= 1) for r in running):
                    # Device loop: until the next host read, every step stays on the device. Rows reaching
                    # max_tokens end exactly at a chunk boundary.
                    k = min(self.sync_every, min(r.params.max_tokens - len(r.tokens) for r in running))
                    self._decode_chunk(running, pos, k)
                else:  # top-k / top-p: sample outside the graph, one host round trip per step
                    logits = self._decode(n, int(pos[:n].max()) + 1)
                    self._sample_and_append(logits, running, list(range(n)))
                    pos[:n] += 1
                    self.pos_buf[:n] += 1
                holes = self._retire(running, list(range(n)))

    def _admit(self, queue: deque, running: list[_Request], pos: np.ndarray, holes: list[int]) -> list[int]:
        """Prefill as many queued requests as fit (free slots, prefill token budget) into the holes first, then
        after the last running row. Returns the rows they took."""
        free = sorted(holes) + list(range(len(running), self.num_slots))
        batch: list[_Request] = []
        prompts: dict[int, int] = {}  # id(prompt) -> longest so far (one prefill row per distinct prompt)
        longest = 0
        while queue and len(batch) < len(free):
            r = queue[0]
            new_longest = max(longest, len(r.prompt))
            n_unique = len(prompts) + (id(r.prompt) not in prompts)
            if batch and n_unique * new_longest > self.max_prefill_tokens:
                break
            queue.popleft()
            batch.append(r)
            prompts.setdefault(id(r.prompt), 0)
            longest = new_longest
        rows = free[: len(batch)]
        for row, r in zip(rows, batch, strict=True):
            if row < len(running):
                running[row] = r
            else:
                running.append(r)
        # One prefill per distinct prompt (the samples of a prompt share it); its KV is copied to the others.
        src_row: dict[int, int] = {}
        for row, r in zip(rows, batch, strict=True):
            src_row.setdefault(id(r.prompt), row)
        uniq_rows = list(src_row.values())
        logits = self._prefill([running[row].prompt for row in uniq_rows], torch.tensor(uniq_rows, device=self.device))
        copies = [(row, src_row[id(r.prompt)]) for row, r in zip(rows, batch, strict=True)]
        copies = [(d, s) for d, s in copies if d != s]
        if copies:
            T = max(len(running[d].prompt) for d, _ in copies)
            dst = torch.tensor([d for d, _ in copies], device=self.device)
            src = torch.tensor([s for _, s in copies], device=self.device)
            self.kv[:, :, dst, :, :T] = self.kv[:, :, src, :, :T]
        which = {row: i for i, row in enumerate(uniq_rows)}
        pick = torch.tensor([which[src_row[id(r.prompt)]] for r in batch], device=self.device)
        self._sample_and_append(logits[pick], running, rows)
        lens = np.array([len(r.prompt) for r in batch], dtype=np.int64)
        pos[rows] = lens
        self.pos_buf[torch.tensor(rows, device=self.device)] = torch.from_numpy(lens).to(self.device)
        return rows

    def _sample_and_append(self, logits: torch.Tensor, running: list[_Request], rows: list[int]) -> None:
        reqs = [running[r] for r in rows]
        temp = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32)
        top_k = top_p = None
        if any(r.params.temperature > 0 and r.params.top_k != -1 for r in reqs):
            top_k = torch.tensor(
                [
                    r.params.top_k if (r.params.temperature > 0 and r.params.top_k != -1) else self.vocab_size
                    for r in reqs
                ]
            ).clamp_(max=self.vocab_size)
            top_k = top_k.to(self.device, non_blocking=True)
        if any(r.params.temperature > 0 and r.params.top_p < 1 for r in reqs):
            top_p = torch.tensor([r.params.top_p if r.params.temperature > 0 else 1.0 for r in reqs])
            top_p = top_p.to(self.device, non_blocking=True)
        seeds = np.array([r.seed for r in reqs], dtype=np.uint64)
        steps = np.array([len(r.tokens) for r in reqs], dtype=np.uint64)
        u = torch.from_numpy(uniform_noise(seeds, steps)).to(self.device, non_blocking=True)
        tokens, logprobs = sample(logits, temp.to(self.device, non_blocking=True), top_k, top_p, u)
        self.ids_buf[torch.tensor(rows, device=self.device)] = tokens
        host = torch.stack([tokens.double(), logprobs.double()]).cpu()
        for r, t, lp in zip(reqs, host[0].tolist(), host[1].tolist(), strict=True):
            t = int(t)
            r.tokens.append(t)
            r.logprobs.append(lp)
            if t in r.stop:
                r.finish_reason = "stop"
            elif len(r.tokens) >= r.params.max_tokens:
                r.finish_reason = "length"

    @staticmethod
    def _retire(running: list[_Request], rows: list[int]) -> list[int]:
        return [row for row in rows if running[row].finish_reason is not None]

    def _compact(self, running: list[_Request], holes: list[int], pos: np.ndarray) -> None:
        """Drop finished rows; move the last running rows (slot, KV, decode inputs) into the holes below them."""
        finished = set(holes)
        keep_n = len(running) - len(finished)
        movers = [r for r in range(keep_n, len(running)) if r not in finished]
        targets = [h for h in sorted(finished) if h < keep_n]
        assert len(movers) == len(targets)
        if movers:
            T = int(pos[movers].max())
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(targets, device=self.device)
            self.kv[:, :, dst, :, :T] = self.kv[:, :, src, :, :T]
            self.ids_buf[dst] = self.ids_buf[src]
            self.pos_buf[dst] = self.pos_buf[src]
            pos[targets] = pos[movers]
            for s, d in zip(movers, targets, strict=True):
                running[d] = running[s]
        del running[keep_n:]
        self.pos_buf[keep_n:] = 0
        pos[keep_n:] = 0

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t = 1 .. len(seq)-1 of each sequence (raw logits, temperature 1)."""
        sequences = [[int(t) for t in s] for s in sequences]
        for i, s in enumerate(sequences):
            self._check_tokens("sequence", i, s)
            if len(s) > self._max_model_len:
                raise ValueError(
                    f"sequence {i} has {len(s)} tokens > max_model_len={self._max_model_len}; truncate it or "
                    f"build the engine with max_model_len >= {len(s)}"
                )
        results: list[list[float]] = [[] for _ in sequences]
        todo = [i for i, s in enumerate(sequences) if len(s) >= 2]
        budget = max(1, self.max_prefill_tokens)
        start = 0
        while start < len(todo):
            end = start + 1
            while (
                end < len(todo) and (end + 1 - start) * max(len(sequences[j]) for j in todo[start : end + 1]) <= budget
            ):
                end += 1
            chunk = [sequences[j] for j in todo[start:end]]
            T = max(len(s) for s in chunk)
            ids = torch.zeros(len(chunk), T, dtype=torch.long)
            for k, s in enumerate(chunk):
                ids[k, : len(s)] = torch.tensor(s)
            ids = ids.to(self.device)
            with self._mode("full"):
                h = self._hidden(ids, self.iota[:T].expand(len(chunk), T))
            for k, s in enumerate(chunk):
                lp = torch.log_softmax(self.lm_head(h[k, : len(s) - 1]).float(), dim=-1)
                results[todo[start + k]] = lp.gather(1, ids[k, 1 : len(s), None])[:, 0].tolist()
            start = end
        return results

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the model in place (cast to the engine dtype). The KV cache and the
        captured CUDA graphs stay valid (same storage). `lm_head.weight` may be absent when tied."""
        if not state_dict:
            raise ValueError("load_weights got an empty state dict")
        if not hasattr(self, "_params"):  # weights are updated in place: the same tensors for the engine's life
            self._params = {k: v.data for k, v in self.model.state_dict(keep_vars=True).items()}
        params = self._params
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

    # ------------------------------------------------------------------ teardown

    def shutdown(self) -> None:
        """Free the model, the cache and the graphs. The object is unusable afterwards."""
        self._graphs.clear()
        for name in ("model", "decoder", "lm_head", "kv", "logits_buf"):
            if hasattr(self, name):
                setattr(self, name, None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


__all__ = ["HFEngine", "inverse_cdf", "sample", "uniform_noise", "uniform_noise_torch", "ATTN_NAME"]
