"""Where a round of episodes comes from: a *source* turns rows into `group_size` episodes per row.

    source = SingleTurnRollout(setup, max_tokens)            # a task's rows as one-turn episodes
    source = EnvRollout(env_cfg, setup, max_model_len=..., turn_max_tokens=...)   # an environment's episodes
    round_ = source.launch(ctl, setup.train, picks, sampling, seed)   # sent; returns at once
    episodes = round_.episodes()                                      # waited for

`SingleTurnRollout` makes one generator call per round (n = G samples per prompt, the round's seed) and an
episode of one turn per sample (`SingleTurnEnv.episode_of`); `EnvRollout` plays the environment's turns through
`EpisodeRunner`. `ctl` is anything with the Controller's `generate` / `complete` (no Monarch imports here). The
round loop that scores, filters and trims them is `controller/rollouts.py`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from meshrl.errors import ConfigError
from meshrl.rollout.episode import Episode, EpisodeRenderer, EpisodeTokens
from meshrl.rollout.runner import EpisodeLimits, EpisodeRunner, EpisodeStats
from meshrl.rollout.single_turn import SingleTurnEnv
from meshrl.types import Completion, Datum, SamplingParams


@dataclass
class Round:
    """One round of episodes sent out: the rows drawn (indices into their split), its seed, and how to get the
    episodes (`group_size` per pick, laid out pick by pick)."""

    picks: list[int]
    seed: int | None
    wait: Callable[[], list[Episode]]
    state_of: Callable[[], dict[str, Any]] | None = None  # the source's JSON form of the finished round
    _episodes: list[Episode] | None = None

    def episodes(self) -> list[Episode]:
        if self._episodes is None:
            self._episodes = self.wait()
        return self._episodes

    def state(self) -> dict[str, Any]:
        """Waits for the episodes; JSON-able (floats round-trip exactly)."""
        self.episodes()
        return {"picks": list(self.picks), "seed": self.seed, **self.state_of()}


class SingleTurnRollout:
    """A task's rows as one-turn episodes: one generator call of n = G samples per prompt per round."""

    multi_turn = False

    def __init__(self, setup: Any, max_tokens: int) -> None:
        self.setup = setup
        self.max_model_tokens = max_tokens  # DAPO's overlong shaping counts against one turn's budget

    def launch(self, ctl: Any, split: Any, picks: list[int], params: SamplingParams, seed: int | None,
               *, version: int | None = None, background: bool = False) -> Round:  # fmt: skip
        """Send the round's generation (returns at once); `params.n` samples per prompt, seeded with `seed`."""
        params = dataclasses.replace(params, seed=seed)
        images = split.images_of(picks)
        prompts = [split.prompt_ids[i] for i in picks]
        pending = ctl.generate(prompts, params) if images is None else ctl.generate(prompts, params, images=images)
        return self._round(split, picks, seed, pending.result)

    def _round(self, split: Any, picks: list[int], seed: int | None, groups: Callable) -> Round:
        completions: list[list[Completion]] = []

        def wait() -> list[Episode]:
            completions[:] = groups()
            flat = [c for group in completions for c in group]
            texts = self.setup.renderer.completion_texts([c.token_ids for c in flat])
            rows = [split.rows[picks[i]] for i, group in enumerate(completions) for _ in group]
            images = split.images_of(picks) or [()] * len(picks)
            per_sample = [images[i] for i, group in enumerate(completions) for _ in group]
            return [
                SingleTurnEnv.episode_of(r, c, t, im) for r, c, t, im in zip(rows, flat, texts, per_sample, strict=True)
            ]

        def state() -> dict[str, Any]:
            return {"groups": [[_completion_state(c) for c in group] for group in completions]}

        return Round(list(picks), seed, wait, state)

    def restore(self, split: Any, state: dict[str, Any]) -> Round:
        groups = [[Completion(**c) for c in group] for group in state["groups"]]
        return self._round(split, list(state["picks"]), state["seed"], lambda: groups)

    def eval_seeds(self, seed: int) -> tuple[int | None, int]:
        return None, seed  # greedy: unseeded; k samples: eval.seed

    def describe(self, episode: Episode) -> str:
        prompt = episode.outcome.row.prompt
        shown = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", "")) + " -> "
        return f"{shown}{episode.answer_text}"

    def stats(self, episodes: Sequence[Episode]) -> dict[str, float]:
        return {}


def _completion_state(c: Completion) -> dict[str, Any]:
    return {
        "prompt_ids": [int(t) for t in c.prompt_ids],
        "token_ids": [int(t) for t in c.token_ids],
        "logprobs": [float(x) for x in c.logprobs],
        "finish_reason": c.finish_reason,
        "policy_version": int(c.policy_version),
    }


