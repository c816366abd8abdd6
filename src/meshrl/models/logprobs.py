"""Per-token target logprobs from a causal LM, plain or chunked (linear + log-softmax fused chunk by chunk).

Why chunked: the plain path materialises `[B, T, V]` logits in the compute dtype, then a float32 copy, then the
float32 log-softmax (saved for backward) — for a 151k vocabulary at batch 8 x 2048 that is ~5 + 10 + 10 GB.
`chunked_linear_logprobs` computes `log p(target)` from the final hidden states `chunk_size` tokens at a time:
forward keeps only the per-token logsumexp (`[N]` float32) and backward recomputes each chunk's logits, so at
most one chunk of float32 logits exists at any time. The math per token is the same as the plain path
(logits in the weight dtype, upcast to float32, divided by the temperature, log-softmax), so the two agree to
float32 rounding. `keep_logits` trades memory for the recomputation: each chunk's compute-dtype logits (the
matmul's output, [N, V] in all: 5 GB in bf16 at 8 x 2048 x 151k, against the plain path's ~25 GB) are kept for
backward instead of recomputing the projection, a third of the head's FLOPs.

How it reaches the model: `LogprobHead` replaces the `forward` of the model's output projection (the instance
attribute, so parameter names and FSDP's hooks are untouched). While armed with the targets, the model's own
forward returns target logprobs instead of logits — computed inside the root module's forward, where FSDP has
the projection weight unsharded, so its gradient flows back through FSDP as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def target_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, suppress: torch.Tensor | None = None
) -> torch.Tensor:
    """log p(tokens[:, i+1] | tokens[:, :i+1]) in float32, shape [B, L-1] (the plain, full-logits path).
    `suppress`: `[V]`, added to the logits (-inf at tokens the model may not write, 0 elsewhere)."""
    logits = logits[:, :-1].float()
    if suppress is not None:
        logits = logits + suppress.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _project(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    """The projection in the weight dtype, as the plain path; written into `out` (a kept-logits slice) if given."""
    if out is None:
        return F.linear(h, weight, bias)
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


def _upcast(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def _fused_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """(target logprob, logsumexp) of one chunk from its compute-dtype logits; one pass when compiled."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    lse = torch.logsumexp(x, dim=-1)
    return x.gather(1, targets[:, None])[:, 0] - lse, lse


def _fused_backward(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g_out: torch.Tensor, t: float):
    """d(g_out · logprob)/d logits in the logits' dtype: (onehot - softmax) · g_out / t. The one-hot is a compare
    against a column index (not a scatter), so compiled it is one pass: read the logits, write the gradient."""
    x = logits.float()
    if t != 1.0:
        x = x / t
    columns = torch.arange(x.shape[1], device=x.device)
    onehot = (columns[None, :] == targets[:, None]).to(torch.float32)
    g = (onehot - torch.exp(x - lse[:, None])) * g_out[:, None]
    if t != 1.0:
        g = g / t
    return g.to(logits.dtype)


def _fused_backward_in_place(logits, lse, targets, g_out, t) -> None:
    """`_fused_backward` written over the (kept) logits themselves: compiled, the same single pass."""
    logits.copy_(_fused_backward(logits, lse, targets, g_out, t))


_FUSED = {"forward": _fused_forward, "backward": _fused_backward, "backward_in_place": _fused_backward_in_place}
_COMPILED: dict[tuple[str, bool], object] = {}


def _compiled(name: str, full: bool):
    """torch.compile'd `_fused_forward` / `_fused_backward[_in_place]` (made on first use): the upcast, logsumexp,
    softmax and gradient of a [chunk, V] block in one read of the compute-dtype logits instead of ~6 float32
    passes. Full chunks (`full`: chunk_size rows) get a static-shape compile; every last, shorter chunk one
    dynamic compile: its row count changes with each micro-batch, and static compiles of each hit dynamo's
    recompile limit (8) within a GRPO step, the later shapes then running eager."""
    key = (name, full)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_FUSED[name], dynamic=not full)
    return _COMPILED[key]


