"""The parts of an RL algorithm that run in the controller, between scoring and `forward_backward`: reward
shaping (DAPO's soft overlong punishment, KL as a reward penalty), the dynamic-sampling filter, and the step's
`LossSpec` (loss, aggregation with its GLOBAL normaliser, KL term, TIS) from a `GRPOConfig`.

Which flags make which algorithm (README, "Algorithms"):

=========  ==============================================================================================
GRPO       --grpo.loss grpo --grpo.advantage group_mean_std        (defaults; token_mean aggregation)
DAPO       --grpo.clip-high 0.28 --grpo.dynamic-sampling --grpo.overlong-buffer N  (token_mean)
Dr.GRPO    --grpo.advantage group_mean --grpo.aggregation token_sum_norm
GSPO       --grpo.loss gspo                                         (seq_mean_token_mean, clip 3e-4/4e-4)
CISPO      --grpo.loss cispo                                        (token_mean, IS weight capped at 5)
=========  ==============================================================================================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshrl.losses import get_aggregation, kl_estimate, make_loss_spec
from meshrl.types import Datum, LossSpec


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `penalty`: 0 up to
    max_tokens - buffer tokens, then falling linearly to -penalty at max_tokens (and below -penalty past it)."""
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min((length - start) / buffer, 1.0)


def informative_groups(rewards: Sequence[float], group_size: int) -> list[int]:
    """Indices of the groups whose rewards are not all equal (an all-equal group has zero advantage everywhere:
    no learning signal, only dilution). DAPO's dynamic-sampling filter."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return [i for i, g in enumerate(groups) if max(g) != min(g)]


def kl_penalties(data: Sequence[Datum], estimator: str = "k1") -> list[float]:
    """Per sequence: the sum over its loss tokens of the KL estimator between the sampling policy (the
    generator's logprobs) and the reference model. Used for KL as reward shaping: r - kl_coef * this."""
    out = []
    for d in data:
        if d.old_logprobs is None or d.ref_logprobs is None:
            raise ValueError("KL reward shaping needs old_logprobs (generator) and ref_logprobs on every Datum")
        mask = torch.tensor(d.loss_mask, dtype=torch.float64)
        kl = kl_estimate(
            torch.tensor(d.old_logprobs, dtype=torch.float64),
            torch.tensor(d.ref_logprobs, dtype=torch.float64),
            estimator,
        )
        out.append(float((kl * mask).sum()))
    return out


def step_loss_spec(cfg, data: Sequence[Datum], *, temperature: float, max_tokens: int) -> LossSpec:
    """The LossSpec of one optimiser step of `meshrl.controller.grpo` (cfg: a GRPOConfig), its normaliser computed
    over all of the step's `data`. A constant-normaliser aggregation (token_sum_norm, Dr.GRPO) divides by
    prompts_per_step × group_size × max_tokens: the step's generation budget, the same every step."""
    aggregation, params = cfg.resolved_loss()
    constant = cfg.global_batch_size * max_tokens if get_aggregation(aggregation).normalizer is None else None
    return make_loss_spec(
        cfg.loss,
        data,
        aggregation=aggregation,
        constant=constant,
        params=params,
        temperature=temperature,
        kl_coef=cfg.kl_coef if cfg.kl_mode == "loss" else 0.0,
        kl_estimator=cfg.kl_estimator,
        tis_cap=cfg.tis_cap,
    )