class EnvRollout:
    """An environment's episodes (`--env`): `EpisodeRunner` on the Controller's generators. In the asynchronous
    loop a round runs in a background thread while the trainer trains, every call pinned to the weights version
    it was launched with."""

    multi_turn = True

    def __init__(self, cfg: Any, setup: Any, *, max_model_len: int, turn_max_tokens: int) -> None:
        self.cfg = cfg  # an EnvConfig
        self.setup = setup
        self.env_cls, self.make_env = cfg.factory()
        self.renderer = EpisodeRenderer(setup.renderer)
        self.limits = EpisodeLimits(
            max_turns=cfg.max_turns,
            max_tokens=cfg.max_tokens or max_model_len,
            turn_max_tokens=turn_max_tokens,
            timeout_s=cfg.timeout_s,
        )
        self.max_model_tokens = min(self.limits.max_tokens, self.limits.max_turns * self.limits.turn_max_tokens)
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshrl-rounds")
        # The environment processes (--env.workers; started at the first episode), or None: the controller's threads.
        self.envs = cfg.processes()

    def runner(self, ctl: Any, limits: EpisodeLimits | None = None, version: int | None = None) -> EpisodeRunner:
        def generate(prompts: list[list[int]], params: SamplingParams, *images: Any) -> list[Completion]:
            pinned = {} if version is None else {"version": version}
            return ctl.complete(prompts, params, **pinned, **({"images": images[0]} if images else {}))

        return EpisodeRunner(
            self.make_env, self.renderer, generate, limits or self.limits,
            batches=self.cfg.batches, max_threads=self.cfg.max_threads, group_rewards=self.env_cls.group_rewards,
            envs=self.envs,
        )  # fmt: skip

    def launch(self, ctl: Any, split: Any, picks: list[int], params: SamplingParams, seed: int | None,
               *, version: int | None = None, background: bool = False) -> Round:  # fmt: skip
        """`params.n` episodes per row. `background`: start now in a thread (calls pinned to `version`); else they
        run when the round's episodes are asked for."""
        limits = (
            self.limits
            if params.max_tokens == self.limits.turn_max_tokens
            else dataclasses.replace(self.limits, turn_max_tokens=params.max_tokens)
        )
        runner = self.runner(ctl, limits, version)
        rows = [split.rows[i] for i in picks]
        run = lambda: runner.run(rows, params.n, params, seed=seed)  # noqa: E731
        wait = self._background.submit(run).result if background else run
        round_: Round

        def state() -> dict[str, Any]:
            return {"episodes": [e.state() for e in round_.episodes()]}

        round_ = Round(list(picks), seed, wait, state)
        return round_

    def restore(self, split: Any, state: dict[str, Any]) -> Round:
        picks, n = list(state["picks"]), len(state["episodes"]) // max(1, len(state["picks"]))
        episodes = [Episode.from_state(s, split.rows[picks[i // n]]) for i, s in enumerate(state["episodes"])]
        round_ = Round(picks, state["seed"], lambda: episodes)
        round_.state_of = lambda: {"episodes": [e.state() for e in episodes]}
        return round_

    def eval_seeds(self, seed: int) -> tuple[int | None, int]:
        return seed, seed + 1

    def describe(self, episode: Episode) -> str:
        return " | ".join(f"{m['role']}: {m['content']}" for m in episode.outcome.messages)

    def stats(self, episodes: Sequence[Episode]) -> dict[str, float]:
        values = EpisodeStats.of(episodes).values
        replaced = self.envs.take_replaced() if self.envs is not None else 0
        if replaced:  # environment processes killed (a step holding the interpreter) or dead since the last stats
            values["env_processes_replaced"] = replaced
        return values

    def close(self) -> None:
        """Stops the environment processes (they also stop when this object is dropped, and with the controller)."""
        if self.envs is not None:
            self.envs.close()

    def demonstrations(self, setup: Any, max_len: int) -> list[Datum]:
        """The environment's demonstrations for the supervised warm-up, played through the environment itself (its
        replies fill the turns between) under the episode rules — `--env.timeout-s`, worker threads, a failure
        ends that row's demonstration — and tokenized as episodes: the loss on the demonstrated model turns only."""
        limits = dataclasses.replace(self.limits, max_tokens=min(self.limits.max_tokens, max_len))

        def no_generation(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
            raise RuntimeError("a demonstration is scripted: nothing is generated")

        runner = EpisodeRunner(
            self.make_env, self.renderer, no_generation, limits, max_threads=self.cfg.max_threads, envs=self.envs
        )
        played = runner.demonstrations(setup.train.rows)
        failed = [(i, p) for i, p in enumerate(played) if isinstance(p, str)]
        if failed:
            kinds = Counter(p.split(":")[0] for _, p in failed)
            print(
                f"[meshrl] WARNING: warm-up: the environment failed on {len(failed)} of {len(played)} training rows' "
                f"demonstrations ({', '.join(f'{k} {n}' for k, n in kinds.items())}; first: train row "
                f"{failed[0][0] + 1}: {failed[0][1]}); they are skipped (--env.timeout-s {limits.timeout_s:g})",
                file=sys.stderr,
                flush=True,
            )
        data = [p.datum(with_logprobs=False) for p in played if isinstance(p, EpisodeTokens)]
        if not data:
            why = f"; the environment failed on {len(failed)} of them (see above)" if failed else ""
            raise ConfigError(
                f"--env {self.cfg.name}: no training row has a demonstration that fits in {limits.max_tokens} "
                f"tokens{why}, so there is nothing to warm up on; set --warmup.steps 0 (or implement "
                "Environment.demonstration)"
            )
        return data
