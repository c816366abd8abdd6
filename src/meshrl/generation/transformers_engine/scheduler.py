"""Continuous batching for one `generate` call: which sequences to admit into free KV-cache slots, when the running
rows are compacted, what each decode step runs — and, once the runner has run a step, what it means for the
sequences (`postprocess_*`). The scheduler decides on host-side state only; it never calls the runner.

A running sequence owns one slot of the cache, and row r of the batch lives in slot r. Rows stay contiguous: a
finished row's slot is refilled by a new sequence or, when the queue is empty, by moving the last row into it, so a
decode step runs over rows `[0, n)`. One iteration of the engine is

    prefill (admit queued sequences into the free slots) -> compact (close the holes) -> decode (every running row)

with `postprocess` after each step that samples.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from meshrl.generation.transformers_engine.sequence import Sequence


@dataclass
class Prefill:
    """Admit `seqs` into slots `rows` (in order). One prefill row per distinct prompt (`prompts`, run into slots
    `prompt_rows`); the samples of a prompt copy its KV (`copies`: (dst, src) slots, the first `copy_len`
    positions) and sample from its logits (`pick[i]`: sequence i's index into `prompts`). `images[i]`: prompt i's
    encoded images (empty for a text prompt)."""

    rows: list[int]
    seqs: list[Sequence]
    prompts: list[list[int]]
    prompt_rows: list[int]
    copies: list[tuple[int, int]]
    copy_len: int
    pick: list[int]
    images: list[tuple[bytes, ...]]


@dataclass
class Compaction:
    """Move rows `src` (their KV's first `length` positions and decode inputs) into rows `dst`; rows from `keep` on
    are then free."""

    src: list[int]
    dst: list[int]
    length: int
    keep: int


@dataclass
class Decode:
    """Decode rows [0, len(seqs)): `steps` device-loop steps before the host reads what they sampled, or None for one
    step sampled with a host round trip (a row uses top-k / top-p). `max_len`: the longest attention span now."""

    seqs: list[Sequence]
    max_len: int
    steps: int | None


class Scheduler:
    def __init__(self, seqs: list[Sequence], *, num_slots: int, max_prefill_tokens: int, sync_every: int) -> None:
        self.num_slots, self.max_prefill_tokens, self.sync_every = num_slots, max_prefill_tokens, sync_every
        self.waiting: deque[Sequence] = deque(seqs)
        self.running: list[Sequence] = []  # row r of the batch lives in slot r
        self.pos = np.zeros(num_slots, dtype=np.int64)  # tokens in each row's cache (the runner's pos_buf, on host)
        self.holes: list[int] = []  # rows whose sequence finished (their slots are free)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    # ------------------------------------------------------------------ prefill

    def schedule_prefill(self) -> Prefill | None:
        """As many queued sequences as fit (free slots, prefill token budget), into the holes first, then after the
        last running row; None when none can be admitted."""
        if not (self.waiting and (self.holes or len(self.running) < self.num_slots)):
            return None
        running = self.running
        free = sorted(self.holes) + list(range(len(running), self.num_slots))
        batch: list[Sequence] = []
        prompts: dict[int, int] = {}  # id(prompt) -> longest so far (one prefill row per distinct prompt)
        longest = 0
        while self.waiting and len(batch) < len(free):
            r = self.waiting[0]
            new_longest = max(longest, len(r.prompt))
            n_unique = len(prompts) + (id(r.prompt) not in prompts)
            if batch and n_unique * new_longest > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            batch.append(r)
            prompts.setdefault(id(r.prompt), 0)
            longest = new_longest
        rows = free[: len(batch)]
        for row, r in zip(rows, batch, strict=True):
            if row < len(running):
                running[row] = r
            else:
                running.append(r)
        # One prefill per distinct prompt (the samples of a prompt share it); its KV is copied to the others.
        src_row: dict[int, int] = {}
        for row, r in zip(rows, batch, strict=True):
            src_row.setdefault(id(r.prompt), row)
        uniq_rows = list(src_row.values())
        copies = [(row, src_row[id(r.prompt)]) for row, r in zip(rows, batch, strict=True)]
        copies = [(d, s) for d, s in copies if d != s]
        which = {row: i for i, row in enumerate(uniq_rows)}
        return Prefill(
            rows=rows,
            seqs=batch,
            prompts=[running[row].prompt for row in uniq_rows],
            prompt_rows=uniq_rows,
            copies=copies,
            copy_len=max((len(running[d].prompt) for d, _ in copies), default=0),
            pick=[which[src_row[id(r.prompt)]] for r in batch],
            images=[running[row].images for row in uniq_rows],
        )

    def postprocess_prefill(self, step: Prefill, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """`tokens` / `logprobs` [1, len(step.seqs)]: each admitted sequence's first token."""
        self._append(step.seqs, tokens, logprobs)
        self.pos[step.rows] = [len(r.prompt) for r in step.seqs]
        taken = set(step.rows)
        self.holes = [h for h in self.holes if h not in taken] + self._finished(step.rows)

    # ------------------------------------------------------------------ compaction

    def schedule_compaction(self) -> Compaction | None:
        """Drop finished rows; move the last running rows into the holes below them. None when there are no holes."""
        if not self.holes:
            return None
        running, pos = self.running, self.pos
        finished = set(self.holes)
        keep_n = len(running) - len(finished)
        movers = [r for r in range(keep_n, len(running)) if r not in finished]
        targets = [h for h in sorted(finished) if h < keep_n]
        assert len(movers) == len(targets)
        step = Compaction(src=movers, dst=targets, length=int(pos[movers].max()) if movers else 0, keep=keep_n)
        if movers:
            pos[targets] = pos[movers]
            for s, d in zip(movers, targets, strict=True):
                running[d] = running[s]
        del running[keep_n:]
        pos[keep_n:] = 0
        self.holes = []
        return step

    # ------------------------------------------------------------------ decode

    def schedule_decode(self) -> Decode | None:
        if not self.running:
            return None
        running = self.running
        max_len = int(self.pos[: len(running)].max()) + 1
        if any(r.uses_host_sampling for r in running):  # top-k / top-p: one host round trip per step
            return Decode(list(running), max_len, None)
        # Device loop: until the next host read, every step stays on the device. Rows reaching max_tokens end
        # exactly at a chunk boundary.
        steps = min(self.sync_every, min(r.params.max_tokens - len(r.tokens) for r in running))
        return Decode(list(running), max_len, steps)

    def postprocess_decode(self, step: Decode, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """`tokens` / `logprobs` [steps, n]: what each row sampled, step by step."""
        n = len(step.seqs)
        self._append(step.seqs, tokens, logprobs)
        self.pos[:n] += tokens.shape[0]
        self.holes = self._finished(range(n))

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _append(seqs: list[Sequence], tokens: np.ndarray, logprobs: np.ndarray) -> None:
        stops = frozenset().union(*{id(r.stop): r.stop for r in seqs}.values())
        hit_rows = set(np.flatnonzero(np.isin(tokens, list(stops)).any(0)).tolist()) if stops else set()
        tok_rows, lp_rows = tokens.T.tolist(), logprobs.T.tolist()
        for i, r in enumerate(seqs):
            r.append(tok_rows[i], lp_rows[i], may_stop=i in hit_rows)

    def _finished(self, rows) -> list[int]:
        return [row for row in rows if self.running[row].finish_reason is not None]


__all__ = ["Compaction", "Decode", "Prefill", "Scheduler"]
