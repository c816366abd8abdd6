"""Plain data exchanged between the controller and the actors.

Everything here is a dataclass of Python lists / numbers (a `Datum`'s per-token fields may also be 1-D numpy
arrays), so it can be inspected in a debugger without any actor machinery. A `Datum`'s per-token sequences cross
a process boundary as packed numpy arrays (`Datum.__reduce__`): a pickled list of 16k Python numbers costs
milliseconds to write, read and collate, and the trainer's GPU waits for that trip between steps. For the same
reason `forward_backward` returns reduced numbers, not per-token rows (`ForwardBackwardResult`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np


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


def _packed(values: Sequence | None, dtype: type) -> np.ndarray | None:
    """A per-token sequence as a 1-D array for the wire (arrays are sent as they are; lists converted once)."""
    if values is None or isinstance(values, np.ndarray):
        return values
    return np.array(values, dtype=dtype)


def _datum_from_wire(*values) -> Datum:
    return Datum(*values)


@dataclass(eq=False)
class Datum:
    """One training sequence. Per-token fields are aligned with the *targets* `tokens[1:]`, i.e. they have
    `len(tokens) - 1` entries: entry i is about predicting tokens[i + 1] from tokens[: i + 1].

    Per-token fields are Python lists or 1-D numpy arrays. Pickled (sent to an actor), they travel as int64 /
    float64 arrays, exact, and arrive as numpy arrays."""

    tokens: Sequence[int]
    loss_mask: Sequence[float]  # weight of each target token in the loss (0 for prompt and padding)
    old_logprobs: Sequence[float] | None = None  # generator's logprobs of the targets (0 where the mask is 0)
    advantage: float = 0.0
    ref_logprobs: Sequence[float] | None = None  # reference model's logprobs of the targets (for a KL term)
    positions: Sequence[int] | None = None  # per token (len(tokens)); restarts at 0 per packed document
    # Encoded images (PNG, JPEG, ... bytes), in the order their image-token runs appear in `tokens` (which hold the
    # expanded image tokens): the trainer's image processor makes the pixels (meshrl.models.vision). The samples of
    # a group share one tuple, which pickle sends once per call.
    images: tuple[bytes, ...] | None = None

    def __post_init__(self) -> None:
        for f in ("tokens", "loss_mask", "old_logprobs", "ref_logprobs", "positions"):
            v = getattr(self, f)
            if isinstance(v, np.ndarray) and v.ndim != 1:
                raise ValueError(f"Datum.{f} must be a list or a 1-D array, got an array of shape {v.shape}")
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

    def __reduce__(self):
        return _datum_from_wire, (
            _packed(self.tokens, np.int64),
            _packed(self.loss_mask, np.float64),
            _packed(self.old_logprobs, np.float64),
            self.advantage,
            _packed(self.ref_logprobs, np.float64),
            _packed(self.positions, np.int64),
            self.images,
        )

    def __eq__(self, other: object) -> bool:
        """Same values field by field, whether lists or arrays hold them."""
        if not isinstance(other, Datum):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "images":
                if tuple(a or ()) != tuple(b or ()):
                    return False
                continue
            if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
                return False
        return True

    @classmethod
    def from_completion(
        cls,
        prompt_ids: list[int],
        response_ids: list[int],
        logprobs: list[float] | None = None,
        advantage: float = 0.0,
    ) -> Datum:
        """Prompt + response, with the loss on the response tokens only. The fields are numpy arrays, built once
        here rather than every time the datum is sent (to the reference model, then to the trainer)."""
        if len(response_ids) == 0:
            raise ValueError("empty response: nothing to train on")
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt: a Datum needs at least one prompt token to predict the response from")
        if logprobs is not None and len(logprobs) != len(response_ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(response_ids)} response tokens")
        n_prompt = len(prompt_ids)
        tokens = np.concatenate([np.asarray(prompt_ids, dtype=np.int64), np.asarray(response_ids, dtype=np.int64)])
        mask = np.zeros(len(tokens) - 1)
        mask[n_prompt - 1 :] = 1.0
        old = None
        if logprobs is not None:
            old = np.zeros(len(tokens) - 1)
            old[n_prompt - 1 :] = logprobs
        return cls(tokens, mask, old, advantage)

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(np.asarray(self.loss_mask) > 0))


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
    # Also return the trainer's per-datum logprobs (ForwardBackwardResult.logprobs), gathered from every rank and
    # sent to the controller as rows: for parity tests and benches. Off, only reduced numbers travel.
    return_logprobs: bool = False

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
    """What one `forward_backward` call returns: numbers already reduced over the trainer ranks (every rank returns
    the same), not per-token rows. The trainer-vs-generator logprob mismatch |trainer − old_logprobs| over the loss
    tokens of the sequences that carry `old_logprobs` (the trainer's logprobs before this call's update) has fields
    of its own rather than entries in `metrics`: `metrics` holds sums the controller divides by the step's loss
    tokens, while the mismatch counts only its own tokens and has a max. Over a step's calls: sum the sums and the
    counts, take the max of the maxes (`meshrl.controller.training.train_step` does)."""

    loss: float  # this call's contribution to the step loss (already divided by the global normaliser)
    metrics: dict[str, float]  # sums over this call's loss tokens (divide by the step's loss tokens for means)
    num_tokens: int  # loss tokens in this call
    logprob_diff_sum: float = 0.0  # sum of |trainer − old_logprobs| over the mismatch's tokens
    logprob_diff_max: float = 0.0  # its max (0 when it has no tokens)
    logprob_diff_count: int = 0  # its tokens: loss tokens of the sequences with old_logprobs
    logprobs: list[list[float]] | None = None  # per datum, per target token, only with LossSpec.return_logprobs
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
