"""Training building blocks the programs share: micro-batches, one optimiser step over `forward_backward` calls,
forward-only logprobs and NLL, and reference-model logprobs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TypeVar

import numpy as np

from meshrl.batching import rank_sizes
from meshrl.controller.api import Controller
from meshrl.types import Datum, ForwardBackwardResult, LossSpec, OptimParams, OptimResult

T = TypeVar("T")


def micro_batches(items: Sequence[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(items), size):
        yield list(items[i : i + size])


def train_step(
    ctl: Controller, data: list[Datum], loss: LossSpec, micro_batch_size: int, params: OptimParams
) -> tuple[list[ForwardBackwardResult], OptimResult, tuple[float, float]]:
    """One optimiser step: the sequences binned by length into `forward_backward` calls under the trainer's token
    budget (and at most `micro_batch_size` per call), balanced over the ranks (meshrl.batching); the gradients
    accumulate and the last call carries the step, all sent before any result is read. The trainer goes from the
    last backward straight to the update; `num_micro_batches` makes it refuse a batch in which a call failed (that
    call raises its own error here). Returns the calls' results, the step's, and the trainer-vs-generator logprob
    mismatch (mean over the loss tokens that carry `old_logprobs`, max; (0, 0) without any), from the numbers each
    call reduced on the trainer (`ForwardBackwardResult.logprob_diff_*`): no per-token rows travel."""
    plan = ctl.micro_batch_plan([len(d.tokens) for d in data], micro_batch_size)
    params = dataclasses.replace(params, num_micro_batches=len(plan))
    last = len(plan) - 1
    pending = [
        ctl.forward_backward(
            [data[i] for part in call for i in part], loss, step=params if c == last else None, split=rank_sizes(call)
        )
        for c, call in enumerate(plan)
    ]
    results = [p.result() for p in pending]
    count = sum(r.logprob_diff_count for r in results)
    mismatch = (0.0, 0.0)
    if count:
        mismatch = (sum(r.logprob_diff_sum for r in results) / count, max(r.logprob_diff_max for r in results))
    return results, results[-1].optim, mismatch


def pad_rows(data: list[Datum], multiple: int, pad_id: int) -> list[Datum]:
    """Append loss-free 2-token rows so the row count splits evenly over the trainer ranks."""
    return data + [Datum([pad_id, pad_id], [0.0]) for _ in range((-len(data)) % multiple)]


def forward_all(ctl: Controller, data: list[Datum], micro_batch_size: int, dp: int) -> list[list[float]]:
    """Trainer logprobs of any number of sequences: micro-batches whose size the DP ranks can split (the last
    one padded with copies whose results are dropped), all queued at once."""
    pending = []
    for mb in micro_batches(data, micro_batch_size):
        pad = (-len(mb)) % dp
        pending.append((len(mb), ctl.forward(mb + [mb[-1]] * pad)))
    return [row for n, p in pending for row in p.result()[:n]]


def eval_nll(ctl: Controller, data: list[Datum], micro_batch_size: int, dp: int) -> float:
    """Mean negative log-likelihood per loss token (no gradient)."""
    rows = forward_all(ctl, data, micro_batch_size, dp)
    total = sum(float(-np.dot(row, d.loss_mask)) for d, row in zip(data, rows, strict=True))
    return total / sum(d.num_loss_tokens for d in data)


def attach_reference_logprobs(ctl: Controller, data: list[Datum], micro_batch_size: int, temperature: float) -> None:
    """Fill `Datum.ref_logprobs` from the ReferenceModel (micro-batches queued at once)."""
    pending = [ctl.reference_logprobs(mb, temperature) for mb in micro_batches(data, micro_batch_size)]
    rows = [row for p in pending for row in p.result()]
    for d, row in zip(data, rows, strict=True):
        d.ref_logprobs = np.asarray(row, dtype=np.float64)
