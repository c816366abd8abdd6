"""Policy losses, loss aggregation, KL estimators and the truncated importance-sampling correction.

The contract (what `PolicyTrainer.forward_backward` runs, through `compute_loss`):

* A **loss** is `fn(logprobs [B, T] (with grad), batch: LossBatch, **params) -> (per_token [B, T], metric_sums)`.
  `per_token[i, t]` is the loss of target token t of sequence i; masking and normalising happen afterwards,
  in one place. Sequence-level losses (GSPO) see whole rows (a micro-batch never splits a sequence) and
  broadcast their per-sequence value over the row's tokens. Register your own with `@register_loss("name")`.
* An **aggregation** reduces the masked per-token matrix of one micro-batch to a scalar *numerator* that is
  additive over sequences; the trainer divides it by `LossSpec.normalizer`, a GLOBAL denominator that the
  controller computes over the whole optimiser step (all micro-batches, all data-parallel ranks) with
  `step_normalizer`. So k `forward_backward` calls and one `optim_step` equal one big batch for every mode:

  ===================== ==================================== ===============================================
  aggregation           numerator of a micro-batch           normaliser of the step
  ===================== ==================================== ===============================================
  token_mean            sum_i sum_t l·m                      loss tokens of the step   (DAPO, CISPO)
  seq_mean_token_mean   sum_i (sum_t l·m) / (sum_t m)        sequences of the step     (GRPO paper, GSPO)
  seq_mean_token_sum    sum_i sum_t l·m                      sequences of the step
  token_sum_norm        sum_i sum_t l·m                      a constant, e.g. sequences × max_tokens (Dr.GRPO)
  ===================== ==================================== ===============================================

  Register your own with `register_aggregation(name, reduce, normalizer)`.
* `LossSpec.tis_cap` turns on truncated importance sampling (TIS) between the trainer and the generator: the
  policy ratio is taken against the trainer's own (detached) logprobs, and every token's loss is multiplied
  by `min(exp(logp_trainer - logp_generator), tis_cap)` (no gradient through the weight). This is exact for one
  optimiser step per generated batch, which is what `meshrl.controller.grpo` does.
* `LossSpec.kl_coef > 0` adds `kl_coef · KL_estimator(logp, logp_ref)` per token (k1, k2 or k3; needs
  `Datum.ref_logprobs` from the reference model). KL as reward shaping happens in the controller instead
  (`meshrl.algorithms.kl_shaped_rewards`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from meshrl.types import Datum, LossSpec


@dataclass
class LossBatch:
    mask: torch.Tensor  # [B, T] float weights, 0 on prompt / padding
    old_logprobs: torch.Tensor  # [B, T] generator's logprobs of the targets (0 where mask is 0)
    advantages: torch.Tensor  # [B]
    ref_logprobs: torch.Tensor | None = None  # [B, T] reference model's logprobs (KL), when given


LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


# ---- registries ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossInfo:
    name: str
    fn: LossFn
    aggregations: tuple[str, ...] | None  # the aggregation modes this loss is meant for; None: any
    needs_reference: bool  # reads LossBatch.ref_logprobs
    params: dict[str, Any]  # keyword parameters and their defaults (from the signature)


@dataclass(frozen=True)
class Aggregation:
    name: str
    reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (per_token [B,T], mask [B,T]) -> numerator
    normalizer: Callable[[Sequence[Datum]], float] | None  # global denominator of a step; None: a constant


LOSSES: dict[str, LossInfo] = {}
AGGREGATIONS: dict[str, Aggregation] = {}


def register_loss(
    name: str, *, aggregations: Sequence[str] | None = None, needs_reference: bool = False
) -> Callable[[LossFn], LossFn]:
    """Register `fn(logprobs, batch, **params) -> (per_token [B, T], metric_sums)` under `name`.
    `aggregations`: the modes it can be used with (config validation refuses others); `needs_reference`: it
    reads `batch.ref_logprobs`, so the controller must run the reference model."""

    def deco(fn: LossFn) -> LossFn:
        params = {
            p.name: p.default
            for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }
        aggs = tuple(aggregations) if aggregations is not None else None
        LOSSES[name] = LossInfo(name, fn, aggs, needs_reference, params)
        return fn

    return deco


def register_aggregation(
    name: str,
    reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    normalizer: Callable[[Sequence[Datum]], float] | None,
) -> Aggregation:
    """`reduce(per_token, mask)` must be a sum over sequences of per-sequence terms (so that micro-batches add up);
    `normalizer(data)` computes the global denominator from all the data of one optimiser step (None: the caller
    passes a constant)."""
    AGGREGATIONS[name] = Aggregation(name, reduce, normalizer)
    return AGGREGATIONS[name]


def _resolve(name: str, registry: dict, what: str):
    """A registered name, or 'package.module:name' — the module is imported (registering what it defines) so a
    user-written loss reaches the trainer processes by name."""
    if name not in registry and ":" in name:
        module, _, attr = name.partition(":")
        mod = importlib.import_module(module)
        if name not in registry and attr in registry:
            registry[name] = registry[attr]
        elif name not in registry and isinstance(getattr(mod, attr, None), Aggregation):
            registry[name] = getattr(mod, attr)
        elif name not in registry and what == "loss" and callable(getattr(mod, attr, None)):
            register_loss(name)(getattr(mod, attr))
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; registered: {sorted(registry)} (or use 'package.module:name')")
    return registry[name]


def loss_info(name: str) -> LossInfo:
    return _resolve(name, LOSSES, "loss")


def get_loss(name: str) -> LossFn:
    return loss_info(name).fn


def get_aggregation(name: str) -> Aggregation:
    return _resolve(name, AGGREGATIONS, "aggregation")


# ---- aggregation --------------------------------------------------------------------------------------------
def _sum(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (per_token * mask).sum()


def _seq_token_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1e-8)
    return per_seq.sum()


def _num_tokens(data: Sequence[Datum]) -> float:
    return float(sum(d.num_loss_tokens for d in data))


def _num_seqs(data: Sequence[Datum]) -> float:
    return float(sum(1 for d in data if d.num_loss_tokens > 0))


register_aggregation("token_mean", _sum, _num_tokens)
register_aggregation("seq_mean_token_mean", _seq_token_mean, _num_seqs)
register_aggregation("seq_mean_token_sum", _sum, _num_seqs)
register_aggregation("token_sum_norm", _sum, None)


def step_normalizer(aggregation: str, data: Sequence[Datum], constant: float | None = None) -> float:
    """The global denominator of one optimiser step over ALL its data (every micro-batch and rank)."""
    agg = get_aggregation(aggregation)
    if constant is not None:
        return float(constant)
    if agg.normalizer is None:
        raise ValueError(f"aggregation {aggregation!r} divides by a constant: pass constant=")
    return max(agg.normalizer(data), 1.0)


def make_loss_spec(
    name: str,
    data: Sequence[Datum],
    *,
    aggregation: str = "token_mean",
    constant: float | None = None,
    params: dict | None = None,
    **fields: Any,
) -> LossSpec:
    """A LossSpec whose global normaliser is computed over `data`, all the sequences of one optimiser step."""
    return LossSpec(
        name,
        num_loss_tokens=max(int(_num_tokens(data)), 1),
        params=dict(params or {}),
        aggregation=aggregation,
        normalizer=step_normalizer(aggregation, data, constant),
        **fields,
    )


# ---- KL -----------------------------------------------------------------------------------------------------
KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimators of KL(π || π_ref) from samples of π (Schulman, "Approximating KL divergence"),
    with log_ratio = log π − log π_ref: k1 = log_ratio, k2 = log_ratio² / 2, k3 = exp(−log_ratio) − 1 + log_ratio."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {KL_ESTIMATORS}")


# ---- the path forward_backward takes ------------------------------------------------------------------------
def check_loss_spec(spec: LossSpec, data: Sequence[Datum]) -> LossInfo:
    """Everything about the call that can be refused before any collective (every rank sees the same data)."""
    info = loss_info(spec.name)
    get_aggregation(spec.aggregation)
    if info.aggregations is not None and spec.aggregation not in info.aggregations:
        raise ValueError(
            f"loss {spec.name!r} cannot use aggregation {spec.aggregation!r}; use one of {list(info.aggregations)}"
        )
    unknown = set(spec.params) - set(info.params)
    if unknown and not any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(info.fn).parameters.values()
    ):
        raise ValueError(f"loss {spec.name!r} has no parameter(s) {sorted(unknown)}; it takes {sorted(info.params)}")
    if (info.needs_reference or spec.kl_coef > 0) and any(d.ref_logprobs is None for d in data):
        raise ValueError(
            f"loss {spec.name!r} with kl_coef={spec.kl_coef} needs Datum.ref_logprobs on every datum "
            "(the reference model's logprobs; see Controller.reference_logprobs)"
        )
    return info


def compute_loss(
    logprobs: torch.Tensor, batch: LossBatch, spec: LossSpec
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step loss (already divided by the global normaliser), and metric sums
    over its loss tokens."""
    info = loss_info(spec.name)
    tokens = (batch.mask > 0).to(logprobs.dtype)
    loss_batch, weight, metrics = batch, None, {}
    if spec.tis_cap is not None:
        proximal = logprobs.detach()
        raw = torch.exp((proximal - batch.old_logprobs) * tokens)
        weight = raw.clamp(max=spec.tis_cap)
        loss_batch = replace(batch, old_logprobs=proximal)
    per_token, loss_metrics = info.fn(logprobs, loss_batch, **spec.params)
    metrics.update(loss_metrics)
    if per_token.dim() == 0:  # a loss that aggregates itself: a masked sum over its tokens
        if spec.aggregation not in ("token_mean", "token_sum_norm") or weight is not None or spec.kl_coef:
            raise ValueError(
                f"loss {spec.name!r} returned a scalar; return the per-token loss [B, T] to use aggregation "
                f"{spec.aggregation!r}, tis_cap or kl_coef"
            )
        return per_token / spec.denominator, metrics
    if weight is not None:
        per_token = per_token * weight
        with torch.no_grad():
            metrics["tis_weight"] = (weight * batch.mask).sum()
            metrics["tis_truncated"] = ((raw > spec.tis_cap).to(batch.mask.dtype) * batch.mask).sum()
    if batch.ref_logprobs is not None:
        kl = kl_estimate(logprobs, batch.ref_logprobs, spec.kl_estimator) * tokens
        if spec.kl_coef > 0:
            per_token = per_token + spec.kl_coef * kl
        metrics["kl"] = (kl.detach() * batch.mask).sum()
    per_token = torch.where(tokens > 0, per_token, torch.zeros_like(per_token))
    numerator = get_aggregation(spec.aggregation).reduce(per_token, batch.mask)
    return numerator / spec.denominator, metrics


