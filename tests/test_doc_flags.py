"""Every `--flag` that README.md and docs/*.md name — in code spans and command blocks — is one that the programs'
parsers accept (issue 31, item 4: `--reasoning-gym.options` was documented but `Unrecognized options`). In process:
one `--help` of each program through `parse_run_config` lists the flags its parser knows; a flag no listing holds is
then passed to each parser on its own, so the shorthands and `--preset` (which `parse_run_config` handles before tyro)
count, and a flag no parser takes fails naming the file, line and the parser's words."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from controller.cli import parse_run_config
from meshrl.config import EvalRunConfig, GRPORunConfig, SFTRunConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = (GRPORunConfig, SFTRunConfig, EvalRunConfig)

OURS = re.compile(r"meshrl\.controller\.(grpo|sft|eval)\b|controller/(grpo|sft|eval)\.py")
# A command of another program: the flags after it, to the next meshrl program, are that program's.
FOREIGN = re.compile(
    r"(\S+\.(py|sh)|meshrl\.controller\.\w+|tensorboard|pytest|pip|docker|torchrun|srun|sbatch|kubectl|uv|git)$"
)
FLAG = re.compile(r"--[a-z][a-z0-9-]*(?:\.[a-z0-9-]*)*(?:/\.[a-z0-9-]+)*")
NOT_OURS = {"--shm-size": "docker run's (a container's /dev/shm)"}


def _commands(text: str) -> list[tuple[int, str]]:
    """(line number, text) of each command block line (continuation lines joined) and each code span."""
    out, fenced, pending = [], False, None
    for n, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            start, body = pending or (n, "")
            body += " " + line.rstrip().removesuffix("\\")
            pending = (start, body) if line.rstrip().endswith("\\") else None
            if pending is None:
                out.append((start, body))
            continue
        out += [(n, span) for span in re.findall(r"`([^`]+)`", line)]
    return out


def _flags(command: str) -> list[str]:
    """The flags of meshrl's programs in one command: quoted values dropped, other programs' flags skipped."""
    command = re.sub(r"'[^']*'|\"[^\"]*\"", " ", command)
    flags, ours = [], True
    for token in command.split():
        if OURS.search(token):
            ours = True
        elif FOREIGN.search(token):
            ours = False
        elif ours and (m := FLAG.match(token)) and m.group() not in NOT_OURS:
            flag, *more = m.group().split("/")  # `--section.a/.b/.c`: three flags of one section
            flags += [flag] + [flag.rsplit(".", 1)[0] + suffix for suffix in more]
    return flags


def documented_flags() -> dict[str, list[str]]:
    """flag -> where the docs name it ("docs/x.md:12")."""
    found: dict[str, list[str]] = {}
    for path in DOCS:
        for line, command in _commands(path.read_text()):
            for flag in _flags(command):
                found.setdefault(flag.split("=", 1)[0], []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def _parse(cls, argv: list[str]) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        parse_run_config(cls, argv=argv)
    return out.getvalue(), err.getvalue()


# An option's first line in `--help`: at the panel's left edge ("│ " boxed, two spaces plain), its description
# indented further below it; a bool flag's two forms on one line ("--data.pack, --data.no-pack").
OPTION = re.compile(r"^(?:│ | {2})(?:-h, )?(--[\w.-]+)(?:, (--[\w.-]+))?")


@pytest.fixture(scope="module")
def listed() -> set[str]:
    """The flags each program's `--help` lists."""
    flags: set[str] = set()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "120")  # one column of panels: each option starts its own line
        for cls in PROGRAMS:
            text, _ = _parse(cls, ["--help"])
            flags |= {f for line in text.splitlines() if (m := OPTION.match(line)) for f in m.groups() if f}
    assert {"--model.path", "--generator.max-model-len", "--data.pack", "--help"} <= flags, sorted(flags)[:20]
    return flags


def _accepted_alone(flag: str) -> str | None:
    """None when some program's parser takes `flag` (given a value); else the last parser's words."""
    words = ""
    for cls in PROGRAMS:
        _, err = _parse(cls, [flag, "x"])
        unrecognized = re.search(r"Unrecognized options: (.*)", err)
        if not (unrecognized and flag in re.split(r"[\s,]+", unrecognized.group(1))):
            return None
        words = unrecognized.group().strip()
    return words


def test_every_flag_the_docs_name_is_accepted(listed):
    found = documented_flags()
    assert len(found) > 50 and "--reasoning-gym.options" in found, sorted(found)
    refused = []
    for flag, where in sorted(found.items()):
        if flag.endswith("."):  # `--data.*`: a section; some flag of it must exist
            if not any(f.startswith(flag) for f in listed):
                refused.append(f"{flag}* ({', '.join(where)}): no flag of this section")
        elif flag not in listed and (words := _accepted_alone(flag)) is not None:
            refused.append(f"{flag} ({', '.join(where)}): {words}")
    assert not refused, "documented flags that no program accepts:\n" + "\n".join(refused)


def test_the_scan_finds_flags_and_skips_other_programs():
    assert _flags("python -m meshrl.controller.grpo --task x --env.kwargs '{\"a\": 1}'") == ["--task", "--env.kwargs"]
    assert _flags("scripts/make_tiny_checkpoint.py --arch qwen3 --out d") == []
    assert _flags("tensorboard --logdir runs/") == []
    assert _flags("--reasoning-gym.size/.eval-size") == ["--reasoning-gym.size", "--reasoning-gym.eval-size"]
    assert _flags('--placement.slurm-args "--constraint=h100"') == ["--placement.slurm-args"]
    assert _accepted_alone("--no-such.flag") is not None and _accepted_alone("--env") is None


def test_reasoning_gym_options_reach_the_dataset_factory():
    opts = {"min_numbers": 3, "max_numbers": 3}
    cfg = parse_run_config(GRPORunConfig, argv=["--task", "reasoning_gym:countdown",
                                                "--reasoning-gym.options", json.dumps(opts)])  # fmt: skip
    assert cfg.reasoning_gym.task_options() == opts
    pytest.importorskip("reasoning_gym")
    from meshrl.tasks import build_task

    cfg.reasoning_gym.size, cfg.reasoning_gym.eval_size = 8, 4
    task = build_task(cfg)
    assert all(len(r.info["metadata"]["numbers"]) == 3 for r in task.train)


@pytest.mark.parametrize(
    "value, says",
    [
        ("{min_numbers: 3}", r"--reasoning-gym.options '\{min_numbers: 3\}' is not JSON"),
        ("[3]", "must be a JSON object"),
    ],
)
def test_reasoning_gym_options_are_validated_naming_the_flag(value, says):
    _, err = _parse(GRPORunConfig, ["--reasoning-gym.options", value])
    assert re.search(says, " ".join(err.split())), err
