"""Supervised fine-tuning data: JSONL / Parquet files or in-memory lists of rows, in the two common shapes

    {"prompt": "...", "response": "..."}                       (field names configurable)
    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}

tokenised into (prompt ids, response ids + EOS) with the loss on the response only. For `messages` the
tokenizer's chat template renders everything before the last assistant turn as the prompt and that turn as
the response. Bad rows are rejected at load (file, row number, reason) or skipped and counted — the user
chooses — so a run never dies half-way through an epoch on a bad row.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class BadRowError(ValueError):
    pass


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]  # ends with EOS

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class SFTDataset:
    examples: list[SFTExample]
    source: str
    skipped: Counter = field(default_factory=Counter)  # reason -> count

    def __len__(self) -> int:
        return len(self.examples)


def iter_rows(source: str | list[dict[str, Any]]) -> Iterator[tuple[int, Any]]:
    """(1-based row number, row) from a .jsonl / .json / .parquet file or an in-memory list."""
    if isinstance(source, list):
        yield from enumerate(source, start=1)
        return
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file {source} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
    elif path.suffix in (".jsonl", ".json"):
        with path.open() as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, BadRowError(f"invalid JSON: {e.msg}")
    else:
        raise ValueError(f"SFT data {source}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")


def _text(row: dict, key: str) -> str:
    if key not in row:
        raise BadRowError(f"missing field {key!r}")
    value = row[key]
    if not isinstance(value, str):
        raise BadRowError(f"field {key!r} is {type(value).__name__}, expected str")
    return value


def tokenize_row(row: Any, tokenizer, *, prompt_field: str, response_field: str, messages_field: str) -> SFTExample:
    """One row -> SFTExample, or BadRowError saying what is wrong with it. `tokenizer` is a transformers one."""
    if isinstance(row, BadRowError):
        raise row
    if not isinstance(row, dict):
        raise BadRowError(f"row is {type(row).__name__}, expected an object")
    if messages_field in row:
        messages = row[messages_field]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRowError(f"field {messages_field!r} must be a non-empty list of {{role, content}} objects")
        if messages[-1].get("role") != "assistant":
            raise BadRowError("the last message must be the assistant's (it is the response to train on)")
        if getattr(tokenizer, "chat_template", None) is None:
            raise BadRowError("chat `messages` rows need a tokenizer with a chat template")

        def render(msgs: list, **kw: Any) -> list[int]:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, **kw)
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        prompt_ids, full_ids = render(messages[:-1], add_generation_prompt=True), render(messages)
        if full_ids[: len(prompt_ids)] != prompt_ids:
            raise BadRowError("the chat template does not render the prompt as a prefix of the conversation")
        response_ids = full_ids[len(prompt_ids) :]
        response_text = messages[-1].get("content")
    else:
        prompt, response_text = _text(row, prompt_field), _text(row, response_field)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(response_text, add_special_tokens=False)["input_ids"]
    if not isinstance(response_text, str) or not response_text.strip():
        raise BadRowError("empty response")
    if not prompt_ids:
        raise BadRowError("empty prompt")
    eos = tokenizer.eos_token_id
    if not response_ids or response_ids[-1] != eos:
        response_ids = list(response_ids) + [eos]
    return SFTExample(list(prompt_ids), list(response_ids))


def load_sft_dataset(
    source: str | list[dict[str, Any]],
    tokenizer,
    *,
    max_seq_len: int,
    on_bad_row: str = "error",
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
) -> SFTDataset:
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row={on_bad_row!r}; use 'error' or 'skip'")
    name = "<in-memory list>" if isinstance(source, list) else str(source)
    examples, skipped = [], Counter()
    for row_number, row in iter_rows(source):
        try:
            ex = tokenize_row(
                row, tokenizer, prompt_field=prompt_field, response_field=response_field, messages_field=messages_field
            )
            if len(ex) > max_seq_len:
                raise BadRowError(f"{len(ex)} tokens after tokenisation, over the limit of {max_seq_len}")
        except BadRowError as e:
            if on_bad_row == "error":
                raise BadRowError(
                    f"{name}, row {row_number}: {e} (fix the row, or set data.on_bad_row=skip to skip such rows)"
                ) from None
            skipped[str(e).split(" after")[0] if "tokens after" in str(e) else str(e)] += 1
            continue
        examples.append(ex)
    if not examples:
        raise ValueError(f"SFT data {name} has no usable rows (skipped: {dict(skipped) or 'none'})")
    return SFTDataset(examples, name, skipped)


def pack_examples(examples: list[SFTExample], max_len: int) -> list:
    """Pack examples, in order, into rows of at most `max_len` tokens (`Datum`s with per-document positions
    and the loss on each document's response only; the target that would cross a document boundary is masked).
    The loss over the packed rows is the same sum as over the unpacked examples — only the padding goes."""
    from meshrl.types import Datum

    rows, tokens, mask, positions = [], [], [], []

    def flush() -> None:
        if tokens:
            rows.append(Datum(list(tokens), mask[:-1], positions=list(positions)))  # no target after the last
            tokens.clear(), mask.clear(), positions.clear()

    for ex in examples:
        n = len(ex)
        if n > max_len:
            raise ValueError(f"an example of {n} tokens does not fit in packed rows of {max_len}")
        if len(tokens) + n > max_len:
            flush()
        tokens.extend(ex.prompt_ids), tokens.extend(ex.response_ids)
        # Targets of this document, then the (masked) target that would predict the next document's first token.
        mask.extend([0.0] * (len(ex.prompt_ids) - 1) + [1.0] * len(ex.response_ids) + [0.0])
        positions.extend(range(n))
    flush()
    return rows


class EpochSampler:
    """Deterministic shuffled passes over `n` examples. The cursor (epoch, offset) and the seed are the whole
    state: restoring them continues exactly where a run stopped — no example seen twice or skipped."""

    def __init__(self, n: int, *, seed: int, epoch: int = 0, offset: int = 0) -> None:
        if n < 1:
            raise ValueError("cannot sample from an empty dataset")
        self.n, self.seed, self.epoch, self.offset = n, seed, epoch, offset
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_indices(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.offset == self.n:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(k - len(out), self.n - self.offset)
            out += self._order[self.offset : self.offset + take]
            self.offset += take
        return out

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.offset / self.n

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed}

    @classmethod
    def from_state(cls, n: int, state: dict[str, int]) -> EpochSampler:
        return cls(n, seed=state["seed"], epoch=state["epoch"], offset=state["offset"])