# ---- policy losses ------------------------------------------------------------------------------------------
def _ratio_terms(logprobs: torch.Tensor, batch: LossBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = (batch.mask > 0).to(logprobs.dtype)
    log_ratio = (logprobs - batch.old_logprobs) * tokens
    return log_ratio, torch.exp(log_ratio), batch.advantages[:, None].to(logprobs.dtype)


def _clipped_surrogate(ratio, adv, clip_low, clip_high):
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


@register_loss("grpo")
def grpo_loss(
    logprobs: torch.Tensor, batch: LossBatch, *, clip_low: float = 0.2, clip_high: float = 0.2
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-style clipped importance-ratio policy gradient against the generator's logprobs, per token:
    -min(r·A, clip(r, 1-clip_low, 1+clip_high)·A) with r = exp(logp - logp_old). DAPO's clip-higher is
    clip_high > clip_low."""
    mask = batch.mask
    log_ratio, ratio, adv = _ratio_terms(logprobs, batch)
    per_token, is_clipped = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    with torch.no_grad():
        metrics = {
            "clip_frac": (is_clipped.to(mask.dtype) * mask).sum(),
            "ratio": (ratio * mask).sum(),
            # k3 estimator of KL(generator || trainer), a cheap drift monitor.
            "kl_k3": ((torch.exp(-log_ratio) - 1 + log_ratio) * mask).sum(),
        }
    return per_token, metrics


@register_loss("gspo", aggregations=("seq_mean_token_mean",))
def gspo_loss(
    logprobs: torch.Tensor, batch: LossBatch, *, clip_low: float = 3e-4, clip_high: float = 4e-4
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, length-normalised,
    s_i = exp(mean_t(logp - logp_old)), clipped like PPO: -min(s·A, clip(s, 1-clip_low, 1+clip_high)·A), the
    same value on every token of the sequence (so `seq_mean_token_mean` gives the paper's sequence mean)."""
    mask = batch.mask
    tokens = (mask > 0).to(logprobs.dtype)
    n = tokens.sum(-1, keepdim=True).clamp(min=1)
    seq_ratio = torch.exp(((logprobs - batch.old_logprobs) * tokens).sum(-1, keepdim=True) / n)
    adv = batch.advantages[:, None].to(logprobs.dtype)
    per_seq, is_clipped = _clipped_surrogate(seq_ratio, adv, clip_low, clip_high)
    with torch.no_grad():
        metrics = {
            "clip_frac": (is_clipped.to(mask.dtype) * mask).sum(),
            "ratio": (seq_ratio * mask).sum(),
        }
    return per_seq.expand_as(logprobs), metrics


@register_loss("cispo")
def cispo_loss(
    logprobs: torch.Tensor, batch: LossBatch, *, clip_low: float | None = None, clip_high: float = 4.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight, per token:
    -sg(clip(r, 1-clip_low, 1+clip_high))·A·logp. Every token keeps its gradient (nothing is clipped away);
    clip_low None: no lower bound (as in the paper)."""
    mask = batch.mask
    _, ratio, adv = _ratio_terms(logprobs, batch)
    lo = None if clip_low is None else 1 - clip_low
    weight = torch.clamp(ratio, min=lo, max=1 + clip_high).detach()
    with torch.no_grad():
        metrics = {
            "clip_frac": ((weight != ratio).to(mask.dtype) * mask).sum(),
            "ratio": (ratio * mask).sum(),
        }
    return -weight * adv * logprobs, metrics


@register_loss("importance_sampling")
def importance_sampling_loss(logprobs: torch.Tensor, batch: LossBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain (unclipped) importance-sampled policy gradient, per token: -r·A with r = exp(logp - logp_old)."""
    _, ratio, adv = _ratio_terms(logprobs, batch)
    return -ratio * adv, {"ratio": (ratio.detach() * batch.mask).sum()}


@register_loss("reinforce")
def reinforce_loss(logprobs: torch.Tensor, batch: LossBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE, per token: -A·logp (on-policy; the generator's logprobs are not used)."""
    return -batch.advantages[:, None].to(logprobs.dtype) * logprobs, {}


@register_loss("cross_entropy")
def cross_entropy_loss(logprobs: torch.Tensor, batch: LossBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised negative log-likelihood of the (masked) target tokens."""
    return -logprobs, {"nll": (-logprobs.detach() * batch.mask).sum()}
