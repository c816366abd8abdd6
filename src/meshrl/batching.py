"""How a step's sequences become `forward_backward` calls: token-budget micro-batches balanced over the
data-parallel trainer ranks, and packed rows inside a rank.

A step holds sequences of very different lengths (RL completions stop anywhere between 1 and max_tokens). A fixed
number of sequences per call either wastes the device (short ones padded to the longest) or runs out of memory (a
call of long ones). Here a call is bounded by the *tokens* a rank holds instead, counted the way the trainer will
lay them out (padded rows, or packed rows), and every rank of a call gets a similar load, since a call lasts as long
as its slowest rank.

    plan = plan_micro_batches(lengths, num_ranks=2, max_tokens=16384, pack=True, row_len=4096)
    for call in plan:            # one forward_backward per entry
        for rank, indices in enumerate(call):  # the sequences rank `rank` computes
            ...

The gradient of a step does not depend on the plan: every call's loss is divided by the step's global normaliser
(meshrl.losses), so any grouping sums to the same update (to float rounding). No Monarch, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """First-fit decreasing: the indices of `lengths` grouped into rows of at most `max(row_len, longest)` tokens
    (a sequence longer than `row_len` gets a row of its own). Deterministic: ties keep the input order."""
    capacity = max([row_len, *lengths]) if lengths else row_len
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def layout_tokens(lengths: Sequence[int], *, pack: bool, row_len: int) -> int:
    """Tokens the trainer materialises for these sequences on one rank: rows x the longest row (rows are padded to
    the longest). Unpacked, a row is a sequence."""
    if not lengths:
        return 0
    if not pack:
        return len(lengths) * max(lengths)
    rows = pack_rows(lengths, row_len)
    return len(rows) * max(sum(lengths[i] for i in row) for row in rows)


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    num_ranks: int,
    max_tokens: int,
    max_seqs: int | None = None,
    pack: bool = False,
    row_len: int = 0,
) -> list[list[list[int]]]:
    """Group sequence indices into calls: `plan[c][r]` are the sequences rank r computes in call c.

    Bounds per rank and call: `layout_tokens(...) <= max_tokens` (a sequence longer than the budget gets a call
    slot of its own rather than an error: the trainer's own length check speaks for it), and at most `max_seqs`
    sequences summed over the ranks of a call (None: no bound). Longest first, each sequence goes to the least
    loaded rank of the first call that has room, so the ranks of a call carry similar loads and few calls are made.
    A rank may get nothing in the last call (the trainer pads it with a loss-free row)."""
    if num_ranks < 1 or max_tokens < 1:
        raise ValueError(f"num_ranks={num_ranks} and max_tokens={max_tokens} must be >= 1")
    if max_seqs is not None and max_seqs < 1:
        raise ValueError(f"max_seqs={max_seqs} must be >= 1 (or None)")
    plan: list[list[list[int]]] = []
    parts: list[list[_PartLayout]] = []  # each call's ranks, their layout so far

    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        placed = False
        for c, call in enumerate(plan):
            if max_seqs is not None and sum(map(len, call)) >= max_seqs:
                continue
            for r in sorted(range(num_ranks), key=lambda r: parts[c][r].cost):
                if not call[r] or parts[c][r].cost_with(lengths[i]) <= max_tokens:
                    call[r].append(i)
                    parts[c][r].add(lengths[i])
                    placed = True
                    break
            if placed:
                break
        if not placed:
            plan.append([[i]] + [[] for _ in range(num_ranks - 1)])
            parts.append([_PartLayout(pack, row_len) for _ in range(num_ranks)])
            parts[-1][0].add(lengths[i])
    return plan


class _PartLayout:
    """One rank's share of a call as `layout_tokens` counts it, kept up to date as sequences arrive longest first.
    Then `pack_rows` of the share (first-fit decreasing) would put each new sequence into the first row with room,
    as `add` does: the cost of one more sequence is O(rows), not a re-pack of the share (which made planning cubic:
    1.5-2 s for 1024 sequences of ~300 tokens, paid before the step's first call)."""

    def __init__(self, pack: bool, row_len: int) -> None:
        self.pack, self.row_len = pack, row_len
        self.count, self.longest = 0, 0
        self.fills: list[int] = []  # tokens per packed row
        self.capacity = 0  # a packed row's room: max(row_len, the longest sequence), fixed by the first one
        self.cost = 0

    def _place(self, length: int) -> tuple[int, int]:
        """(row index, that row's fill after adding `length`); index len(fills): a new row."""
        for r, fill in enumerate(self.fills):
            if fill + length <= self.capacity:
                return r, fill + length
        return len(self.fills), length

    def cost_with(self, length: int) -> int:
        if not self.pack:
            return (self.count + 1) * max(self.longest, length)
        if not self.fills:
            return length
        r, fill = self._place(length)
        return (len(self.fills) + (r == len(self.fills))) * max(max(self.fills), fill)

    def add(self, length: int) -> None:
        self.cost = self.cost_with(length)
        self.count, self.longest = self.count + 1, max(self.longest, length)
        if self.pack:
            self.capacity = self.capacity or max(self.row_len, length)
            r, fill = self._place(length)
            if r == len(self.fills):
                self.fills.append(fill)
            else:
                self.fills[r] = fill


def rank_sizes(call: list[list[int]]) -> list[int]:
    """How many sequences each rank takes from a call's flat, rank-major list (`forward_backward(split=...)`)."""
    return [len(part) for part in call]


def activation_bytes_per_token(
    hf_config: dict,
    *,
    compute_bytes: int,
    activation_checkpointing: bool,
    logprob_chunk_size: int,
) -> int:
    """Device memory one token of a `forward_backward` call holds at its peak (activations kept for backward and
    the output head), estimated from the model's shape. Deliberately an over-estimate (the default token budget
    must not run out of memory on architectures whose layers keep more than Qwen3's): per decoder layer the
    inputs and outputs of every projection, norm and activation (~8 hidden + 4 attention-width + 4 MLP-width values);
    with activation checkpointing one layer's worth plus each layer's input. The head: the compute-dtype logits and
    their float32 log-softmax and gradient (12 bytes per vocabulary entry), or nothing per token when chunked."""
    text = hf_config.get("text_config", hf_config)
    hidden = int(text.get("hidden_size") or text.get("n_embd") or 0)
    layers = int(text.get("num_hidden_layers") or text.get("n_layer") or 1)
    heads = int(text.get("num_attention_heads") or text.get("n_head") or 1)
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    mlp = int(text.get("intermediate_size") or text.get("n_inner") or 4 * hidden)
    vocab = int(text.get("vocab_size") or 0)
    per_layer = compute_bytes * (8 * hidden + 4 * heads * head_dim + 4 * kv_heads * head_dim + 4 * mlp)
    body = (layers * compute_bytes * hidden + per_layer) if activation_checkpointing else layers * per_layer
    head = 0 if logprob_chunk_size else (compute_bytes + 12) * vocab
    return int(body + head)


def token_budget(
    free_bytes: int, bytes_per_token: int, *, fraction: float = 0.7, minimum: int = 256, maximum: int = 2**20
) -> int:
    """Tokens per rank and call that fit `fraction` of the free memory (the rest is headroom for the allocator's
    fragmentation and the backward's transient buffers)."""
    return int(min(max(fraction * free_bytes / max(bytes_per_token, 1), minimum), maximum))
