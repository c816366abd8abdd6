"""A row too long to fit, known from its characters before any tokenising: one 50 MB row takes minutes to tokenise
only to be dropped. No token covers more characters than the tokenizer's longest token string, so a text of more
than `tokens x that` characters cannot be `tokens` tokens or fewer; twice that leaves room for normalizers that drop
characters (accents, control characters).

    cap = char_cap(tokenizer, budget)              # characters past which a prompt cannot fit `budget` tokens
    if text_chars(row.prompt) > cap: ...           # drop / refuse it, untokenised
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SLACK = 2  # for normalizers that drop characters; a cap this loose never drops a row that could fit
NO_CAP = 1 << 40


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` (a transformers tokenizer) can stand for: its longest token
    string (byte-level BPE writes a byte a character; sentencepiece and WordPiece strings are no shorter than their
    text), added tokens included; at least 1."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return NO_CAP  # a tokenizer that cannot list its tokens: no cap
    return max((len(t) for t in vocab), default=1) or 1


def char_cap(tokenizer: Any, tokens: int) -> int:
    """Characters past which a text cannot be `tokens` tokens or fewer with `tokenizer`."""
    return tokens * max_token_chars(tokenizer) * SLACK


def text_chars(value: Any) -> int:
    """The characters of a prompt or response: a str, or chat messages (their contents; the text of content parts,
    images counting none)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return text_chars(value.get("text") if value.get("type") == "text" else value.get("content"))
    if isinstance(value, list | tuple):
        return sum(text_chars(m) for m in value)
    return 0
