"""GRPO's section (`--grpo.*`): the RL loop's sizes and the algorithm (loss, aggregation, advantages, clip range,
KL, DAPO's dynamic sampling and overlong penalty, TIS), whose combinations `check_algorithm` refuses at launch.
`meshrl.algorithms` turns it into a step's `LossSpec`; kept apart from algorithms.py so that reading a command line
never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from meshrl.errors import ConfigError


@dataclass
class GRPOConfig:
    steps: int = 40
    """RL steps (one optimiser step each)."""
    prompts_per_step: int = 16
    """Prompts drawn per RL step (each sampled group_size times)."""
    group_size: int = 8
    """Completions sampled per prompt; advantages are relative to the group."""
    max_staleness: int = 0
    """Asynchronous RL: generation runs up to this many policy versions ahead of training (K). 0: the synchronous
    loop (generate, train, sync). 1: the next step's groups are sampled while this step trains (one-step
    off-policy); the loss uses the sampling logprobs as the old policy. Groups older than K versions are dropped
    and counted."""
    # ---- the algorithm (README "Algorithms": the flags of GRPO, DAPO, Dr.GRPO, GSPO, CISPO) ----
    loss: str = "grpo"
    """Policy loss: 'grpo' (PPO clipped ratio; DAPO's clip-higher is clip_high > clip_low), 'gspo' (sequence-level
    length-normalised ratio), 'cispo' (clipped stop-gradient IS weight on logp), 'importance_sampling', 'reinforce',
    or a loss registered with meshrl.losses.register_loss ('package.module:name' is imported first)."""
    aggregation: str | None = None
    """Per-token losses -> step loss, normalised over the whole step: 'token_mean' (DAPO, CISPO),
    'seq_mean_token_mean' (GRPO paper, GSPO), 'seq_mean_token_sum', 'token_sum_norm' (Dr.GRPO: divided by the
    constant prompts_per_step x group_size x generator.max_tokens), or a registered one. None: the loss's own
    ('seq_mean_token_mean' for gspo, else 'token_mean')."""
    clip_low: float | None = None
    """Lower ratio clip: the ratio is clipped to [1 - clip_low, 1 + clip_high]. None: the loss's default."""
    clip_high: float | None = None
    """Ratio clip range [1 - clip_low, 1 + clip_high]. None: the loss's default (grpo 0.2 / 0.2, DAPO uses
    clip_high 0.28; gspo 3e-4 / 4e-4; cispo no lower bound / 4.0)."""
    advantage: Literal["group_mean_std", "group_mean", "rloo", "reinforce_pp"] = "group_mean_std"
    """Advantage estimator: group mean/std (GRPO), group mean only (Dr.GRPO), leave-one-out (RLOO), group mean
    then batch-normalised (REINFORCE++ baseline)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no signal) and refill the batch with new prompts."""
    max_sampling_rounds: int = 4
    """With dynamic_sampling: at most this many generation rounds per step (each draws prompts_per_step new
    prompts); if the batch is still short the step trains on the informative groups found."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: a completion longer than generator.max_tokens - overlong_buffer loses reward
    linearly, up to overlong_penalty at max_tokens. 0: off."""
    overlong_penalty: float = 1.0
    """Largest DAPO overlong penalty (reached at generator.max_tokens)."""
    kl_coef: float = 0.0
    """Weight of KL(policy || reference). > 0 starts the ReferenceModel (frozen copy of the policy after warm-up)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman's k1 = log ratio, k2 = half squared log ratio, k3 = unbiased, >= 0)."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """'loss': kl_coef x per-token KL added to the loss; 'reward': kl_coef x the sequence's summed KL subtracted
    from its reward before advantages."""
    reference_procs: int = 1
    """Processes of the ReferenceModel mesh (FSDP-sharded, forward only)."""
    tis_cap: float | None = None
    """Truncated importance sampling between trainer and generator logprobs: every token's loss is weighted by
    min(p_trainer / p_generator, tis_cap), e.g. 2.0. None: off."""
    loss_params: dict[str, float] = field(default_factory=dict)
    """Extra keyword parameters of the loss (for user-registered losses)."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"grpo.steps={self.steps} must be >= 0")
        if self.prompts_per_step < 1:
            raise ConfigError(f"grpo.prompts_per_step={self.prompts_per_step} must be >= 1")
        if self.group_size < 2:
            raise ConfigError(
                f"grpo.group_size={self.group_size}: group-relative advantages need at least 2 completions per prompt"
            )
        check_algorithm(self)

    @property
    def global_batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def needs_reference(self) -> bool:
        from meshrl.losses import loss_info

        return self.kl_coef > 0 or loss_info(self.loss).needs_reference

    def resolved_loss(self) -> tuple[str, dict]:
        """(aggregation, loss params) with the loss's defaults filled in."""
        from meshrl.losses import loss_info

        info = loss_info(self.loss)
        aggregation = self.aggregation or (info.aggregations[0] if info.aggregations else "token_mean")
        params = {k: v for k, v in (("clip_low", self.clip_low), ("clip_high", self.clip_high)) if v is not None}
        return aggregation, {**params, **self.loss_params}


