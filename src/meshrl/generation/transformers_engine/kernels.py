"""Triton kernels of the transformers engine (GPU): decode attention and a fused RMSNorm, with the checks that
decide whether they run here. Each is compared with the plain torch formulation on this model's shapes before it
is used; any failure falls back to torch and says why (`ModelRunner.attn_fallback` / `norm_fallback`)."""

from __future__ import annotations

import types

import torch

_NEG_INF = float("-inf")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 e4m3 [..., D], float32 scale [...]) with x ~= fp8 * scale[..., None]: each vector over
    its own largest magnitude, so no model's keys or values overflow e4m3's range (a per-tensor scale of 1, vLLM's
    default, turns |x| > 448 into NaN) and small ones keep 3 mantissa bits instead of falling into subnormals."""
    scale = x.abs().amax(-1).float().clamp_min(1e-30) / FP8_MAX
    return (x.float() / scale[..., None]).to(FP8), scale


def fp8_decode_launch(head_dim: int) -> dict:
    """The decode kernel's launch for an fp8 cache: blocks of 128 keys over 3 stages, 1.25-1.46x the default launch
    on an H100 at 512-2048 tokens of context (bench/decode_attention.py; fp8 tiles take half the shared memory of
    bf16 ones, so the launch that needed 128 KB with bf16 fits in ~64 KB). Heads over 128 keep the default."""
    return {"block_n": 128, "num_stages": 3} if head_dim <= 128 else {}


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale[..., None]).to(dtype)


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
        Q, K, V, KS, VS, POS, OUT, LSE, scale,
        sqb, sqh, skb, skh, skn, svb, svh, svn, sob, soh, sos, slb, slh, ssb, ssh,
        CHUNK, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr,
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
            if QUANT:  # fp8 cache: a key's scale multiplies its whole dot product, so it is applied after the dot
                k = k.to(q.dtype)
            if IEEE:  # float32 engines: no TF32 rounding in the dots
                qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                qk = tl.dot(q, tl.trans(k)) * scale
            if QUANT:
                qk = qk * tl.load(KS + b * ssb + kh * ssh + n, mask=nmask, other=0.0)[None, :]
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vbase + n[:, None] * svn + offs_d[None, :], mask=nmask[:, None], other=0.0)
            pv = p
            if QUANT:  # and a value's scale its row of p
                v = v.to(q.dtype)
                pv = p * tl.load(VS + b * ssb + kh * ssh + n, mask=nmask, other=0.0)[None, :]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v)
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
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    length: int,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    min_programs: int = 1024,
) -> torch.Tensor:
    """q [B, H, D] (the new token of each row), caches [slots, Hkv, max_len, D] (rows [0, B) used), pos [B]: row
    b attends to keys [0, pos[b]] (its new key already written). `length` (>= every pos + 1) sizes the work split.
    Returns [B, H, D] in q's dtype. GQA: query head h reads kv head h // (H / Hkv). fp8 caches
    (`quantize_kv`) come with their float32 scales `k_scale` / `v_scale` [slots, Hkv, max_len] (same strides for
    both). The keyword arguments below them are the launch's tuning (bench/decode_attention.py sweeps them)."""
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode_attention_triton needs the last dimension contiguous")
    quant = k_cache.dtype == FP8
    if quant and (k_scale is None or v_scale is None or k_scale.stride() != v_scale.stride()):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale of equal strides")
    if quant and (k_scale.stride(-1) != 1 or k_scale.dtype != torch.float32):
        raise ValueError("k_scale / v_scale must be float32 with the last dimension contiguous")
    # Enough programs to fill the GPU: with few rows, split each row's keys over several programs.
    split = max(1, min(-(-length // 256), -(-min_programs // max(1, B * Hkv))))
    per_split = -(-length // split)
    chunk = -(-per_split // block_n) * block_n
    if split > 1:
        out = torch.empty(B, H, split, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, split, dtype=torch.float32, device=q.device)
    else:
        out = torch.empty(B, H, 1, D, dtype=q.dtype, device=q.device)
        lse = out  # unused
    ks, vs = (k_scale, v_scale) if quant else (pos, pos)  # unused without QUANT
    _decode_kernel()[(B, Hkv, split)](
        q, k_cache, v_cache, ks, vs, pos, out, lse, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0) if split > 1 else 0, lse.stride(1) if split > 1 else 0,
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0, chunk,
        G=G, D=D, BLOCK_G=max(16, triton_next_pow2(G)), BLOCK_N=block_n, SPLIT=split,
        IEEE=q.dtype == torch.float32, QUANT=quant,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split == 1:
        return out[:, :, 0]
    w = torch.softmax(lse, dim=-1)
    return (out * w[..., None]).sum(2).to(q.dtype)


def _store_fp8_kernel():
    if "store_fp8" in _TRITON:
        return _TRITON["store_fp8"]
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        X, OUT, SCALE, ROWS, POS, sxb, sxh, sob, soh, son, ssb, ssh, D: tl.constexpr, BLOCK_D: tl.constexpr
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(X + b * sxb + h * sxh + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-30) / 448.0
        row = tl.load(ROWS + b)
        pos = tl.load(POS + b)
        y = (x / scale).to(OUT.dtype.element_ty)
        tl.store(OUT + row * sob + h * soh + pos * son + offs, y, mask=mask)
        tl.store(SCALE + row * ssb + h * ssh + pos, scale)

    _TRITON["store_fp8"] = kernel
    return kernel


def store_kv_fp8_triton(
    x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor
) -> None:
    """`quantize_kv(x)` written to `cache[rows, :, pos]` / `scale[rows, :, pos]` in one launch (a decode step's
    new keys or values, x [B, Hkv, D]): the torch formulation is ~8 kernels per tensor per layer, which adds up in
    a decode step."""
    B, Hkv, D = x.shape
    if x.stride(-1) != 1 or cache.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("store_kv_fp8_triton needs the last dimension contiguous")
    _store_fp8_kernel()[(B, Hkv)](
        x, cache, scale, rows, pos, x.stride(0), x.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
        scale.stride(0), scale.stride(1), D=D, BLOCK_D=triton_next_pow2(D), num_warps=1,
    )  # fmt: skip


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


def check_triton_attention(
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    max_len: int,
    fp8: bool = False,
    launch: dict | None = None,
) -> str | None:
    """Triton decode attention (launched with `launch`'s keywords) against the matmul formulation on random data
    of this model's shapes (with `fp8`: on a quantized cache, against the matmul over its dequantized values): None
    if it agrees, else why not."""
    launch = launch or {}
    try:
        g = torch.Generator(device=device).manual_seed(0)
        B, L, H, Hkv, D = 5, min(max_len, 300), heads, kv_heads, head_dim
        kc, vc = (torch.randn(B, Hkv, L, D, generator=g, device=device, dtype=dtype) for _ in "kv")
        q = torch.randn(B, H, D, generator=g, device=device, dtype=dtype)
        pos = torch.tensor([0, 1, L // 2, L - 2, L - 1][:B], device=device)
        if fp8:
            (k8, ks), (v8, vs) = quantize_kv(kc), quantize_kv(vc)
            # the decode step's fused store rewrites each row's last key, as quantize_kv did
            rows = torch.arange(B, device=device)
            new = kc[rows, :, pos].contiguous()
            store_kv_fp8_triton(new, k8, ks, rows, pos)
            err = float((dequantize_kv(k8[rows, :, pos], ks[rows, :, pos], torch.float32) - new.float()).abs().max())
            if not err <= 0.04 * float(new.abs().max()):
                return f"triton fp8 KV store disagrees with quantize_kv (max abs diff {err:.3g})"
            kc, vc = dequantize_kv(k8, ks, dtype), dequantize_kv(v8, vs, dtype)
            got = decode_attention_triton(q, k8, v8, pos, L, D**-0.5, k_scale=ks, v_scale=vs, **launch).float()
        else:
            got = decode_attention_triton(q, kc, vc, pos, L, D**-0.5, **launch).float()
        bias = torch.where(torch.arange(L, device=device)[None] <= pos[:, None], 0.0, _NEG_INF)
        qq = q.float().reshape(B, Hkv, H // Hkv, D)
        probs = torch.softmax(qq @ kc.float().transpose(-1, -2) * D**-0.5 + bias[:, None, None], -1)
        ref = (probs @ vc.float()).reshape(B, H, D)
        err = float((got - ref).abs().max())
        if not err < 0.05:
            return f"triton decode attention disagrees with matmul (max abs diff {err:.3g})"
        return None
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it
        return f"triton decode attention failed its self-check: {type(e).__name__}: {str(e)[:300]}"


def fuse_norms(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """Replace the forward of the model's RMSNorm modules (this model's instances only) by one Triton kernel each,
    after checking it against the module's own forward. None if they were fused, else why not."""
    norms = [m for m in model.modules() if type(m).__name__ in _FUSABLE_NORMS and hasattr(m, "weight")]
    if not norms or not all(hasattr(m, "variance_epsilon") for m in norms):
        return "no Llama/Qwen-style RMSNorm modules in this model"
    try:
        import triton  # noqa: F401

        g = torch.Generator(device=device).manual_seed(0)
        for m in {m.weight.shape[0]: m for m in norms}.values():
            x = 3 * torch.randn(37, m.weight.shape[0], generator=g, device=device, dtype=dtype)
            ref, got = m(x).float(), rmsnorm_triton(x, m.weight, m.variance_epsilon).float()
            rel = float(((got - ref).abs() / (ref.abs() + 1e-2)).max())
            if not rel < 0.02:
                return f"fused RMSNorm disagrees with the model's (max rel diff {rel:.3g})"
    except Exception as e:  # noqa: BLE001 - any failure: keep the model's own norms
        return f"fused RMSNorm failed its self-check: {type(e).__name__}: {str(e)[:300]}"
    for m in norms:
        m.forward = types.MethodType(_fused_norm_forward, m)
    return None


__all__ = [
    "FP8",
    "check_triton_attention",
    "dequantize_kv",
    "decode_attention_triton",
    "fp8_decode_launch",
    "fuse_norms",
    "quantize_kv",
    "rmsnorm_triton",
    "store_kv_fp8_triton",
    "triton_decode_supported",
    "triton_next_pow2",
]
