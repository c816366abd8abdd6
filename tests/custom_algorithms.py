"""A user-written loss and aggregation, as a user would put them in their own module. The trainer processes import
this module by name ('custom_algorithms:...'); tests/conftest.py puts tests/ on their PYTHONPATH."""

from __future__ import annotations

import torch

from meshrl.losses import LossBatch, register_aggregation, register_loss


@register_loss("scaled_reinforce")
def scaled_reinforce(
    logprobs: torch.Tensor, batch: LossBatch, *, scale: float = 1.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-scale · A · logp per token, and one metric."""
    adv = batch.advantages[:, None].to(logprobs.dtype)
    return -scale * adv * logprobs, {"adv_tokens": (adv.abs() * batch.mask).sum()}


def _sqrt_len_reduce(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's token sum divided by sqrt(its length): additive over sequences, so micro-batches add up."""
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1).sqrt()).sum()


seq_sqrt = register_aggregation(
    "seq_sqrt", _sqrt_len_reduce, lambda data: float(sum(1 for d in data if d.num_loss_tokens > 0))
)


@register_loss("needs_ref", needs_reference=True)
def needs_ref(logprobs: torch.Tensor, batch: LossBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pulls the policy towards the reference model: (logp - logp_ref)^2 / 2."""
    return 0.5 * (logprobs - batch.ref_logprobs).square(), {}


@register_loss("slow_grpo")
def slow_grpo(
    logprobs: torch.Tensor, batch: LossBatch, *, clip_low: float = 0.2, clip_high: float = 0.2
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's loss, slowly (a trainer much slower than the generator): same values, 0.3 s later."""
    import time

    from meshrl.losses import LOSSES

    time.sleep(0.3)
    return LOSSES["grpo"].fn(logprobs, batch, clip_low=clip_low, clip_high=clip_high)


@register_loss("fails_on_rank_1")
def fails_on_rank_1(logprobs: torch.Tensor, batch: LossBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loss with a bug that shows on one trainer rank only (it raises on rank 1): rank 0 goes on into backward and
    waits there for rank 1 in FSDP's reduce-scatter."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("this loss fails on trainer rank 1")
    return -batch.advantages[:, None].to(logprobs.dtype) * logprobs, {}
