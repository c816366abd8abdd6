"""RL prompt rows from files or Python lists: each raw row (read by meshrl.data.rows) becomes a task `Row(prompt,
answer, info)`.

A row is one of two shapes (field names are `DataConfig`'s):

    {"prompt": "What is 6 * 7?", "answer": "42", ...}                         plain text prompt
    {"messages": [{"role": "system", ...}, {"role": "user", ...}], "answer": "42", ...}     chat prompt

- Chat: a row with the messages field (not null) is a chat prompt. The messages must be a non-empty list of
  objects with a string "role" and a string "content"; other keys of a message are kept, except null ones
  (Parquet / datasets fill absent struct keys with null, which chat templates trip over). The prompt field may
  also hold such a list (the TRL "conversational prompt" shape) and is then read the same way.
- Roles: every message's role is system, user, assistant or tool, or another role the model's chat template names
  (meshrl.data.roles); any other (`usr`) makes the row bad.
- Trailing assistant turn: if the LAST message is the assistant's, it is dropped from the prompt (the model is
  to write it) and, when the row has no answer field, its content is the answer — so SFT-style conversation
  files serve as RL prompts as they are. What remains must hold at least one message.
- Plain: the prompt field must be a non-empty (not only whitespace) string.
- Answer: when `answer_field` is set, every row needs it (or a trailing assistant turn). str, int and float are
  accepted and kept as `str(value)`: 42 -> "42", but 42.0 -> "42.0" (write the answer as a string where the
  verifier compares text); a list / object / empty string makes the row bad. `answer_field` None or "": rows
  need no answer (`Row.answer` is then the trailing assistant turn's content, or None).
- A field whose value is null counts as absent (columnar files hold null where a row lacks the field).
- Images: a message's content may be a list of parts, `{"type": "text", "text": ...}` and `{"type": "image",
  "image": ...}` (a path, relative to the data file's directory; encoded bytes; a PIL image; a datasets Image value),
  or the row holds a list of images in `images_field`, merged into the first user turn before its text. Every
  image is decoded and checked at load and carried as a `WireImage` (meshrl.rollout.images); a bad one (missing,
  undecodable, more than `max_images_per_row`) stops the load naming the file, row and image
  (`on_bad_image="error"`), or the row is skipped and counted (`"skip"`). Rows without images load as before.
- Every other field of the row goes to `Row.info` untouched (the verifiers receive it), nulls included; the
  field the prompt came from, the answer and images fields, and a null prompt / messages field do not.

A bad row stops the load naming the file, the row number and the field (`on_bad_row="error"`), or is skipped and
counted by reason (`"skip"`). Prompt length is not checked here — it needs the model's tokenizer and chat
template: render first, then `drop_long`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from meshrl.data.roles import CHAT_ROLES, check_roles
from meshrl.data.rows import BadRowError, Source, is_path, iter_rows, source_name
from meshrl.errors import ConfigError, DataError
from meshrl.rollout.images import BadImageError, merge_images_field, resolve_row_images
from meshrl.rollout.row import Row

SKIP_HINT = "fix the row, or set --data.on-bad-row skip to skip such rows"
IMAGE_SKIP_HINT = "fix the row, or set --data.on-bad-image skip to skip rows with a bad image"


@dataclass
class DataConfig:
    """Prompt rows of an RL run: a task's own rows, or your files."""

    train: str | None = None
    """Training prompt rows: a .jsonl / .json / .parquet file, or a datasets save_to_disk directory (DIR, or
    DIR:SPLIT for a DatasetDict). None: the task's own rows."""
    eval: str | None = None
    """Held-out prompt rows, same forms as `train`. None: the task's own held-out rows."""
    prompt_field: str = "prompt"
    """Field holding a plain text prompt (or a list of chat messages)."""
    messages_field: str = "messages"
    """A row with this field (a list of {role, content} messages) is a chat prompt; a trailing assistant message
    is dropped from the prompt and serves as the answer when the row has no answer field."""
    answer_field: str | None = "answer"
    """Field holding the reference answer, required in every row (a bad row otherwise). None or '': for tasks
    whose verifier needs no answer."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A bad row (missing field, wrong type, empty prompt or answer, invalid JSON): stop at load naming the file,
    the row and the field, or skip it and count it in the log."""
    max_eval_rows: int | None = None
    """Evaluate on the first N usable held-out rows only. None: all of them."""
    images_field: str | None = None
    """The row field holding a list of images (file paths, relative to the data file's directory; encoded bytes;
    datasets Image values), merged into the first user turn before its text. None: images only as image parts of
    chat messages ({"type": "image", "image": ...})."""
    max_images_per_row: int = 8
    """A row with more images than this is a bad image row (see --data.on-bad-image)."""
    on_bad_image: Literal["error", "skip"] = "error"
    """A row with an image that cannot be used (missing file, undecodable, unsupported type, zero size, too many):
    stop at load naming the file, the row and the image, or skip: the row is dropped and counted; the count is
    printed."""

    def __post_init__(self) -> None:
        if self.answer_field == "":
            self.answer_field = None
        if self.train == "":
            self.train = None
        if self.eval == "":
            self.eval = None
        if self.on_bad_row not in ("error", "skip"):
            raise ConfigError(f"--data.on-bad-row {self.on_bad_row!r}: use 'error' or 'skip'")
        if not self.prompt_field:
            raise ConfigError("--data.prompt-field is empty: name the field that holds the prompt")
        if not self.messages_field:
            raise ConfigError("--data.messages-field is empty: name the field that holds chat messages")
        if self.messages_field == self.prompt_field:
            raise ConfigError(
                f"--data.messages-field and --data.prompt-field are both {self.prompt_field!r}: name two fields "
                "(a prompt field may hold chat messages anyway)"
            )
        if self.answer_field in (self.prompt_field, self.messages_field):
            raise ConfigError(
                f"--data.answer-field {self.answer_field!r} is also the prompt or messages field; name another field"
            )
        if self.max_eval_rows is not None and self.max_eval_rows < 1:
            raise ConfigError(f"--data.max-eval-rows {self.max_eval_rows} must be >= 1 (or unset: all rows)")
        if self.images_field == "":
            self.images_field = None
        if self.images_field is not None and self.images_field in (
            self.prompt_field,
            self.messages_field,
            self.answer_field,
        ):
            raise ConfigError(
                f"--data.images-field {self.images_field!r} is also the prompt, messages or answer field; name the "
                "field that holds the row's list of images"
            )
        if self.max_images_per_row < 1:
            raise ConfigError(f"--data.max-images-per-row {self.max_images_per_row} must be >= 1")
        if self.on_bad_image not in ("error", "skip"):
            raise ConfigError(f"--data.on-bad-image {self.on_bad_image!r}: use 'error' or 'skip'")


