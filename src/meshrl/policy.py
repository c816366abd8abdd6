"""The trainable policy of one trainer rank: the model backend (FSDP2-sharded where `sharding.use_fsdp` says so) +
AdamW, and the math of the
`forward_backward` / `forward` / `optim_step` contract. No Monarch in here — the PolicyTrainer actor is a thin
shell around this class, and tests can drive it directly inside a plain torch.distributed group.

Contract (DESIGN.md): `forward_backward` accumulates gradients and never zeroes them; each call's loss is
divided by the global number of loss tokens given by the controller, so k calls and one `optim_step` equal
one big batch. `optim_step` takes the LR (and the other optimiser params) on every call, steps, zeroes the
gradients and bumps `policy_version`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from meshrl.batching import activation_bytes_per_token, pack_rows, token_budget
from meshrl.devices import ieee_float32_convolutions, use_expandable_segments
from meshrl.losses import LossBatch, check_loss_spec, compute_loss
from meshrl.models import qwen3
from meshrl.models.config import ModelConfig, TrainerConfig
from meshrl.models.logprobs import target_logprobs  # noqa: F401 - re-exported (tests, users)
from meshrl.models.sharding import full_tensor
from meshrl.models.titan_backend import TorchtitanBackend
from meshrl.optim import FusedAdamW, host_copy_when_ready
from meshrl.types import Datum, ForwardBackwardResult, LossSpec, OptimParams, OptimResult

if TYPE_CHECKING:
    from meshrl.weight_sync.flat_gather import FlatGather
    from meshrl.weight_sync.shared_buffer import SharedBufferHandle


def collate(
    data: list[Datum], pad_id: int, device: torch.device, vocab_size: int | None = None
) -> tuple[torch.Tensor, LossBatch]:
    """Right-pad a list of Datum into `[B, L]` tokens and `[B, L-1]` target-aligned tensors. Built in numpy:
    converting Python lists there is ~6x faster than `torch.tensor` (the GPU waits for this every step).
    `vocab_size`: refuse token ids outside [0, vocab_size) (checked on the array, not per Python int)."""
    max_len = max(len(d.tokens) for d in data)
    B, T = len(data), max_len - 1
    tokens = np.full((B, max_len), pad_id, dtype=np.int64)
    mask = np.zeros((B, T), dtype=np.float32)
    old = np.zeros((B, T), dtype=np.float32)
    has_ref = all(d.ref_logprobs is not None for d in data)
    ref = np.zeros((B, T), dtype=np.float32) if has_ref else None
    for i, d in enumerate(data):
        n = len(d.tokens)
        tokens[i, :n] = d.tokens
        mask[i, : n - 1] = d.loss_mask
        if d.old_logprobs is not None:
            old[i, : n - 1] = d.old_logprobs
        if ref is not None:
            ref[i, : n - 1] = d.ref_logprobs
    if vocab_size is not None and (tokens.min() < 0 or tokens.max() >= vocab_size):
        i = int(np.flatnonzero(((tokens < 0) | (tokens >= vocab_size)).any(axis=1))[0])
        raise ValueError(f"datum {i} has token ids outside [0, {vocab_size})")
    adv = np.array([d.advantage for d in data], dtype=np.float32)
    return torch.from_numpy(tokens).to(device), LossBatch(
        mask=torch.from_numpy(mask).to(device),
        old_logprobs=torch.from_numpy(old).to(device),
        advantages=torch.from_numpy(adv).to(device),
        ref_logprobs=None if ref is None else torch.from_numpy(ref).to(device),
    )


def pack_for_forward(
    data: list[Datum], pad_id: int, row_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows for the forward of `data` (unpacked sequences): `[R, L]` tokens and per-document positions,
    and the `[D, T]` index into the flattened `[R, L - 1]` target logprobs that gives back `collate`'s layout
    (row d: datum d's targets; entries past a datum's end point anywhere, their loss mask is 0)."""
    lengths = [len(d.tokens) for d in data]
    rows = pack_rows(lengths, row_len)
    L = max(sum(lengths[i] for i in row) for row in rows)
    T = max(lengths) - 1
    tokens = np.full((len(rows), L), pad_id, dtype=np.int64)
    positions = np.zeros((len(rows), L), dtype=np.int64)
    index = np.zeros((len(data), T), dtype=np.int64)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            n = lengths[i]
            tokens[r, offset : offset + n] = data[i].tokens
            positions[r, offset : offset + n] = np.arange(n)
            index[i, : n - 1] = r * (L - 1) + offset + np.arange(n - 1)
            offset += n
        # Padding continues the last document (as collate_positions does): no new document starts there.
        positions[r, offset:] = np.arange(L - offset) + (positions[r, offset - 1] + 1)
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return as_tensor(tokens), as_tensor(positions), as_tensor(index)


def _max_norm(p: OptimParams) -> float:
    return p.grad_clip if p.grad_clip > 0 else math.inf


