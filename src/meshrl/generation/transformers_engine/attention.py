"""The attention function the model calls (registered with transformers' `AttentionInterface` as "meshrl_kv"), and
the context that tells it what the forward being run is.

The model's own projections, norms and RoPE run unchanged; only the attention reads and writes our cache. The
runner sets the context around each forward (`use_context`): "full" (no cache: prompt logprobs), "prefill" (write
the rows' KV into `slots`), "decode" (one new token per row, written at `pos`, attention over `[0, length)`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from meshrl.generation.transformers_engine.kernels import (
    decode_attention_triton,
    dequantize_kv,
    quantize_kv,
    store_kv_fp8_triton,
)

ATTN_NAME = "meshrl_kv"


class AttentionContext:
    """What the attention function needs for the forward being run (set by the runner around each forward)."""

    mode: str = "full"  # "full" (no cache), "prefill" (write rows `slots`), "decode" (write at `pos`)
    k: list[torch.Tensor] = []
    v: list[torch.Tensor] = []
    k_scale: list[torch.Tensor] = []  # fp8 cache: per layer, float32 [slots, Hkv, L], one per (token, kv head)
    v_scale: list[torch.Tensor] = []  # (empty lists: the cache holds the model's dtype)
    slots: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    length: int = 0
    attn_impl: str = "matmul"  # decode attention: "matmul" | "sdpa" | "triton"
    launch: dict = {}  # "triton": the kernel's launch keywords (kernels.fp8_decode_launch for an fp8 cache)


_ACTIVE: list[AttentionContext] = []


@contextlib.contextmanager
def use_context(ctx: AttentionContext, mode: str) -> Iterator[AttentionContext]:
    """Make `ctx` (in `mode`) the one the attention function reads, for the forwards run inside the block."""
    ctx.mode = mode
    _ACTIVE.append(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.pop()


def kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, H, T, D], key/value [B, Hkv, T, D] (after RoPE) -> ([B, T, H, D], None)."""
    if not _ACTIVE:
        raise RuntimeError(f"attention '{ATTN_NAME}' called outside TransformersEngine (no KV cache is set)")
    ctx = _ACTIVE[-1]
    if ctx.mode == "decode":
        li = module.layer_idx
        kc, vc = ctx.k[li], ctx.v[li]  # [S, Hkv, L, D]
        B, H, _, D = query.shape
        Hkv = kc.shape[1]
        if ctx.k_scale and ctx.attn_impl == "triton":  # one launch per tensor, not quantize_kv's ~8
            store_kv_fp8_triton(key[:, :, 0], kc, ctx.k_scale[li], ctx.rows, ctx.pos)
            store_kv_fp8_triton(value[:, :, 0], vc, ctx.v_scale[li], ctx.rows, ctx.pos)
        else:
            _write(ctx, li, (ctx.rows, slice(None), ctx.pos), key[:, :, 0], value[:, :, 0])
        scale = scaling if scaling is not None else D**-0.5
        if ctx.attn_impl == "triton":
            scales = {"k_scale": ctx.k_scale[li], "v_scale": ctx.v_scale[li]} if ctx.k_scale else {}
            out = decode_attention_triton(query[:, :, 0], kc, vc, ctx.pos, ctx.length, scale, **scales, **ctx.launch)
            return out.reshape(B, 1, H, D), None
        k, v = kc[:B, :, : ctx.length], vc[:B, :, : ctx.length]
        if ctx.k_scale:
            k = dequantize_kv(k, ctx.k_scale[li][:B, :, : ctx.length], query.dtype)
            v = dequantize_kv(v, ctx.v_scale[li][:B, :, : ctx.length], query.dtype)
        if ctx.attn_impl == "sdpa":  # the G query heads of a kv head as G query positions: MHA over Hkv heads
            q = query.reshape(B, Hkv, H // Hkv, D)
            mask = ctx.bias[:, None, None, :].to(q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            return out.reshape(B, 1, H, D), None
        q = query.reshape(B, Hkv, H // Hkv, D)  # query head h reads kv head h // (H / Hkv), as repeat_kv
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, L]
        probs = torch.softmax(scores + ctx.bias[:, None, None, :], dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [B, Hkv, G, D]
        return out.reshape(B, 1, H, D), None
    if ctx.mode == "prefill":
        _write(ctx, module.layer_idx, (ctx.slots, slice(None), slice(0, key.shape[2])), key, value)
    # Causal attention over the (right-padded) rows themselves: padding only follows the real tokens.
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _write(ctx: AttentionContext, layer: int, index: tuple, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store keys / values [..., D] at `index` of layer `layer`'s caches (quantized, with their scales, in fp8)."""
    if ctx.k_scale:
        (key, k_scale), (value, v_scale) = quantize_kv(key), quantize_kv(value)
        ctx.k_scale[layer][index] = k_scale
        ctx.v_scale[layer][index] = v_scale
        # as bytes: fp8 tensors have no index_put kernel on every torch build
        ctx.k[layer].view(torch.uint8)[index] = key.view(torch.uint8)
        ctx.v[layer].view(torch.uint8)[index] = value.view(torch.uint8)
        return
    ctx.k[layer][index] = key
    ctx.v[layer][index] = value


def register_attention() -> None:
    """Make `attn_implementation="meshrl_kv"` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, kv_attention)
    with contextlib.suppress(Exception):  # older transformers: models build masks themselves
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)


__all__ = ["ATTN_NAME", "AttentionContext", "kv_attention", "register_attention", "use_context"]