@dataclass
class PromptRows:
    rows: list[Row]
    source: str  # the file name, or "<in-memory list>"
    skipped: Counter = field(default_factory=Counter)  # reason -> count (on_bad_row="skip")

    def __len__(self) -> int:
        return len(self.rows)


def load_prompt_rows(
    source: Source, cfg: DataConfig, *, limit: int | None = None, roles: Collection[str] = CHAT_ROLES
) -> PromptRows:
    """Every row of `source` (a path in any form of meshrl.data.rows, or an in-memory list of dicts) as a task
    `Row`. `limit`: stop after this many usable rows (e.g. `cfg.max_eval_rows` for held-out rows; the rest of
    the file is not read). `roles`: the chat roles messages may have (meshrl.data.roles.accepted_roles). Raises
    BadRowError on a bad row (on_bad_row="error"), ValueError if no row is usable, FileNotFoundError / ValueError for
    a source that cannot be read."""
    if source is None:
        raise ValueError("no prompt rows source given (a file, a datasets directory, or a list of dicts)")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be >= 1 (or None: all rows)")
    name = source_name(source)
    base_dir = _base_dir(source)
    rows: list[Row] = []
    skipped: Counter = Counter()
    for row_number, raw in iter_rows(source):
        try:
            row = to_row(raw, cfg, roles=roles)
        except BadRowError as e:
            if cfg.on_bad_row == "error":
                raise BadRowError(f"{name}, row {row_number}: {e} ({SKIP_HINT})") from None
            skipped[e.reason] += 1
            continue
        try:  # decoded and checked once, here: a bad image stops the load, not a rollout hours later
            where = f"row {row_number} of {name}"
            rows.append(resolve_row_images(row, base_dir=base_dir, where=where, max_images=cfg.max_images_per_row))
        except BadImageError as e:
            if cfg.on_bad_image == "error":
                raise BadImageError(f"{e} ({IMAGE_SKIP_HINT})", reason=e.reason) from None
            skipped[e.reason] += 1
            continue
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        why = f"every row was bad; skipped: {dict(skipped)}" if skipped else "it holds no rows"
        raise DataError(f"prompt rows {name} have no usable rows ({why})")
    return PromptRows(rows, name, skipped)


