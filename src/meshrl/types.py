"""Plain data exchanged between the controller and the actors.

Everything here is a dataclass of Python lists / tensors so it pickles cheaply across Monarch messages and
can be inspected in a debugger without any actor machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How a Generator samples. `n` completions are drawn per prompt."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or >= 1")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")


@dataclass
class Completion:
    """One sampled continuation of one prompt, token-in / token-out (no re-tokenisation)."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log p(token_ids[i] | prefix) under the sampling distribution
    finish_reason: str  # "stop" (EOS / stop token) or "length" (hit max_tokens)
    policy_version: int  # version of the weights that produced every token of this completion


@dataclass
class Datum:
    """One training sequence. Per-token fields are aligned with the *targets* `tokens[1:]`, i.e. they have
    `len(tokens) - 1` entries: entry i is about predicting tokens[i + 1] from tokens[: i + 1]."""

    tokens: list[int]
    loss_mask: list[float]  # weight of each target token in the loss (0 for prompt and padding)
    old_logprobs: list[float] | None = None  # generator's logprobs of the targets (0 where the mask is 0)
    advantage: float = 0.0
    ref_logprobs: list[float] | None = None  # reference model's logprobs of the targets (for a KL term)
    positions: list[int] | None = None  # per token (len(tokens)); restarts at 0 per packed document

    def __post_init__(self) -> None:
        n = len(self.tokens) - 1
        if n < 1:
            raise ValueError(f"a Datum needs at least 2 tokens, got {len(self.tokens)}")
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries; expected len(tokens) - 1 = {n}")
        if self.old_logprobs is not None and len(self.old_logprobs) != n:
            raise ValueError(f"old_logprobs has {len(self.old_logprobs)} entries; expected len(tokens) - 1 = {n}")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"ref_logprobs has {len(self.ref_logprobs)} entries; expected len(tokens) - 1 = {n}")
        if self.positions is not None and (len(self.positions) != n + 1 or self.positions[0] != 0):
            raise ValueError(f"positions must have len(tokens) = {n + 1} entries and start at 0")

    @classmethod
    def from_completion(
        cls,
        prompt_ids: list[int],
        response_ids: list[int],
        logprobs: list[float] | None = None,
        advantage: float = 0.0,
    ) -> Datum:
        """Prompt + response, with the loss on the response tokens only."""
        if not response_ids:
            raise ValueError("empty response: nothing to train on")
        n_prompt = len(prompt_ids)
        mask = [0.0] * (n_prompt - 1) + [1.0] * len(response_ids)
        old = None if logprobs is None else [0.0] * (n_prompt - 1) + list(logprobs)
        return cls(list(prompt_ids) + list(response_ids), mask, old, advantage)

    @property
    def num_loss_tokens(self) -> int:
        return sum(1 for m in self.loss_mask if m > 0)


@dataclass
class LossSpec:
    """Which loss `forward_backward` applies, how its per-token matrix is aggregated, and the GLOBAL normaliser
    that makes k micro-batch calls plus one `optim_step` equal one big batch: every call's aggregated loss is
    divided by `normalizer`, computed by the controller over the whole optimiser step (all ranks and
    micro-batches; `meshrl.losses.make_loss_spec` / `step_normalizer`). Without `normalizer`, the divisor is
    `num_loss_tokens`, the step's loss-token count (right for aggregation "token_mean")."""

    name: str = "grpo"
    num_loss_tokens: int = 1
    params: dict = field(default_factory=dict)  # loss-specific (e.g. clip_low, clip_high)
    temperature: float = 1.0  # sampling temperature; the trainer's logits are divided by it
    aggregation: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum | token_sum_norm | custom
    normalizer: float | None = None  # the step's global denominator for `aggregation`; None: num_loss_tokens
    kl_coef: float = 0.0  # > 0: add kl_coef * KL(policy || reference) per token (needs Datum.ref_logprobs)
    kl_estimator: str = "k3"  # k1 | k2 | k3
    tis_cap: float | None = None  # truncated importance sampling trainer/generator; weights capped at this

    def __post_init__(self) -> None:
        if self.num_loss_tokens < 1:
            raise ValueError(f"num_loss_tokens={self.num_loss_tokens} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        if self.normalizer is None and self.aggregation != "token_mean":
            raise ValueError(
                f"aggregation {self.aggregation!r} needs an explicit global normalizer (see "
                "meshrl.losses.make_loss_spec); only 'token_mean' defaults to num_loss_tokens"
            )
        if self.normalizer is not None and not self.normalizer > 0:
            raise ValueError(f"normalizer={self.normalizer} must be > 0")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef} must be >= 0")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_estimator={self.kl_estimator!r}; use 'k1', 'k2' or 'k3'")
        if self.tis_cap is not None and not self.tis_cap >= 1:
            raise ValueError(f"tis_cap={self.tis_cap} must be >= 1 (it caps importance weights from above)")

    @property
    def denominator(self) -> float:
        return float(self.normalizer if self.normalizer is not None else self.num_loss_tokens)


@dataclass
class ForwardBackwardResult:
    logprobs: list[list[float]]  # per datum, per target token (trainer's, before this call's update)
    loss: float  # this call's contribution to the step loss (already divided by the global normaliser)
    metrics: dict[str, float]  # sums over this call's loss tokens (divide by the step's loss tokens for means)
    num_tokens: int  # loss tokens in this call
    optim: OptimResult | None = None  # the step's result, when this call carried one (forward_backward's step)


@dataclass
class OptimParams:
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0: no clipping (the norm is still reported)
    # When set, the step is taken only if exactly this many forward_backward calls succeeded since the last
    # step; otherwise it is refused and the gradients discarded. A controller can then queue optim_step behind
    # its forward_backward calls without waiting for their results (the trainer never idles for the round trip)
    # and still never steps on a partial batch when one of them failed.
    num_micro_batches: int | None = None

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"lr={self.lr} must be >= 0")
        if self.num_micro_batches is not None and self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches={self.num_micro_batches} must be >= 1 (or None: not checked)")


@dataclass
class OptimResult:
    grad_norm: float
    lr: float
    policy_version: int
