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

    def __post_init__(self) -> None:
        n = len(self.tokens) - 1
        if n < 1:
            raise ValueError(f"a Datum needs at least 2 tokens, got {len(self.tokens)}")
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries; expected len(tokens) - 1 = {n}")
        if self.old_logprobs is not None and len(self.old_logprobs) != n:
            raise ValueError(f"old_logprobs has {len(self.old_logprobs)} entries; expected len(tokens) - 1 = {n}")

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
    """Which loss `forward_backward` applies, and the global normaliser that makes k micro-batch calls plus one
    `optim_step` equal one big batch: the loss of every call is divided by `num_loss_tokens`, the number of
    loss tokens in the whole optimiser step over all ranks and micro-batches."""

    name: str = "grpo"
    num_loss_tokens: int = 1
    params: dict = field(default_factory=dict)  # loss-specific (e.g. clip_low, clip_high)
    temperature: float = 1.0  # sampling temperature; the trainer's logits are divided by it

    def __post_init__(self) -> None:
        if self.num_loss_tokens < 1:
            raise ValueError(f"num_loss_tokens={self.num_loss_tokens} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")


@dataclass
class ForwardBackwardResult:
    logprobs: list[list[float]]  # per datum, per target token (trainer's, before this call's update)
    loss: float  # this call's contribution to the step loss (already divided by num_loss_tokens)
    metrics: dict[str, float]  # sums over this call's loss tokens (divide by num_loss_tokens for means)
    num_tokens: int  # loss tokens in this call


@dataclass
class OptimParams:
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0: no clipping (the norm is still reported)

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"lr={self.lr} must be >= 0")


@dataclass
class OptimResult:
    grad_norm: float
    lr: float
    policy_version: int