def _base_dir(source: Source) -> Path | None:
    """Where relative image paths of a source's rows are read from: the directory holding the data file (or the
    datasets directory); None (the working directory) for rows in memory."""
    if not is_path(source):
        return None
    path = Path(os.fspath(source))
    if not path.exists():  # DIR:SPLIT of a DatasetDict
        path = Path(os.fspath(source).rpartition(":")[0] or path)
    return path.absolute().parent


PYTHON_ROWS = DataConfig()
"""The field names of rows given as dicts from Python (an environment's `rows`): a data file's defaults."""


def as_row(value: Row | Mapping[str, Any]) -> Row:
    """A row given from Python: a `Row` as is, or a dict in a data file's shape (`prompt` text or chat `messages`,
    an optional `answer`, every other field into `Row.info`), read as `to_row` reads a file's rows, its images (image
    parts of its messages; relative paths from the working directory) resolved. Raises BadRowError saying what is
    wrong with a dict (BadImageError for an image)."""
    if isinstance(value, Row):
        return value
    row = to_row(value, PYTHON_ROWS, answer_required=False)
    return resolve_row_images(row, where="a row given from Python", max_images=PYTHON_ROWS.max_images_per_row)


def to_row(raw: Any, cfg: DataConfig, *, answer_required: bool = True, roles: Collection[str] = CHAT_ROLES) -> Row:
    """One raw row -> `Row`, or BadRowError saying what is wrong with it (the reason only: no file / row number,
    and nothing row-specific, so that skipped rows count by reason). `answer_required` False: a row without the
    answer field (nor a trailing assistant turn) has answer None. `roles`: the chat roles messages may have."""
    if isinstance(raw, BadRowError):
        raise raw
    if not isinstance(raw, Mapping):
        raise BadRowError(f"row is {type(raw).__name__}, expected an object")
    if _present(raw, cfg.messages_field):
        prompt_key = cfg.messages_field
    elif _present(raw, cfg.prompt_field):
        prompt_key = cfg.prompt_field
    else:
        raise BadRowError(f"missing field {cfg.prompt_field!r} (or {cfg.messages_field!r} for a chat prompt)")
    value = raw[prompt_key]
    trailing: str | None = None
    if prompt_key == cfg.messages_field or isinstance(value, list | tuple):
        prompt, trailing = _messages(value, prompt_key, roles)
    elif not isinstance(value, str):
        raise BadRowError(f"field {prompt_key!r} is {type(value).__name__}, expected str or a list of messages")
    elif not value.strip():
        raise BadRowError(f"field {prompt_key!r} is an empty prompt")
    else:
        prompt = value
    # Not info: the field the prompt came from, the answer and images fields, and a null prompt / messages / answer /
    # images field (a columnar file's "absent").
    fields = (cfg.prompt_field, cfg.messages_field, cfg.answer_field, cfg.images_field)
    used = {prompt_key} | {k for k in fields if k and _null(raw, k)}
    if cfg.images_field is not None and _present(raw, cfg.images_field):
        images = raw[cfg.images_field]
        if not isinstance(images, list | tuple) or images:  # an empty list: a text-only row
            prompt = merge_images_field(prompt, images)
        used.add(cfg.images_field)
    if cfg.answer_field is not None and _present(raw, cfg.answer_field):
        answer = _answer(raw[cfg.answer_field], cfg.answer_field)
        used.add(cfg.answer_field)
    elif cfg.answer_field is not None and trailing is None and answer_required:
        raise BadRowError(
            f"missing field {cfg.answer_field!r} (the reference answer; set --data.answer-field '' if the "
            "verifier needs none)"
        )
    elif cfg.answer_field is not None and trailing is not None and not trailing.strip():
        raise BadRowError(
            f"field {prompt_key!r} ends with an empty assistant message (the answer, as the row has no "
            f"{cfg.answer_field!r} field)"
        )
    else:
        answer = trailing or None
    info = {k: v for k, v in raw.items() if k not in used}
    return Row(prompt=prompt, answer=answer, info=info)


