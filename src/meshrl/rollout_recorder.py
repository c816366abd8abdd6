"""What the policy actually wrote: every `log.rollouts_every` RL steps, one JSON line per trained sample in
`<run dir>/rollouts.jsonl` — the first file to open when an RL run goes wrong (reward hacking, empty answers,
a verifier that never fires, a stale policy version).

A line of a single-completion run:

    {"step": 7, "policy_version": 47, "prompt_index": 12, "group": 0, "sample": 3, "reward": 0.5,
     "reward_parts": {"exact_match": 0.0, "char_match": 1.0}, "correct": false, "advantage": -0.41,
     "reward_trained": 0.5, "finish_reason": "stop", "length": 5, "prompt": "abc=", "answer": "cba",
     "completion": "cbb"}

`policy_version` is the version of the weights that sampled the completion (the asynchronous loop trains on
older ones); `reward` is the task's reward and `reward_trained` the one advantages were computed from (after
overlong shaping and KL-in-reward). An episode of an environment (`--env`) has its `messages`, `turns`,
`turn_rewards` and `error` in place of `completion`. Only the trained groups are written: those dynamic sampling
or the staleness bound dropped never reach the loss.

On resume the file is cut back to the steps before the checkpoint (they run again), as metrics.jsonl is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROLLOUTS_FILE = "rollouts.jsonl"


class RolloutRecorder:
    """Appends a step's trained samples to `<run_path>/rollouts.jsonl` every `every` RL steps (0: never). The file
    keeps only the lines of steps before `start_step` (the step a resumed run starts from; 0: a fresh run)."""

    def __init__(self, run_path: str | Path, every: int, *, start_step: int = 0) -> None:
        self.path = Path(run_path) / ROLLOUTS_FILE
        self.every = every
        truncate_rollouts(self.path, start_step)

    def write(self, step: int, batch: Any, rewards: Sequence[float], advantages: Sequence[Any]) -> None:
        """`batch`: the step's RolloutBatch (meshrl.rollout.batch); `rewards` / `advantages`: per trained sample,
        as the loss gets them."""
        if not self.every or step % self.every:
            return
        lines = rollout_lines(step, batch, rewards, advantages)
        with self.path.open("a") as f:
            f.writelines(json.dumps(line, default=_plain) + "\n" for line in lines)


def rollout_lines(step: int, batch: Any, rewards: Sequence[float], advantages: Sequence[Any]) -> list[dict[str, Any]]:
    """One dict per trained episode of `batch` (a meshrl.rollout.batch.RolloutBatch), in training order. Its
    scores are the episode's own (reward, the rubric's parts, the verdict), so a row drawn twice in a step keeps
    them too."""
    lines = []
    pairs = [(group, j, episode) for group, g in enumerate(batch.groups) for j, episode in enumerate(g.episodes)]
    for i, (group, sample, episode) in enumerate(pairs):
        out, versions = episode.outcome, sorted(episode.tokens.policy_versions)
        line = {
            "step": step,
            "policy_version": versions[0] if versions else None,
            **({"policy_versions": versions} if len(versions) > 1 else {}),
            "prompt_index": batch.groups[group].index,
            "group": group,
            "sample": sample,
            "reward": out.reward,
            **({"reward_parts": dict(out.reward_parts)} if out.reward_parts else {}),
            "correct": out.correct,
            "advantage": advantages[i],
            "reward_trained": rewards[i],
            "finish_reason": out.finish_reason,
            "length": episode.tokens.num_model_tokens,
            "prompt": out.row.prompt,
            "answer": out.row.answer,
        }
        if batch.multi_turn:
            line |= {"turns": out.num_turns, "turn_rewards": list(out.turn_rewards), "error": out.error,
                     "messages": out.messages}  # fmt: skip
        else:
            line["completion"] = episode.answer_text
        lines.append(line)
    return lines


def truncate_rollouts(path: str | Path, step: int) -> None:
    """Drop the lines of steps >= `step` (a resumed run writes them again)."""
    path = Path(path)
    if not path.is_file():
        return
    with path.open() as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] < step]
    path.write_text("".join(kept))


def read_rollouts(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / ROLLOUTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (an episode's per-token advantages) as JSON; anything else as its str (a line is
    for reading: it never stops a run)."""
    return value.tolist() if hasattr(value, "tolist") else str(value)
