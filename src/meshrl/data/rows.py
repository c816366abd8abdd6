"""Raw rows from files or Python lists: the one reader behind SFT data (meshrl.data.sft) and RL prompt rows
(meshrl.data.prompts). It knows file formats only; what a row must contain is the caller's business.

Sources (`iter_rows` yields `(row number, row)`, row numbers 1-based):

    rows.jsonl            one JSON object a line; blank lines are skipped; the row number is the LINE number
    rows.json             a JSON list of objects (row number = position in the list), or JSON lines as above
    rows.parquet          read one row group at a time (pyarrow)
    some_dir/             a `datasets.Dataset.save_to_disk` directory (memory-mapped, read in batches)
    some_dir:train        one split of a `datasets.DatasetDict.save_to_disk` directory
    [{...}, {...}]        rows already in memory: any sequence / iterable of dicts (e.g. a `datasets.Dataset`)

A line of a JSONL file that is not valid JSON, or not UTF-8 text, is yielded as a `BadRowError` in place of the row,
so the caller decides (reject the file naming the row, or skip and count it) — the reader never stops half-way on a
bad row.
Everything else that is wrong with a source (missing path, unknown suffix, a DatasetDict without a split, a
.json list that does not parse) raises at once, naming the path and the forms above.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from meshrl.errors import DataError

SUPPORTED_FORMS = (
    "a .jsonl file, a .json file (a list of objects, or JSON lines), a .parquet file, a directory written by "
    "datasets' save_to_disk (DIR, or DIR:SPLIT for a DatasetDict), or an in-memory list of dicts"
)
IN_MEMORY = "<in-memory list>"
_BATCH_ROWS = 1024  # rows converted to Python objects at a time (datasets directories)

Source = str | os.PathLike | Iterable[Mapping[str, Any]]


class BadRowError(DataError):
    """What is wrong with one row. Readers raise it with the reason only; loaders add the file and row number.
    `reason`: the same without anything particular to the row (a byte, a count), for counting skipped rows by
    reason; by default the message itself."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


def is_path(source: Any) -> bool:
    return isinstance(source, str | os.PathLike)


def source_name(source: Any) -> str:
    """How messages name a source: the path as given, or "<in-memory list>"."""
    return os.fspath(source) if is_path(source) else IN_MEMORY


def iter_rows(source: Source) -> Iterator[tuple[int, Any]]:
    """(1-based row number, row) from a file, a datasets directory or an in-memory sequence of dicts (see the
    module docstring for the forms). A JSONL line that does not parse is yielded as a BadRowError. The source is
    checked when this is called, before the first row is asked for."""
    if not is_path(source):
        if isinstance(source, bytes | Mapping) or not isinstance(source, Iterable):
            raise TypeError(f"rows source is a {type(source).__name__}; expected {SUPPORTED_FORMS}")
        return enumerate(source, start=1)
    name = os.fspath(source)
    path = Path(name)
    if path.is_dir():
        return _datasets_dir(path, None, name)
    if not path.exists():
        dir_part, sep, split = name.rpartition(":")
        if sep and split and Path(dir_part).is_dir():
            return _datasets_dir(Path(dir_part), split, name)
        raise DataError(f"rows source {name} does not exist; expected {SUPPORTED_FORMS}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _json_lines(path)
    if suffix == ".json":
        return _json_file(path)
    if suffix == ".parquet":
        return _parquet(path)
    raise ValueError(
        f"rows source {name}: unsupported file type {path.suffix or '(no suffix)'!r}; use {SUPPORTED_FORMS}"
    )


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    # Bytes, decoded a line at a time: a byte that is not UTF-8 then spoils its own row only, and is reported with
    # the row's line number (a text-mode file raises mid-iteration, naming neither).
    with path.open("rb") as f:
        for i, raw in enumerate(f, start=1):
            if i == 1 and raw.startswith(codecs.BOM_UTF8):  # a byte-order mark (Windows editors) is not the row's
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                where = f"byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line"
                yield i, BadRowError(f"not UTF-8 text: {where} (save the file as UTF-8)", reason="not UTF-8 text")
                continue
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                yield i, BadRowError(f"invalid JSON: {e.msg}")


def _first_char(path: Path) -> str:
    with path.open(encoding="utf-8-sig", errors="replace") as f:
        while chunk := f.read(4096):
            if stripped := chunk.lstrip():
                return stripped[0]
    return ""


def _json_file(path: Path) -> Iterator[tuple[int, Any]]:
    if _first_char(path) != "[":
        return _json_lines(path)
    try:
        data = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ValueError(
            f"rows source {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte offset {e.start}); a .json "
            "list is read whole, so one bad byte spoils the file: save it as UTF-8 (or as JSON lines, where a bad "
            "row can be skipped)"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"rows source {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); a .json file "
            "must hold one list of objects, or one object a line"
        ) from None
    return enumerate(data, start=1)


def _parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    i = 0
    for g in range(f.num_row_groups):
        for row in f.read_row_group(g).to_pylist():
            i += 1
            yield i, row


def _datasets_dir(path: Path, split: str | None, name: str) -> Iterator[tuple[int, Any]]:
    is_dict, is_dataset = (path / "dataset_dict.json").is_file(), (path / "dataset_info.json").is_file()
    if not (is_dict or is_dataset):
        raise ValueError(
            f"rows source {name}: a directory, but not one written by datasets' save_to_disk (it has neither "
            f"dataset_info.json nor dataset_dict.json); expected {SUPPORTED_FORMS}"
        )
    from datasets import load_from_disk

    ds = load_from_disk(str(path))
    if is_dict:
        splits = sorted(ds)
        if split is None:
            raise ValueError(f"rows source {name} holds several splits {splits}: name one, e.g. {name}:{splits[0]}")
        if split not in ds:
            raise ValueError(f"rows source {name}: no split {split!r} in {path} (its splits: {splits})")
        ds = ds[split]
    elif split is not None:
        raise ValueError(f"rows source {name}: {path} holds a single dataset, not splits; drop ':{split}'")
    return _dataset_rows(ds)


def _dataset_rows(ds: Any) -> Iterator[tuple[int, Any]]:
    i = 0
    for batch in ds.iter(batch_size=_BATCH_ROWS):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            i += 1
            yield i, dict(zip(columns, values, strict=True))
