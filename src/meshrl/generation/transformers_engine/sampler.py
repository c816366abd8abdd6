"""Sampling of the transformers engine: temperature, top-k, top-p, with "processed" logprobs (of the distribution
actually sampled from; greedy reports the plain log-softmax, like the vLLM engine). The noise is a counter-based
hash of (request seed, step), so a seeded request is reproducible whatever else is in the batch, and no two samples
share noise; the draw is the inverse CDF at that one uniform, found in two levels (blocks of 128 tokens, then inside
the block) instead of a cumulative sum over the whole vocabulary."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

_NEG_INF = float("-inf")


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


__all__ = ["inverse_cdf", "sample", "uniform_noise", "uniform_noise_torch"]