class _ChunkedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, out_shape, fused, keep_logits):  # noqa: D102
        n = hidden.shape[0]
        # Allocated in its final shape (not a view of a flat result): FSDP warns about views returned from a
        # root module's forward, since in-place ops on them would bypass its pre-backward hook.
        result = torch.empty(out_shape, dtype=torch.float32, device=hidden.device)
        out = result.view(-1)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        fused = fused and bias is None
        kept = torch.empty(n, weight.shape[0], dtype=weight.dtype, device=hidden.device) if keep_logits else None
        for s in range(0, n, chunk_size):
            rows = slice(s, s + chunk_size)
            logits = _project(hidden[rows], weight, bias, None if kept is None else kept[rows])
            if fused:
                out[s : s + chunk_size], lse[s : s + chunk_size] = _compiled("forward", logits.shape[0] == chunk_size)(
                    logits, targets[s : s + chunk_size], temperature
                )
            else:
                logits = _upcast(logits, temperature)
                lse_c = torch.logsumexp(logits, dim=-1)
                out[s : s + chunk_size] = logits.gather(1, targets[s : s + chunk_size, None])[:, 0] - lse_c
                lse[s : s + chunk_size] = lse_c
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse, kept)
        ctx.temperature, ctx.chunk_size, ctx.fused = temperature, chunk_size, fused
        return result

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        hidden, weight, bias, targets, lse, kept = ctx.saved_tensors
        t, c = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        grad_out = grad_out.reshape(-1).float()
        if kept is not None:
            # The gradient w.r.t. the logits overwrites the kept logits chunk by chunk; then two whole matmuls
            # (cuBLAS accumulates in float32 over all tokens) instead of two per chunk and a float32 running sum.
            for s in range(0, hidden.shape[0], c):
                rows = slice(s, s + c)
                if ctx.fused:
                    _compiled("backward_in_place", kept[rows].shape[0] == c)(
                        kept[rows], lse[rows], targets[rows], grad_out[rows], t
                    )
                else:
                    g = _logits_grad(kept[rows], lse[rows], targets[rows], grad_out[rows], t)
                    if grad_b is not None:
                        grad_b += g.sum(0)
                    kept[rows] = g.to(kept.dtype)
            grad_h = kept @ weight if need_h else None
            grad_w = kept.t() @ hidden if need_w else None
            return grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *[None] * 6
        grad_h = torch.empty_like(hidden) if need_h else None
        # Weight/bias gradients summed over chunks in float32 (one rounding to the weight dtype at the end).
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], c):
            rows = slice(s, s + c)
            h = hidden[rows]
            logits = _project(h, weight, bias, None)
            if ctx.fused:
                g = _compiled("backward", logits.shape[0] == c)(logits, lse[rows], targets[rows], grad_out[rows], t)
            else:
                g = _logits_grad(logits, lse[rows], targets[rows], grad_out[rows], t)
                if grad_b is not None:
                    grad_b += g.sum(0)
                g = g.to(weight.dtype)
            if grad_h is not None:
                grad_h[rows] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ h).float()
            del g
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            *[None] * 6,
        )


def _logits_grad(logits, lse, targets, g_out, t: float) -> torch.Tensor:
    """d log p(y) / d logits = onehot(y) - softmax, times g_out, over the temperature; float32, built in place."""
    g = _upcast(logits, t)
    if g.data_ptr() == logits.data_ptr():
        g = g.clone()  # float32 logits: the upcast is the same tensor
    g.sub_(lse[:, None]).exp_().mul_(-g_out[:, None])
    g.scatter_add_(1, targets[:, None], g_out[:, None])
    if t != 1.0:
        g.div_(t)
    return g


def chunked_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 2048,
    fused: bool = False,
    keep_logits: bool = False,
) -> torch.Tensor:
    """log softmax(hidden @ weight.T + bias)[target] in float32, `chunk_size` tokens at a time.

    hidden `[..., H]`, targets `[...]` (same leading shape); returns `[...]`. Differentiable in hidden, weight
    and bias; at most one chunk of float32 logits exists at a time, in forward and in backward. `fused`: the
    per-chunk elementwise math through torch.compile (no bias only; the matmuls stay cuBLAS). `keep_logits`:
    keep the weight-dtype logits of every chunk for backward instead of recomputing them (module docstring)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    lead = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).to(torch.long)
    return _ChunkedLinearLogprobs.apply(
        flat_h, weight, bias, flat_t, float(temperature), int(chunk_size), lead, bool(fused), bool(keep_logits)
    )


class LogprobHead:
    """Makes a model's output projection return target logprobs while armed (see the module docstring).

    Disarmed, the projection is the plain linear layer (logits), so `model(tokens).logits` still works."""

    def __init__(self, linear: nn.Module, chunk_size: int, *, fused: bool = False, keep_logits: bool = False) -> None:
        if not hasattr(linear, "weight"):
            raise TypeError(f"{type(linear).__name__} has no weight: not a linear output projection")
        self.linear, self.chunk_size, self.fused = linear, int(chunk_size), bool(fused)
        self.keep_logits = bool(keep_logits)
        self._targets: torch.Tensor | None = None
        self._temperature = 1.0
        self.suppress: torch.Tensor | None = None  # [V]: -inf at tokens the model may not write (a logit bias)
        plain = linear.forward

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            if self._targets is None:
                return plain(hidden)
            bias = getattr(linear, "bias", None)
            if self.suppress is not None:
                bias = self.suppress.to(linear.weight.dtype) if bias is None else bias + self.suppress.to(bias.dtype)
            # hidden [B, L, H] for every position; position i predicts targets[:, i] = tokens[:, i + 1].
            return chunked_linear_logprobs(
                hidden[:, :-1],
                linear.weight,
                bias,
                self._targets,
                temperature=self._temperature,
                chunk_size=self.chunk_size,
                fused=self.fused,
                keep_logits=self.keep_logits,
            )

        linear.forward = forward

    @contextlib.contextmanager
    def armed(self, tokens: torch.Tensor, temperature: float) -> Iterator[None]:
        self._targets, self._temperature = tokens[:, 1:], float(temperature)
        try:
            yield
        finally:
            self._targets, self._temperature = None, 1.0


__all__ = ["LogprobHead", "chunked_linear_logprobs", "target_logprobs"]