def collate_positions(data: list[Datum], device: torch.device) -> torch.Tensor | None:
    """`[B, L]` positions for packed rows (None when no datum is packed). Padding continues the last document,
    whose loss mask is 0 there."""
    if all(d.positions is None for d in data):
        return None
    max_len = max(len(d.tokens) for d in data)
    out = torch.zeros(len(data), max_len, dtype=torch.long)
    for i, d in enumerate(data):
        n = len(d.tokens)
        pos = torch.tensor(d.positions) if d.positions is not None else torch.arange(n)
        out[i, :n] = pos
        out[i, n:] = torch.arange(1, max_len - n + 1) + pos[-1]
    return out.to(device)


class Policy:
    """Model, optimiser and version counter of one trainer rank (FSDP2 over all ranks of the default group, except
    on one rank with nothing to cast: `meshrl.models.sharding.use_fsdp`)."""

    def __init__(
        self, model_dir: str | Path, model_cfg: ModelConfig, trainer_cfg: TrainerConfig, pad_id: int = 0
    ) -> None:
        """The model in `model_dir`, built as `model_cfg` says (trainer backend, attention kernel, compute dtype,
        LoRA) and trained as `trainer_cfg` says: its device, its speed levers (applied by either backend, see
        `HFBackend` / `TorchtitanBackend`), master dtype and bf16 rounding (the optimiser), and sequence packing
        (the sequences of a call share rows: document-masked attention, per-document positions,
        `meshrl.batching.pack_rows` under `pack_row_len`; an optimisation only, checked against the model here).
        `pad_id` pads unpacked rows. Tests and benches name the fields instead: `Policy.from_options`."""
        if not dist.is_initialized():
            raise RuntimeError("Policy needs torch.distributed initialised (RANK/WORLD_SIZE/MASTER_ADDR set)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model_cfg, self.trainer_cfg = model_cfg, trainer_cfg
        device = trainer_cfg.device
        self.device = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        self.model_dir = str(model_dir)
        self.pad_id = pad_id
        if trainer_cfg.master_dtype == "bfloat16" and model_cfg.dtype != "bfloat16":
            raise ValueError(f"master_dtype='bfloat16' needs param_dtype='bfloat16' (got {model_cfg.dtype!r})")
        ieee_float32_convolutions(model_cfg.dtype, self.device)
        if model_cfg.backend == "hf":  # any transformers causal LM; imports neither torchtitan nor vLLM
            from meshrl.models.hf_backend import HFBackend

            self.backend = HFBackend(model_dir, model_cfg, trainer_cfg, device=self.device)
        elif model_cfg.backend == "torchtitan":
            self.backend = TorchtitanBackend(model_dir, model_cfg, trainer_cfg, device=self.device)
        else:
            raise ValueError(f"model backend {model_cfg.backend!r}; use 'torchtitan' or 'hf'")
        self.model, self.max_seq_len = self.backend.model, self.backend.max_seq_len
        self._vision = getattr(self.backend, "vision", None)  # a vision-language model's image inputs, else None
        self._with_images = False
        self.policy_version = 0
        self.num_micro_batches = 0  # forward_backward calls that succeeded since the last step (OptimParams)
        self.load_hf(model_dir)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.offloaded: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # offload_optimizer_state()
        self.pack_sequences = trainer_cfg.pack_sequences and self._packing_holds()  # what the start-up check allows

    @classmethod
    def from_options(cls, model_dir: str | Path, *, pad_id: int = 0, **options) -> Policy:
        """For tests and benches: a Policy on this process group from fields of `ModelConfig` and `TrainerConfig`
        named as keywords; the other fields keep their defaults, except that `num_procs` is the group's size and
        sequences are packed only when `pack_sequences=True` is given.

            Policy.from_options(model_dir, backend="hf", dtype="bfloat16", logprob_chunk_size=4096)
        """
        names = {section: {f.name for f in dataclasses.fields(section)} for section in (ModelConfig, TrainerConfig)}
        unknown = sorted(set(options) - names[ModelConfig] - names[TrainerConfig])
        if unknown:
            raise TypeError(f"Policy.from_options: {unknown} are fields of neither ModelConfig nor TrainerConfig")
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        trainer = {"num_procs": ranks, "micro_batch_size": ranks, "pack_sequences": False}
        trainer |= {k: v for k, v in options.items() if k in names[TrainerConfig]}
        model_cfg = ModelConfig(**{k: v for k, v in options.items() if k in names[ModelConfig]})
        return cls(model_dir, model_cfg, TrainerConfig(**trainer), pad_id)

    # ---- the endpoint math --------------------------------------------------------------------------------
    def _local_shard(self, data: list[Datum], split: list[int] | None = None) -> list[Datum]:
        """This rank's sequences: `split[r]` of them for rank r, in order (None: an even, contiguous split). A rank
        given none computes one loss-free row, so every rank still takes part in the collectives."""
        if not data:
            raise ValueError("empty batch: forward_backward/forward need at least one Datum")
        if split is None:
            if len(data) % self.world_size:
                raise ValueError(
                    f"batch of {len(data)} sequences cannot be split evenly over {self.world_size} trainer ranks; "
                    f"send a multiple of {self.world_size}, or say how many each rank takes (split=)"
                )
            split = [len(data) // self.world_size] * self.world_size
        if len(split) != self.world_size or sum(split) != len(data) or min(split) < 0:
            raise ValueError(
                f"split={split} must give each of the {self.world_size} trainer ranks a count >= 0, summing to the "
                f"{len(data)} sequences sent"
            )
        longest = max(len(d.tokens) for d in data)
        if longest > self.max_seq_len:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds the model's limit of {self.max_seq_len} "
                "(its config's context length: max_position_embeddings, GPT-2's n_positions); shorten prompts or lower "
                "generator.max_tokens"
            )
        vocab = self.backend.vocab_size
        # Every rank checks the whole batch (the same verdict everywhere, before any collective); one rank
        # leaves it to `_collate`, which checks the array.
        for i, d in enumerate(data if self.world_size > 1 else []):
            if np.min(d.tokens) < 0 or np.max(d.tokens) >= vocab:
                raise ValueError(f"datum {i} has token ids outside [0, {vocab})")
        # Whether this call runs the vision tower: the whole batch's verdict, the same on every rank.
        self._with_images = any(d.images for d in data)
        if self._with_images and self._vision is None:
            raise ValueError(
                f"the batch has images but the trainer's model ({self.model_dir}, {self.backend.name!r} backend) has "
                "no vision tower; train a vision-language checkpoint with --model.backend hf"
            )
        if self._vision is not None and not self._with_images:
            image_id = self._vision.image_token_id
            for i, d in enumerate(data):
                if np.any(np.asarray(d.tokens) == image_id):
                    raise ValueError(f"datum {i} has image tokens but no images (Datum.images); send its images")
        start = sum(split[: self.rank])
        local = data[start : start + split[self.rank]]
        if not local:
            first = data[0]
            blank = [0.0]
            local = [
                Datum(
                    [self.pad_id, self.pad_id],
                    blank,
                    blank if first.old_logprobs is not None else None,
                    0.0,
                    blank if first.ref_logprobs is not None else None,
                )
            ]
        return local

    def _collate(self, local: list[Datum]) -> tuple[torch.Tensor, LossBatch]:
        vocab = self.backend.vocab_size if self.world_size == 1 else None  # else checked in _local_shard
        return collate(local, self.pad_id, self.device, vocab_size=vocab)

    def _target_logprobs(self, local: list[Datum], tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        """`[D, T]` logprobs of the targets of `local` (row i: datum i, as `collate` lays them out). Packed: the
        model runs on the packed rows and the result is gathered back into that layout, so everything after the
        forward (losses, aggregations, metrics, the per-datum rows returned) is the same code either way."""
        if self._vision is not None and self._with_images:
            return self._image_logprobs(local, temperature)
        if not self.pack_sequences or len(local) < 2 or any(d.positions is not None for d in local):
            return self._logprobs(tokens, temperature, collate_positions(local, self.device))
        packed, positions, index = pack_for_forward(local, self.pad_id, self.trainer_cfg.pack_row_len, self.device)
        rows = self._logprobs(packed, temperature, positions)  # [R, Lr - 1]
        return rows.reshape(-1)[index]

    def _image_logprobs(self, local: list[Datum], temperature: float) -> torch.Tensor:
        """`_target_logprobs` for a call with images: the rows, their per-document positions and pixel inputs from
        the model's image processor (meshrl.models.vision), packed as text rows are."""
        if any(d.positions is not None for d in local):
            raise ValueError("Datum.positions (rows packed by the caller) cannot carry images; send unpacked Datums")
        for i, d in enumerate(local):
            self._vision.check(d.tokens, d.images or (), f"datum {i} on trainer rank {self.rank}")
        # FSDP gathers the vision tower's weights on every rank that runs it, and reduce-scatters its gradients in
        # backward: a rank whose share has no image (text rows, a padding row) must run it too, or the others wait
        # for it forever. It runs the tower on a blank picture, in a stand-in row whose output enters the result
        # times 0 (so its backward runs as well, adding nothing).
        stand_in = self.world_size > 1 and not any(d.images for d in local)
        rows_in = local + [self._vision.stand_in(self.pad_id)] if stand_in else local
        pack = self.pack_sequences and len(rows_in) > 1
        batch = self._vision.pack(rows_in, self.pad_id, row_len=self.trainer_cfg.pack_row_len, pack=pack,
                                  device=self.device)  # fmt: skip
        flat = self.backend.target_logprobs(batch.tokens, temperature, batch.positions, batch.pixels).reshape(-1)
        if not stand_in:
            return flat[batch.index]
        return flat[batch.index[:-1]] + 0.0 * flat[batch.index[-1]].sum()

    def _packing_holds(self) -> bool:
        """Packed rows are only an optimisation if the model keeps documents apart. The backends mask attention
        from the per-document positions (torchtitan: our mask; transformers: read from `position_ids`), but an
        architecture that ignores them would attend across documents silently: compare once, at start-up."""
        if not getattr(self.backend, "supports_packing", False):
            warnings.warn(
                f"the {self.backend.name!r} backend cannot pack sequences: trainer.pack_sequences is off", stacklevel=2
            )
            return False
        g = torch.Generator().manual_seed(0)
        vocab = min(self.backend.vocab_size, 1000)
        docs = [Datum(torch.randint(vocab, (n,), generator=g).tolist(), [1.0] * (n - 1)) for n in (7, 5)]
        tokens, batch = self._collate(docs)
        with torch.no_grad():
            separate = self._logprobs(tokens, 1.0, None)
            packed, positions, index = pack_for_forward(docs, self.pad_id, 0, self.device)
            together = self._logprobs(packed, 1.0, positions).reshape(-1)[index]
        self._reshard()
        gap = float((separate - together).abs()[batch.mask > 0].max())
        tolerance = 1e-3 if self.model_cfg.dtype == "float32" else 5e-2
        if not gap <= tolerance:
            warnings.warn(
                f"packed rows change this model's logprobs by up to {gap:.3g} nats (attention crosses documents: "
                f"the architecture ignores per-document position_ids); trainer.pack_sequences is off",
                stacklevel=2,
            )
            return False
        return True

    def _logprobs(self, tokens: torch.Tensor, temperature: float, positions: torch.Tensor | None) -> torch.Tensor:
        if positions is None:
            return self.backend.target_logprobs(tokens, temperature)
        if not getattr(self.backend, "supports_packing", False):
            raise ValueError(f"packed rows (Datum.positions) are not supported by the {self.backend.name!r} backend")
        return self.backend.target_logprobs(tokens, temperature, positions)

    def forward_backward(
        self, data: list[Datum], loss: LossSpec, step: OptimParams | None = None, split: list[int] | None = None
    ) -> ForwardBackwardResult:
        """Accumulate this batch's gradients (`split`: how many sequences each rank takes, see `_local_shard`).
        `step` (the last micro-batch of an optimiser step): then take the
        step, as `optim_step(step)` right after this call would, its result in `.optim`; with the single-GPU
        optimiser the update is queued right behind the backward, before the host reads anything back, so the
        GPU goes from the backward straight to the update and the call returns while the update runs.
        Returns reduced numbers only (loss, metric sums, the trainer-vs-generator logprob mismatch); the per-datum
        logprobs, gathered from every rank, only with `loss.return_logprobs`."""
        if step is not None:
            self._check_step(step, done=self.num_micro_batches + 1)
        self.reload_optimizer_state()  # queued on the stream ahead of this call's work
        try:
            result, read_norm = self._forward_backward(data, loss, step, split)
        except torch.OutOfMemoryError as e:
            # A backward that ran out of memory part-way leaves half-accumulated gradients: the step cannot be
            # finished, so it is dropped here (the process stays usable) and the message says which knob to turn.
            self.zero_grad()
            torch.cuda.empty_cache()
            local = self._local_shard(data, split)
            raise torch.OutOfMemoryError(
                f"out of device memory in forward_backward on trainer rank {self.rank} with {len(local)} sequences, "
                f"{sum(len(d.tokens) for d in local)} tokens (longest {max(len(d.tokens) for d in local)}); the "
                "step's gradients were discarded. Lower --trainer.max-tokens-per-micro-batch (unset: derived from "
                "the free memory; see the trainer's token_budget) or --trainer.micro-batch-size, or turn on "
                f"--trainer.activation-checkpointing / --trainer.logprob-chunk-size. ({str(e).splitlines()[0]})"
            ) from e
        except BaseException:
            if step is not None:  # the step failed with its last micro-batch: start the next one clean
                self.zero_grad()
            raise
        self.num_micro_batches += 1
        if step is not None:
            result.optim = self._finish_step(step, float(read_norm())) if read_norm else self.optim_step(step)
        return result

    def _forward_backward(self, data: list[Datum], loss: LossSpec, step: OptimParams | None, split: list[int] | None):
        # The named ranges show in torch profiler traces (host time the GPU waits for, e.g. collate).
        with record_function("meshrl.collate"):
            check_loss_spec(loss, data)  # same verdict on every rank (all see the whole batch), before any collective
            local = self._local_shard(data, split)
            tokens, batch = self._collate(local)
        with record_function("meshrl.forward"):
            logprobs = self._target_logprobs(local, tokens, loss.temperature)
            # Per-token loss -> aggregation -> divided by the step's GLOBAL normaliser (meshrl.losses).
            scaled, metrics = compute_loss(logprobs, batch, loss)
            diff_sum, diff_count, diff_max = self._logprob_mismatch(logprobs.detach(), batch, local)
        # Backward runs on every rank even for a NaN loss (NaN gradients, not a hang): the verdict comes from the
        # all-reduce below, the same on every rank, so all raise together. No host sync before backward.
        nonfinite = (~torch.isfinite(scaled.detach())).to(torch.float32)
        # Per-datum rows only when asked (LossSpec.return_logprobs): queued before backward, ready when forward is.
        logprobs_on_host = host_copy_when_ready(logprobs) if loss.return_logprobs else None
        if self.trainer_cfg.defer_grad_sync:
            self._gradient_sync(last=step is not None)
        with record_function("meshrl.backward"):
            scaled.backward()
        with record_function("meshrl.results"):
            parts = [scaled.detach(), batch.mask.sum(), nonfinite, diff_sum, diff_count, *metrics.values()]
            stats = torch.stack(parts)
            dist.all_reduce(stats)
            if self.world_size > 1:  # the one quantity that is not a sum: a second, one-number collective
                dist.all_reduce(diff_max, op=dist.ReduceOp.MAX)
            stats_on_host = host_copy_when_ready(torch.cat([stats, diff_max.reshape(1)]))
            read_norm = None
            if step is not None and isinstance(self.optimizer, FusedAdamW):
                read_norm = self._queue_fused_step(step, skip=stats[2])  # a non-finite loss skips it on the device
            metric_names = list(metrics)
            # Everything below runs while the GPU is still busy with the backward (and the update): freeing the
            # autograd graph, building the per-datum lists (when asked for).
            del logprobs, scaled, metrics, batch, tokens, nonfinite
            rows = None if logprobs_on_host is None else self._rows(logprobs_on_host(), local, split)
            return self._forward_backward_result(stats_on_host().tolist(), metric_names, rows), read_norm

    def _logprob_mismatch(
        self, logprobs: torch.Tensor, batch: LossBatch, local: list[Datum]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """|trainer − generator| logprob over the loss tokens (mask > 0) of the sequences that carry `old_logprobs`:
        its sum, count and max on this rank, as float32 scalars on the device (queued, nothing read back). `logprobs`
        is in `collate`'s layout, packed or not (`_target_logprobs`); entries past a sequence's end are masked."""
        keep = batch.mask > 0
        has_old = np.array([d.old_logprobs is not None for d in local])
        if not has_old.all():  # a sequence without generator logprobs (SFT data; mixed batches) takes no part
            keep = keep & torch.from_numpy(has_old).to(self.device, non_blocking=True)[:, None]
        diff = torch.where(keep, (logprobs.to(torch.float32) - batch.old_logprobs).abs(), 0.0)
        return diff.sum(), keep.sum(dtype=torch.float32), diff.max()

    def _forward_backward_result(self, stats: list[float], metric_names: list[str], rows: list[list[float]] | None):
        """`stats`: loss, loss tokens, non-finite ranks, mismatch sum and count, the metrics (all summed over the
        ranks), then the mismatch max (over the ranks). `rows`: this rank's per-datum logprobs, when asked for."""
        if stats[2] > 0:
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"loss is NaN or inf on {int(stats[2])} trainer rank(s) at policy_version={self.policy_version}; "
                "the accumulated gradients were discarded. Check the batch (advantages, old_logprobs) and "
                "lower optim.lr"
            )
        return ForwardBackwardResult(
            loss=float(stats[0]),
            metrics={k: float(v) for k, v in zip(metric_names, stats[5:-1], strict=True)},
            num_tokens=int(stats[1]),
            logprob_diff_sum=float(stats[3]),
            logprob_diff_count=int(stats[4]),
            logprob_diff_max=float(stats[-1]),
            logprobs=None if rows is None else self._gather_rows(rows),
        )

    @torch.no_grad()
    def forward(self, data: list[Datum], temperature: float = 1.0, split: list[int] | None = None) -> list[list[float]]:
        local = self._local_shard(data, split)
        tokens, _ = self._collate(local)
        logprobs = self._target_logprobs(local, tokens, temperature)
        return self._gather_rows(self._rows(logprobs.cpu(), local, split))

    def optim_step(self, p: OptimParams) -> OptimResult:
        self._check_step(p, done=self.num_micro_batches)
        self.reload_optimizer_state()
        if isinstance(self.optimizer, FusedAdamW):
            return self._finish_step(p, float(self._queue_fused_step(p)()))
        # FSDP's DTensors, CPU: the norm is read before the step.
        for group in self.optimizer.param_groups:
            group.update(lr=p.lr, betas=tuple(p.betas), eps=p.eps, weight_decay=p.weight_decay)
        with record_function("meshrl.clip_grad_norm"):
            params = [q for group in self.optimizer.param_groups for q in group["params"] if q.grad is not None]
            norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(params, _max_norm(p))))
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._finish_step(p, norm)

    def _check_step(self, p: OptimParams, done: int) -> None:
        """Refuse (and discard the gradients of) a step whose batch is incomplete."""
        if p.num_micro_batches is not None and done != p.num_micro_batches:
            self.zero_grad()
            raise RuntimeError(
                f"optim_step expected {p.num_micro_batches} successful forward_backward calls since the last step, "
                f"got {done}: the step was not taken and the gradients were discarded (a failed call raised its "
                "own error; see it for the cause)"
            )
        if not done:
            raise RuntimeError("optim_step without gradients: call forward_backward first")

    def _queue_fused_step(self, p: OptimParams, skip: torch.Tensor | None = None):
        """The single-GPU optimiser: the norm, the clip, the skip of a non-finite step and the zeroing all stay on
        the device (CUDA graphs with optimizer_cuda_graph); returns the reader of the norm, whose copy is queued
        before the update, so the host waits for that alone (later work on the stream, weight publishing
        included, is ordered after the update). Taken or skipped, these gradients are spent."""
        for group in self.optimizer.param_groups:
            group.update(lr=p.lr, betas=tuple(p.betas), eps=p.eps, weight_decay=p.weight_decay)
        with record_function("meshrl.optimizer"):
            return self.optimizer.clip_and_step(_max_norm(p), skip)

    def _finish_step(self, p: OptimParams, grad_norm: float) -> OptimResult:
        self.num_micro_batches = 0
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"grad norm is {grad_norm} at policy_version={self.policy_version}: the step was skipped and the "
                "gradients discarded; lower optim.lr or check the inputs"
            )
        self.policy_version += 1
        return OptimResult(grad_norm=grad_norm, lr=p.lr, policy_version=self.policy_version)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.num_micro_batches = 0

    def _gradient_sync(self, *, last: bool) -> None:
        """--trainer.defer-grad-sync: FSDP2 reduce-scatters the gradients (and reshards the parameters) only in the
        step's last backward; the calls before it accumulate unsharded gradients on each rank."""
        from torch.distributed.fsdp import FSDPModule

        if self.world_size > 1 and isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)

    def _reshard(self) -> None:
        """FSDP2 keeps the root module's parameters unsharded after a forward without backward, and swaps the module's
        registered parameters for those unsharded ones meanwhile: code that walks `model.parameters()` then (the
        optimiser-state template of `load_state`) would see tensors the optimiser does not hold."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    # ---- memory -------------------------------------------------------------------------------------------
    def token_budget(self) -> int:
        """Tokens this rank can hold in one `forward_backward` call now (TrainerConfig.max_tokens_per_micro_batch
        when unset): what the device has free (plus this process's cached, unused blocks), less what the first
        optimiser step will still allocate (gradients, AdamW state), over an estimate of the memory per token
        (`meshrl.batching.activation_bytes_per_token`)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        master_bytes = sum(p.numel() * p.element_size() for p in params)
        pending = (0 if self.optimizer.state else 2 * master_bytes) + (
            0 if all(p.grad is not None for p in params) else master_bytes
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        else:  # a host shared by the ranks
            free = _host_available_bytes() // self.world_size
        per_token = activation_bytes_per_token(
            self.backend.hf_config,
            compute_bytes=4 if self.model_cfg.dtype == "float32" else 2,
            activation_checkpointing=self.trainer_cfg.activation_checkpointing,
            logprob_chunk_size=self.trainer_cfg.logprob_chunk_size,
        )
        return token_budget(max(free - pending, 0), per_token)

    def memory(self) -> dict[str, float]:
        """This rank's device memory now and its peak since the last call, in GiB (zeros on CPU: see the process's
        RSS)."""
        if self.device.type != "cuda":
            return {"allocated_gib": 0.0, "reserved_gib": 0.0, "peak_gib": 0.0}
        out = {
            "allocated_gib": torch.cuda.memory_allocated(self.device) / 2**30,
            "reserved_gib": torch.cuda.memory_reserved(self.device) / 2**30,
            "peak_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,
            # Times the allocator freed its cache and retried a failed cudaMalloc, since the process started: each is
            # a synchronising cudaFree of every cached block, the usual cause of one step training far slower than the
            # next near the memory limit (the count is cumulative: a step that added to it retried).
            "alloc_retries": torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0),
        }
        torch.cuda.reset_peak_memory_stats(self.device)
        return out

    def release_cached_memory(self) -> int:
        """Give the blocks torch's allocator keeps cached (freed activations of the last step: tens of GiB after a
        long-sequence step) back to the device, so a colocated generator can take them; the next step allocates
        afresh. Returns the bytes released."""
        if self.device.type != "cuda":
            return 0
        before = torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return before - torch.cuda.memory_reserved(self.device)

    def offload_optimizer_state(self) -> int:
        """Move the AdamW state (and any kept gradients) to host memory, freeing its device memory while a
        colocated generator runs; `reload_optimizer_state` brings it back into the same tensors (their storage is
        released and re-allocated, so the optimiser's own references stay valid). Returns the bytes moved."""
        if self.offloaded or self.device.type != "cuda":
            return 0
        tensors = [
            v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.is_cuda
        ] + [p.grad for p in self.model.parameters() if p.grad is not None]
        storages: dict[int, torch.UntypedStorage] = {}  # views of one buffer (flat state) go together
        for t in tensors:
            st = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            if st.nbytes():
                storages.setdefault(st.data_ptr(), st)
        for st in storages.values():
            device_bytes = torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)
            host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=True)
            host.copy_(device_bytes, non_blocking=True)
            self.offloaded.append((st, host))
        torch.cuda.current_stream(self.device).synchronize()  # the copies are done before the storage goes
        for st, _ in self.offloaded:
            st.resize_(0)
        torch.cuda.empty_cache()
        return sum(host.numel() for _, host in self.offloaded)

    def reload_optimizer_state(self) -> int:
        """Inverse of `offload_optimizer_state` (no-op when nothing is offloaded). Returns the bytes moved."""
        moved = 0
        for st, host in self.offloaded:
            st.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=self.device).set_(st).copy_(host, non_blocking=True)
            moved += host.numel()
        self.offloaded = []
        return moved

    # ---- full training state (torch DCP: sharded, reshardable on load) ------------------------------------
    def save_state(self, path: str) -> None:
        """Model + optimiser (+ policy version) with torch.distributed.checkpoint. Collective; every rank writes
        its own shards into `path`. Loadable on a different number of ranks."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.reload_optimizer_state()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        if self.rank == 0:
            Path(path, "trainer_meta.json").write_text(
                json.dumps({"policy_version": self.policy_version, "world_size": self.world_size})
            )
        dist.barrier()

    def load_state(self, path: str) -> int:
        """Inverse of `save_state` (collective). Returns the restored policy version."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        self.reload_optimizer_state()
        self._reshard()
        meta_path = Path(path, "trainer_meta.json")
        if not meta_path.is_file():
            raise FileNotFoundError(f"{path} is not a trainer checkpoint (no trainer_meta.json)")
        # The optimiser state must exist (step counters etc.) before DCP can load into it.
        if not self.optimizer.state:
            for p in self.model.parameters():
                p.grad = torch.zeros_like(p)
            self.optimizer.step()  # lr is 0: weights unchanged, state tensors allocated
            self.optimizer.zero_grad(set_to_none=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.policy_version = int(json.loads(meta_path.read_text())["policy_version"])
        self.num_micro_batches = 0
        return self.policy_version

    # ---- weights in and out -------------------------------------------------------------------------------
    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights under HF names. Collective: every rank must call it."""
        hf = self.backend.hf_state_dict()
        return {k: (v.to(dtype) if dtype is not None else v).detach() for k, v in hf.items()}

    def weight_shards(self, *, live: bool = False) -> dict[str, torch.Tensor] | None:
        """This rank's part of the weights under HF names (DTensors where sharded), gathering nothing; None when
        whole tensors are needed to convert them (LoRA merge; an adapter that fuses): use `hf_state_dict`.
        `live`: the parameters themselves, not detached copies (cheaper): read them only, before the next step."""
        return self.backend.hf_shards(live=live)

    def publish_weights_ipc(self, version: int, dtype: torch.dtype) -> SharedBufferHandle | None:
        """Same-GPU weight sync (`meshrl.weight_sync.shared_buffer`). Collective (the full weights are gathered);
        rank 0 copies them, cast to `dtype`, into its shared flat buffer (allocated on the first call) and
        publishes `version`. Returns the handle on rank 0 (send it to the generator once), None elsewhere.

        Sharded over several ranks, every rank casts its shards into one flat buffer and one collective gathers
        them all (`meshrl.weight_sync.flat_gather`), instead of ~300 per-tensor all-gathers; one rank copies its
        live parameters as they are."""
        from meshrl.weight_sync.shared_buffer import SharedBufferSender

        flat = self._ipc_flat_gather(dtype) if self.world_size > 1 else None
        if flat is not None:
            gather, shards = flat
            gather.gather(shards)  # collective: every rank's shards to rank 0
            if self.rank != 0:
                return None
            sender = getattr(self, "_ipc_sender", None)
            if sender is None:
                sender = self._ipc_sender = SharedBufferSender(gather.plan.layout, self.device)
            elif sender.layout != gather.plan.layout:
                raise ValueError("the weights no longer match the shared buffer's layout (names, shapes or dtypes)")
            sender.publish_with(lambda slot: gather.unpack_into(slot, shards), version)
            return sender.handle()
        hf = self.backend.hf_state_dict(snapshot=False)  # copied into the buffer right away
        if self.rank != 0:
            return None
        sender = getattr(self, "_ipc_sender", None)
        if sender is None:
            sender = self._ipc_sender = SharedBufferSender.for_state_dict(hf, self.device, dtype=dtype)
        sender.publish(hf, version)
        return sender.handle()

    def _ipc_flat_gather(self, dtype: torch.dtype) -> tuple[FlatGather, dict[str, torch.Tensor]] | None:
        """The flat gather of this rank's shards (built on the first publish, kept while the weights keep their
        names, shapes, dtypes and placements) and the shards; None where the weights are gathered per tensor (whole
        tensors needed: `weight_shards`; no tensor sharded over several ranks; shardings it does not handle). The
        same answer on every rank."""
        from meshrl.weight_sync.flat_gather import FlatGather

        shards = self.weight_shards(live=True)  # copied into the send buffer right away
        if shards is None:
            return None
        gather = getattr(self, "_ipc_gather", None)
        if gather is None or not gather.matches(shards, dtype):
            gather = self._ipc_gather = FlatGather.for_shards(shards, dtype)
        return None if gather is None else (gather, shards)

    def save_hf(self, path: str, dtype: torch.dtype | None = None) -> str | None:
        """Collective; rank 0 writes atomically (temp dir + rename). Returns the path on rank 0."""
        hf = self.hf_state_dict(dtype)
        out = None
        if self.rank == 0:
            out = str(qwen3.save_hf_checkpoint(path, hf, self.backend.hf_config, tokenizer_dir=self.model_dir))
        dist.barrier()
        return out

    def load_hf(self, path: str) -> None:
        """Load HF weights (collective). An HF checkpoint holds no optimiser state, so the optimiser starts
        fresh. New weights are a new policy: the version is bumped (except for the initial load)."""
        self.backend.load_hf(path)
        for param in self.model.parameters():  # gradients of the old weights mean nothing for the new ones
            param.grad = None
        # Only trainable weights (with LoRA: the adapters) are in the optimiser.
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.num_micro_batches = 0
        # Fused AdamW on GPU: ours on plain tensors (meshrl.optim: the step without host work, a CUDA graph
        # with optimizer_cuda_graph), torch's for FSDP2's DTensors; foreach on CPU, whose results the CPU tests
        # compare bitwise across runs. Pure-bf16 weights with a rounding other than nearest need ours anywhere.
        sharded = any(isinstance(q, DTensor) for q in trainable)
        rounding = self.trainer_cfg.bf16_rounding
        bf16_rounded = rounding != "nearest" and any(q.dtype == torch.bfloat16 for q in trainable)
        if sharded and bf16_rounded:
            raise ValueError(
                f"bf16_rounding={rounding!r} needs unsharded weights (one trainer rank); with FSDP "
                "shards use bf16_rounding='nearest' or fp32 master weights"
            )
        if self.device.type != "cuda" and not bf16_rounded:
            self.optimizer = torch.optim.AdamW(trainable, lr=0.0, foreach=True)
        elif sharded:
            self.optimizer = torch.optim.AdamW(trainable, lr=0.0, fused=True)
        else:
            self.optimizer = FusedAdamW(
                trainable, lr=0.0, cuda_graph=self.trainer_cfg.optimizer_cuda_graph, bf16_rounding=rounding
            )
        if hasattr(self, "num_params"):  # not the initial load
            self.policy_version += 1

    # ---- helpers ------------------------------------------------------------------------------------------
    def _rows(self, host_logprobs: torch.Tensor, local: list[Datum], split: list[int] | None) -> list[list[float]]:
        """`[B, T]` logprobs on the host (one device-to-host copy, not one per row) -> one list per datum (none for
        the loss-free row of a rank that was given no sequence)."""
        if split is not None and split[self.rank] == 0:
            return []
        return [host_logprobs[i, : len(d.tokens) - 1].tolist() for i, d in enumerate(local)]

    def _gather_rows(self, rows: list[list[float]]) -> list[list[float]]:
        """Every rank's per-datum rows, in the batch's order, on every rank."""
        if self.world_size == 1:
            return rows
        gathered: list[list[list[float]] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, rows)
        return [r for part in gathered for r in part]  # type: ignore[union-attr]


def _host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (free + reclaimable cache); elsewhere the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def policy_from_env(
    model_dir: str | Path, model_cfg: ModelConfig, trainer_cfg: TrainerConfig, pad_id: int = 0
) -> Policy:
    """Initialise the process group from RANK/WORLD_SIZE/MASTER_ADDR (set by Monarch or torchrun) and build: the one
    construction of the trainer's and the reference model's Policy (actors/policy_trainer.py, actors/reference.py)."""
    if not dist.is_initialized():
        if trainer_cfg.device != "cpu":
            if trainer_cfg.expandable_segments:
                use_expandable_segments()
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(
            "gloo" if trainer_cfg.device == "cpu" else "nccl",
            timeout=datetime.timedelta(seconds=trainer_cfg.collective_timeout_s),
        )
    return Policy(str(model_dir), model_cfg, trainer_cfg, pad_id)