def _present(raw: Mapping[str, Any], key: str) -> bool:
    return raw.get(key) is not None


def _null(raw: Mapping[str, Any], key: str) -> bool:
    return key in raw and raw[key] is None


def _messages(value: Any, key: str, roles: Collection[str]) -> tuple[list[dict[str, Any]], str | None]:
    """(prompt messages, content of a dropped trailing assistant message or None)."""
    shape = f"field {key!r} must be a non-empty list of {{role, content}} messages"
    if not isinstance(value, list | tuple) or not value:
        raise BadRowError(f"{shape}; it is {'empty' if isinstance(value, list | tuple) else type(value).__name__}")
    messages = []
    for m in value:
        if not isinstance(m, Mapping):
            raise BadRowError(f"{shape}; a message is {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            got = "missing" if m.get("role") is None else type(m["role"]).__name__
            raise BadRowError(f"{shape}; a message's 'role' is {got}, expected str")
        content = m.get("content")
        if isinstance(content, list | tuple):
            content = _parts(content, shape)
        elif not isinstance(content, str):
            got = "missing" if content is None else type(content).__name__
            raise BadRowError(f"{shape}; a message's 'content' is {got}, expected str or a list of content parts")
        messages.append({k: content if k == "content" else v for k, v in m.items() if v is not None})
    check_roles(messages, roles)
    trailing = None
    if messages[-1]["role"] == "assistant":
        trailing = _answer_text(messages.pop()["content"], key)
        if not messages:
            raise BadRowError(f"field {key!r} holds only the assistant's message: no prompt left")
    if not any(_has_content(m["content"]) for m in messages):
        raise BadRowError(f"field {key!r} is an empty prompt (every message's content is empty)")
    return messages, trailing


PART_TYPES = ("text", "image")


def _parts(content: Sequence[Any], shape: str) -> list[dict[str, Any]]:
    """A message's content given as parts ({"type": "text", "text": ...} / {"type": "image", "image": ...}), null keys
    dropped (a columnar file's "absent"). The images are checked later (meshrl.rollout.images)."""
    parts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in PART_TYPES:
            got = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise BadRowError(
                f"{shape}; a content part is {got!r}, expected {{'type': 'text', 'text': ...}} or "
                "{'type': 'image', 'image': ...}",
                reason="unsupported content part",
            )
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise BadRowError(f"{shape}; a text part has no str 'text'")
        if part["type"] == "image" and part.get("image") is None:
            raise BadRowError(f"{shape}; an image part has no 'image' (a path, bytes or an image)")
        parts.append({k: v for k, v in part.items() if v is not None})
    return parts


def _has_content(content: str | list[dict[str, Any]]) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    return any(p["type"] == "image" or p["text"].strip() for p in content)


def _answer_text(content: str | list[dict[str, Any]], key: str) -> str:
    """A trailing assistant message's content as the answer text: its text parts joined."""
    if isinstance(content, str):
        return content
    if any(p["type"] != "text" for p in content):
        raise BadRowError(f"field {key!r} ends with an assistant message holding an image: the answer must be text")
    return "".join(p["text"] for p in content)


def _answer(value: Any, key: str) -> str:
    if isinstance(value, str):
        if not value.strip():
            raise BadRowError(f"field {key!r} is an empty answer")
        return value
    if isinstance(value, int | float):  # bool included: True -> "True"
        return str(value)
    raise BadRowError(f"field {key!r} is {type(value).__name__}, expected str, int or float")


def drop_long(rows: Sequence[Row], lengths: Sequence[int], max_len: int) -> tuple[list[Row], int]:
    """The rows whose (rendered prompt) length is at most `max_len`, in order, and how many were dropped. Rows
    are dropped, never truncated: a cut prompt is a different question."""
    if len(rows) != len(lengths):
        raise ValueError(f"drop_long: {len(rows)} rows but {len(lengths)} lengths")
    if max_len < 1:
        raise ValueError(f"drop_long: max_len={max_len} must be >= 1")
    kept = [r for r, n in zip(rows, lengths, strict=True) if n <= max_len]
    return kept, len(rows) - len(kept)
