"""The chat roles a row's messages may have: the four every chat template knows, and any other that the model's
template names. A role outside them (`usr`, `User`) is a bad row: ChatML-style templates would render it as a turn
of its own name (`<|im_start|>usr`) and the run would train on it silently.

    roles = accepted_roles(model_dir)              # CHAT_ROLES, plus what the model's chat template names
    check_roles(messages, roles)                   # BadRowError naming the role, else None
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from meshrl.data.rows import BadRowError

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

_QUOTED = r"""['"]([\w-]+)['"]"""
_ROLE = r"""\brole\b['"]?\]?"""  # message.role, message['role'], message["role"]
# The ways templates test a message's role: role == 'x', 'x' == role, role in ['x', 'y'] (and their negations).
_ROLE_TESTS = (
    re.compile(rf"{_ROLE}\s*[!=]=\s*{_QUOTED}"),
    re.compile(rf"{_QUOTED}\s*[!=]=\s*[\w.\[\]'\"]*{_ROLE}"),
)
_ROLE_IN = re.compile(rf"{_ROLE}\s+(?:not\s+)?in\s*[\[(]([^\])]*)[\])]")


def template_roles(template: str | None) -> set[str]:
    """The roles a chat template's text compares a message's role with."""
    if not template:
        return set()
    roles = {m.group(1) for pattern in _ROLE_TESTS for m in pattern.finditer(template)}
    for listed in _ROLE_IN.finditer(template):
        roles |= set(re.findall(_QUOTED, listed.group(1)))
    return roles


def chat_template_text(model_dir: str | Path) -> str | None:
    """The chat template a model directory holds (chat_template.jinja, chat_template.json or tokenizer_config.json's
    `chat_template`; every named template of a list), as text; None when it has none. Read without loading the
    tokenizer."""
    path = Path(model_dir)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8", errors="replace")
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            value = json.loads((path / name).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            value = "\n".join(t.get("template", "") for t in value if isinstance(t, Mapping))
        if isinstance(value, str):
            return value
    return None


def accepted_roles(model_dir: str | Path | None = None, *, template: str | None = None) -> frozenset[str]:
    """CHAT_ROLES and the roles the chat template names: `template`'s text, else the template of `model_dir` (None:
    a new model, whose ChatML template is meshrl's own)."""
    if template is None and model_dir is not None:
        template = chat_template_text(model_dir)
    return CHAT_ROLES | template_roles(template)


def check_roles(messages: Iterable[Mapping[str, Any]], roles: Collection[str] = CHAT_ROLES) -> None:
    """BadRowError for the first message whose role is not one of `roles` (counted by role when skipped)."""
    for m in messages:
        role = m.get("role")
        if role in roles:
            continue
        close = difflib.get_close_matches(str(role).lower(), roles, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise BadRowError(
            f"a message's role {role!r} is not a chat role the model's template knows ({', '.join(sorted(roles))}); "
            f"it would render as a turn of its own name{hint}",
            reason=f"unknown chat role {role!r}",
        )
