"""The evaluation statistics RL post-training papers report, from per-sample correctness.

    greedy accuracy   one greedy (temperature 0) completion per problem: the fraction correct
    mean@n            n sampled completions per problem: the fraction correct over all of them ("avg@n")
    pass@k            the chance that at least one of k completions is correct, estimated without bias from n >= k
                      samples (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):
                      pass@k = E_problems[1 - C(n - c, k) / C(n, k)], c = correct samples of the problem

Estimating pass@k from n > k samples (rather than drawing exactly k) has much lower variance; pass@1 from n
samples equals mean@n.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshrl.errors import ConfigError


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct among `n` samples: 1 - C(n-c, k) / C(n, k), computed as
    1 - prod_{i=n-c+1..n} (1 - k / i) (no large binomials)."""
    if n < 1:
        raise ValueError(f"pass_at_k: n={n} samples; need at least 1")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} correct out of n={n} samples; need 0 <= c <= n")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} with n={n} samples; need 1 <= k <= n")
    if n - c < k:  # every draw of k contains a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def summarize(correct: Sequence[Sequence[bool]], ks: Sequence[int] = (1,)) -> dict[str, float]:
    """`correct[i]`: whether each of problem i's n samples is correct (n the same for every problem). Returns
    {"mean@n": fraction of all samples correct, "pass@k": mean over problems of pass_at_k(n, c_i, k)} for each
    k in `ks` with k <= n (larger k are left out: n samples cannot estimate them), e.g.
    {"mean@8": 0.4, "pass@1": 0.4, "pass@4": 0.71}."""
    if not correct:
        raise ValueError("summarize: no problems")
    n = len(correct[0])
    if n < 1:
        raise ValueError("summarize: problem 0 has no samples")
    for i, samples in enumerate(correct):
        if len(samples) != n:
            raise ValueError(
                f"summarize: problem {i} has {len(samples)} samples, problem 0 has {n}; every problem needs the "
                "same number"
            )
    for k in ks:
        if k < 1:
            raise ValueError(f"summarize: k={k} must be >= 1")
    counts = [sum(bool(x) for x in samples) for samples in correct]
    out = {f"mean@{n}": sum(counts) / (n * len(counts))}
    for k in dict.fromkeys(ks):  # in the order given, once each
        if k <= n:
            out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / len(counts)
    return out


def greedy_accuracy(correct: Sequence[bool]) -> float:
    """Fraction of problems whose one greedy completion is correct."""
    if not correct:
        raise ValueError("greedy_accuracy: no problems")
    return sum(bool(x) for x in correct) / len(correct)


@dataclass
class EvalConfig:
    """Held-out evaluation, as RL papers report it: greedy accuracy, and mean@k / pass@k over k samples at the
    training temperature (pass@k by the unbiased estimator). A completion is correct when the verifier gives it
    >= 1."""

    every: int = 0
    """Evaluate every this many RL steps (besides before RL and at the end); 0: only before and after."""
    samples: int = 0
    """k: completions sampled per held-out prompt at generator.temperature for mean@k and pass@k; 0: greedy only."""
    pass_k: tuple[int, ...] = ()
    """The k's of pass@k reported (each <= eval.samples); empty: 1 and eval.samples."""
    max_tokens: int | None = None
    """Completion budget for evaluation; default: generator.max_tokens."""
    verifier: str | None = None
    """The reward function that decides correctness; default: the task's own (reverse: exact_match, reasoning_gym:
    its scorer, data: the first function of --reward)."""
    seed: int = 0
    """Seed of the evaluation samples (kept apart from the training RNG, so evaluating never changes a run)."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.samples < 0:
            raise ConfigError(f"eval.every={self.every} and eval.samples={self.samples} must be >= 0")
        if self.pass_k and not self.samples:
            raise ConfigError("eval.pass_k needs eval.samples > 0 (k samples per prompt)")
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples]
        if bad:
            raise ConfigError(f"eval.pass_k={list(self.pass_k)}: each k must be in [1, eval.samples={self.samples}]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"eval.max_tokens={self.max_tokens} must be >= 1")

    @property
    def ks(self) -> tuple[int, ...]:
        if not self.samples:
            return ()
        return tuple(sorted(set(self.pass_k or (1, self.samples))))
