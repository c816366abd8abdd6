"""Supervised fine-tuning data: JSONL / JSON / Parquet files, `datasets` directories or in-memory lists of rows
(read by meshrl.data.rows), in the two common shapes

    {"prompt": "...", "response": "..."}                       (field names configurable)
    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}

tokenised into (prompt ids, response ids + EOS) with the loss on the response only. For `messages` the
tokenizer's chat template renders everything before the last assistant turn as the prompt and that turn as
the response (every message's role one the template knows: meshrl.data.roles). Bad rows are rejected at load
(file, row number, reason) or skipped and counted — the user chooses — so a run never dies half-way through an
epoch on a bad row.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from meshrl.data.lengths import SLACK, max_token_chars, text_chars
from meshrl.data.roles import CHAT_ROLES, accepted_roles, check_roles
from meshrl.data.rows import BadRowError, iter_rows, source_name
from meshrl.data.sampler import EpochSampler  # noqa: F401 - re-exported: controller/sft.py imports it from here
from meshrl.errors import ConfigError, DataError
from meshrl.tokenizer import unknown_characters


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]  # ends with EOS
    images: tuple[bytes, ...] = ()  # the prompt's encoded images, in the order of its image tokens

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class SFTDataset:
    examples: list[SFTExample]
    source: str
    skipped: Counter = field(default_factory=Counter)  # reason -> count

    def __len__(self) -> int:
        return len(self.examples)


def _text(row: dict, key: str) -> str:
    if key not in row:
        raise BadRowError(f"missing field {key!r}")
    value = row[key]
    if not isinstance(value, str):
        raise BadRowError(f"field {key!r} is {type(value).__name__}, expected str")
    return value


def _encode(tokenizer, *texts: str) -> list[list[int]]:
    """Token ids of each text, or a BadRowError naming every character of them outside the tokenizer's vocabulary:
    they would train as the unknown token, teaching the model to emit `<unk>` for them."""
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    unknown = sorted({c for text, i in zip(texts, ids, strict=True) for c in unknown_characters(tokenizer, text, i)})
    if unknown:
        shown = unknown[:10] + (["..."] if len(unknown) > 10 else [])
        raise BadRowError(
            f"characters {shown} are not in the tokenizer's vocabulary (they would train as "
            f"{tokenizer.unk_token!r}); remove or replace them, or use a model whose tokenizer covers them",
            reason="characters outside the tokenizer's vocabulary",
        )
    return ids


def _check_response(text: Any) -> None:
    if not isinstance(text, str) or not text.strip():
        raise BadRowError("empty response")


def tokenize_row(
    row: Any,
    tokenizer,
    *,
    prompt_field: str,
    response_field: str,
    messages_field: str,
    roles: Collection[str] | None = None,
    vision: Any = None,
    base_dir: str | os.PathLike | None = None,
) -> SFTExample:
    """One row -> SFTExample, or BadRowError saying what is wrong with it. `tokenizer` is a transformers one; `roles`:
    the chat roles messages may have (default: those the tokenizer's chat template knows, meshrl.data.roles).
    `vision` (meshrl.models.vision.VisionInputs of a vision-language model): the prompt's image parts ({"type":
    "image", "image": ...}, read against `base_dir`) become its images, each placeholder expanded to its tokens."""
    if isinstance(row, BadRowError):
        raise row
    if not isinstance(row, dict):
        raise BadRowError(f"row is {type(row).__name__}, expected an object")
    images: tuple[bytes, ...] = ()
    if messages_field in row:
        messages = row[messages_field]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRowError(f"field {messages_field!r} must be a non-empty list of {{role, content}} objects")
        if messages[-1].get("role") != "assistant":
            raise BadRowError("the last message must be the assistant's (it is the response to train on)")
        if getattr(tokenizer, "chat_template", None) is None:
            raise BadRowError("chat `messages` rows need a tokenizer with a chat template")
        check_roles(messages, accepted_roles(template=tokenizer.chat_template) if roles is None else roles)
        _check_response(messages[-1].get("content"))

        prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        prompt_ids, full_ids = _encode(tokenizer, prompt_text, tokenizer.apply_chat_template(messages, tokenize=False))
        if full_ids[: len(prompt_ids)] != prompt_ids:
            raise BadRowError("the chat template does not render the prompt as a prefix of the conversation")
        response_ids = full_ids[len(prompt_ids) :]
        images = _prompt_images(messages[:-1], vision, base_dir)
        if images:
            prompt_ids = vision.expand(prompt_ids, images, "the row's prompt")
    else:
        prompt, response_text = _text(row, prompt_field), _text(row, response_field)
        _check_response(response_text)
        prompt_ids, response_ids = _encode(tokenizer, prompt, response_text)
    if not prompt_ids:
        raise BadRowError("empty prompt")
    eos = tokenizer.eos_token_id
    if not response_ids or response_ids[-1] != eos:
        response_ids = list(response_ids) + [eos]
    return SFTExample(list(prompt_ids), list(response_ids), images)


def _prompt_images(messages: list[dict], vision: Any, base_dir: str | os.PathLike | None) -> tuple[bytes, ...]:
    """The encoded images of a chat prompt's image parts (BadRowError for a bad one, or for images a text-only
    model would be given)."""
    from meshrl.rollout.images import BadImageError, image_parts, wire_image

    parts = image_parts(messages)
    if not parts:
        return ()
    if vision is None:
        raise BadRowError(
            f"the row has {len(parts)} image(s) but the model has no vision tower (its config.json has no "
            "vision_config); train a vision-language checkpoint, or give text-only rows",
            reason="images for a text-only model",
        )
    try:
        return tuple(
            wire_image(p.get("image"), base_dir=base_dir, where=f"image {k + 1} of {len(parts)}").data
            for k, p in enumerate(parts)
        )
    except BadImageError as e:
        raise BadRowError(str(e), reason=e.reason) from None


def _row_chars(row: Any, fields: tuple[str, ...]) -> int:
    return sum(text_chars(row.get(f)) for f in fields) if isinstance(row, dict) else 0


def load_sft_dataset(
    source: str | os.PathLike | Iterable[Mapping[str, Any]],
    tokenizer,
    *,
    max_seq_len: int,
    on_bad_row: str = "error",
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
    vision: Any = None,
) -> SFTDataset:
    """`vision`: a vision-language model's image token counts (meshrl.models.vision.VisionInputs); rows' image
    parts are then read (relative paths against the data file's directory) and travel with their examples."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row={on_bad_row!r}; use 'error' or 'skip'")
    name = source_name(source)
    examples, skipped = [], Counter()
    template = getattr(tokenizer, "chat_template", None)
    roles = accepted_roles(template=template) if isinstance(template, str) else CHAT_ROLES
    per_token = max_token_chars(tokenizer)
    for row_number, row in iter_rows(source):
        try:
            # A row too long by its characters alone is refused untokenised (a 50 MB row takes minutes to tokenise).
            chars = _row_chars(
                row,
                (messages_field,)
                if isinstance(row, dict) and messages_field in row
                else (prompt_field, response_field),
            )
            if chars > max_seq_len * per_token * SLACK:
                raise BadRowError(
                    f"{chars} characters, more than {max_seq_len} tokens can hold (at most {per_token} characters a "
                    "token with this tokenizer); not tokenised",
                    reason=f"over the limit of {max_seq_len} tokens",
                )
            ex = tokenize_row(
                row,
                tokenizer,
                prompt_field=prompt_field,
                response_field=response_field,
                messages_field=messages_field,
                roles=roles,
                vision=vision,
                base_dir=os.path.dirname(os.path.abspath(source)) if isinstance(source, str | os.PathLike) else None,
            )
            if len(ex) > max_seq_len:
                raise BadRowError(
                    f"{len(ex)} tokens after tokenisation, over the limit of {max_seq_len}",
                    reason=f"over the limit of {max_seq_len} tokens",
                )
        except BadRowError as e:
            if on_bad_row == "error":
                raise BadRowError(
                    f"{name}, row {row_number}: {e} (fix the row, or set --data.on-bad-row skip to skip such rows)"
                ) from None
            skipped[e.reason] += 1
            continue
        examples.append(ex)
    if not examples:
        raise DataError(f"SFT data {name} has no usable rows (skipped: {dict(skipped) or 'none'})")
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
        if ex.images:
            raise ConfigError(
                "--data.pack with image rows: the rows packed here cannot carry images; leave --data.pack off (the "
                "trainer packs sequences itself, images included: --trainer.pack-sequences)"
            )
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


@dataclass
class SFTDataConfig:
    train: str = "task"
    """'task' (the built-in task's demonstrations) or a .jsonl / .parquet file of prompt/response or chat
    `messages` rows. From Python, `meshrl.controller.sft.main(cfg, train_rows=[...])` takes a list instead."""
    eval: str | None = "task"
    """Held-out rows, same forms as `train`; None: no evaluation."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A bad row (missing field, wrong type, empty response, too long): stop at load naming the file and row,
    or skip it and count it in the log."""
    prompt_field: str = "prompt"
    """Field of the prompt text (prompt/response rows)."""
    response_field: str = "response"
    """Field of the response text (prompt/response rows)."""
    messages_field: str = "messages"
    """Field of a chat row: a list of {role, content}, the last one the assistant's response."""
    max_seq_len: int | None = None
    """Longest prompt + response in tokens; default: the model's max_position_embeddings."""
    shuffle_seed: int = 0
    """Seed of the shuffled epochs over the training rows."""
    pack: bool = False
    """Pack several examples into each row (document-masked attention, per-document positions): no compute
    spent on padding when lengths vary. Same loss as unpacked (either trainer backend)."""
    pack_len: int | None = None
    """Tokens per packed row; default: data.max_seq_len."""

    def __post_init__(self) -> None:
        for flag, value in (("--data.max-seq-len", self.max_seq_len), ("--data.pack-len", self.pack_len)):
            if value is not None and value < 2:
                raise ConfigError(f"{flag} {value} must be >= 2 tokens (a prompt token and a response token)")
        if self.pack_len is not None and not self.pack:
            raise ConfigError(
                f"--data.pack-len {self.pack_len} has no effect without --data.pack (rows are not packed); add "
                "--data.pack, or drop --data.pack-len"
            )
        if self.pack_len is not None and self.max_seq_len is not None and self.pack_len < self.max_seq_len:
            raise ConfigError(
                f"--data.pack-len {self.pack_len} is shorter than --data.max-seq-len {self.max_seq_len}: an example "
                "of max-seq-len tokens would fit no packed row; raise --data.pack-len or lower --data.max-seq-len"
            )
