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
- Every other field of the row goes to `Row.info` untouched (the verifiers receive it), nulls included; the
  field the prompt came from, the answer field, and a null prompt / messages field do not.

A bad row stops the load naming the file, the row number and the field (`on_bad_row="error"`), or is skipped and
counted by reason (`"skip"`). Prompt length is not checked here — it needs the model's tokenizer and chat
template: render first, then `drop_long`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from meshrl.data.roles import CHAT_ROLES, check_roles
from meshrl.data.rows import BadRowError, Source, iter_rows, source_name
from meshrl.errors import ConfigError, DataError
from meshrl.rollout.row import Row

SKIP_HINT = "fix the row, or set --data.on-bad-row skip to skip such rows"


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
    rows: list[Row] = []
    skipped: Counter = Counter()
    for row_number, raw in iter_rows(source):
        try:
            rows.append(to_row(raw, cfg, roles=roles))
        except BadRowError as e:
            if cfg.on_bad_row == "error":
                raise BadRowError(f"{name}, row {row_number}: {e} ({SKIP_HINT})") from None
            skipped[e.reason] += 1
            continue
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        why = f"every row was bad; skipped: {dict(skipped)}" if skipped else "it holds no rows"
        raise DataError(f"prompt rows {name} have no usable rows ({why})")
    return PromptRows(rows, name, skipped)


PYTHON_ROWS = DataConfig()
"""The field names of rows given as dicts from Python (an environment's `rows`): a data file's defaults."""


def as_row(value: Row | Mapping[str, Any]) -> Row:
    """A row given from Python: a `Row` as is, or a dict in a data file's shape (`prompt` text or chat `messages`,
    an optional `answer`, every other field into `Row.info`), read as `to_row` reads a file's rows. Raises
    BadRowError saying what is wrong with a dict."""
    if isinstance(value, Row):
        return value
    return to_row(value, PYTHON_ROWS, answer_required=False)


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
    # Not info: the field the prompt came from, the answer field, and a null prompt / messages / answer field (a
    # columnar file's "absent").
    used = {prompt_key} | {k for k in (cfg.prompt_field, cfg.messages_field, cfg.answer_field) if k and _null(raw, k)}
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
        for part in ("role", "content"):
            if not isinstance(m.get(part), str):
                got = "missing" if m.get(part) is None else type(m[part]).__name__
                raise BadRowError(f"{shape}; a message's {part!r} is {got}, expected str")
        messages.append({k: v for k, v in m.items() if v is not None})
    check_roles(messages, roles)
    trailing = None
    if messages[-1]["role"] == "assistant":
        trailing = messages.pop()["content"]
        if not messages:
            raise BadRowError(f"field {key!r} holds only the assistant's message: no prompt left")
    if not any(m["content"].strip() for m in messages):
        raise BadRowError(f"field {key!r} is an empty prompt (every message's content is empty)")
    return messages, trailing


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