def check_algorithm(c: GRPOConfig) -> None:
    """Combinations of loss / aggregation / clip range / KL / TIS that cannot work, refused at launch."""
    from meshrl.losses import get_aggregation, loss_info

    try:
        info = loss_info(c.loss)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"grpo.loss: {e}") from None
    aggregation, params = c.resolved_loss()
    try:
        get_aggregation(aggregation)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"grpo.aggregation: {e}") from None
    if info.aggregations is not None and aggregation not in info.aggregations:
        raise ConfigError(
            f"grpo.loss={c.loss!r} cannot use grpo.aggregation={aggregation!r} (its per-sequence loss would be "
            f"re-weighted by length); use --grpo.aggregation {info.aggregations[0]}"
        )
    unknown = sorted(set(params) - set(info.params))
    if unknown:
        clip = [k for k in unknown if k.startswith("clip_")]
        hint = f"remove --grpo.{clip[0].replace('_', '-')}" if clip else "fix grpo.loss_params"
        raise ConfigError(
            f"grpo.loss={c.loss!r} takes no parameter(s) {unknown} (it takes {sorted(info.params) or 'none'}); {hint}"
        )
    lo = params.get("clip_low", info.params.get("clip_low"))
    hi = params.get("clip_high", info.params.get("clip_high"))
    if lo is not None and not 0 <= lo < 1:
        raise ConfigError(f"grpo.clip_low={lo} must be in [0, 1): the ratio's lower bound is 1 - clip_low > 0")
    if hi is not None and not hi >= 0:
        raise ConfigError(f"grpo.clip_high={hi} must be >= 0: the ratio's upper bound is 1 + clip_high")
    if lo is not None and hi is not None and not 1 - lo < 1 + hi:
        raise ConfigError(
            f"grpo.clip_low={lo}, grpo.clip_high={hi}: the clip range [{1 - lo:g}, {1 + hi:g}] is empty or out of "
            "order; make clip_low + clip_high > 0 (e.g. --grpo.clip-low 0.2 --grpo.clip-high 0.28)"
        )
    if info.needs_reference and c.kl_coef <= 0:
        raise ConfigError(
            f"grpo.loss={c.loss!r} needs reference-model logprobs, and the reference model runs only when "
            "grpo.kl_coef > 0; set --grpo.kl-coef (e.g. 0.01)"
        )
    if c.kl_coef < 0:
        raise ConfigError(f"grpo.kl_coef={c.kl_coef} must be >= 0 (0: no reference model, no KL)")
    if c.reference_procs < 1:
        raise ConfigError(f"grpo.reference_procs={c.reference_procs} must be >= 1")
    # Flags that only act through another one: a value other than the default, with the flag that enables it off,
    # would be silently ignored (the user believes a KL term or a sampling budget is in the run when it is not).
    defaults = GRPOConfig.__dataclass_fields__
    kl_off = ("grpo.kl_coef is 0 (no KL term, no reference model)", "--grpo.kl-coef (e.g. 0.01)")
    for name, enabled, (why_off, enable) in (
        ("kl_estimator", c.kl_coef > 0, kl_off),
        ("kl_mode", c.kl_coef > 0, kl_off),
        ("reference_procs", c.kl_coef > 0, kl_off),
        ("max_sampling_rounds", c.dynamic_sampling, ("grpo.dynamic_sampling is off", "--grpo.dynamic-sampling")),
        ("overlong_penalty", c.overlong_buffer > 0, ("grpo.overlong_buffer is 0", "--grpo.overlong-buffer (e.g. 4)")),
    ):
        value = getattr(c, name)
        if not enabled and value != defaults[name].default:
            flag = "--grpo." + name.replace("_", "-")
            raise ConfigError(f"{flag} {value} has no effect: {why_off}; set {enable} as well, or drop {flag}")
    if c.tis_cap is not None and not c.tis_cap >= 1:
        raise ConfigError(
            f"grpo.tis_cap={c.tis_cap} must be >= 1: it caps the trainer/generator importance weight from above "
            "(typical: 2.0); leave it unset to turn TIS off"
        )
    if c.max_sampling_rounds < 1:
        raise ConfigError(f"grpo.max_sampling_rounds={c.max_sampling_rounds} must be >= 1")
    if c.overlong_buffer < 0 or c.overlong_penalty < 0:
        raise ConfigError(
            f"grpo.overlong_buffer={c.overlong_buffer} and grpo.overlong_penalty={c.overlong_penalty} must be >= 0"
        )
