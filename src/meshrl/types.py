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
