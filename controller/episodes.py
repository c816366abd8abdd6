"""Multi-turn rollouts for the GRPO loop: episodes of an environment in place of single completions.

The loop calls the same three things it calls for a single-turn task — sample a step's groups, evaluate, make
warm-up demonstrations — and gets the same shapes back (`SampledGroups`, an eval record, `Datum`s), so
`controller/grpo.py` reads the same with an environment in it. The episode machinery (batching, timeouts,
token-in/token-out bridging) is library code in `meshrl.envs`; this file binds it to the Controller's generators.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

from meshrl.algorithms import overlong_penalty
from meshrl.controller.api import Controller
from meshrl.controller.rollouts import SampledGroups
from meshrl.data.sampler import EpochSampler
from meshrl.envs import EnvConfig
from meshrl.envs.base import as_messages, maybe_await
from meshrl.envs.episode import EpisodeRenderer, EpisodeTokens
from meshrl.envs.rollout import Episode, EpisodeLimits, EpisodeRunner, EpisodeStats
from meshrl.errors import ConfigError
from meshrl.tasks.base import Row
from meshrl.tasks.setup import TaskSetup
from meshrl.types import Datum, SamplingParams


class EpisodeRollout:
    """A run's environment: `sample` a step's episode groups, `evaluate` on held-out rows, `demonstrations` for
    the supervised warm-up."""

    def __init__(self, cfg: EnvConfig, setup: TaskSetup, *, max_model_len: int, turn_max_tokens: int) -> None:
        self.cfg = cfg
        self.env_cls, self.make_env = cfg.factory()
        self.renderer = EpisodeRenderer(setup.renderer)
        self.limits = EpisodeLimits(
            max_turns=cfg.max_turns,
            max_tokens=cfg.max_tokens or max_model_len,
            turn_max_tokens=turn_max_tokens,
            timeout_s=cfg.timeout_s,
        )

    @property
    def max_model_tokens(self) -> int:
        """The most model tokens an episode can hold (what DAPO's overlong shaping and constant-normaliser
        aggregations count against)."""
        return min(self.limits.max_tokens, self.limits.max_turns * self.limits.turn_max_tokens)

    def runner(self, ctl: Controller, limits: EpisodeLimits | None = None) -> EpisodeRunner:
        return EpisodeRunner(
            self.make_env,
            self.renderer,
            ctl.complete,  # cohorts call it from worker threads
            limits or self.limits,
            batches=self.cfg.batches,
            max_threads=self.cfg.max_threads,
            group_rewards=self.env_cls.group_rewards,
        )

    def sample(
        self,
        ctl: Controller,
        setup: TaskSetup,
        sampler: EpochSampler,
        rng: random.Random,
        sampling: SamplingParams,
        cfg,
        *,
        dp: int,
    ) -> SampledGroups:
        """`cfg.prompts_per_step` groups of `cfg.group_size` episodes (cfg: a GRPOConfig), with DAPO's dynamic
        sampling and overlong shaping as for single completions (`controller.rollouts.sample_groups`)."""
        g, want = cfg.group_size, cfg.prompts_per_step
        out = SampledGroups.start()
        runner = self.runner(ctl)
        everything: list[Episode] = []
        while len(out.rows) < want and out.rounds < (cfg.max_sampling_rounds if cfg.dynamic_sampling else 1):
            picks = sampler.next_indices(want)
            t0 = time.perf_counter()
            episodes = runner.run([setup.train.rows[i] for i in picks], g, sampling, seed=rng.getrandbits(32))
            out.time_generate_s += time.perf_counter() - t0
            everything += episodes
            task_rewards = [e.outcome.reward for e in episodes]
            rewards = [
                r + overlong_penalty(e.tokens.num_model_tokens, self.max_model_tokens, cfg.overlong_buffer,
                                     cfg.overlong_penalty)
                for r, e in zip(task_rewards, episodes, strict=True)
            ]  # fmt: skip
            out.add_round(picks, episodes, rewards, out.episodes, cfg, want)
            out.task_rewards += task_rewards
            out.correct += [e.outcome.correct for e in episodes]
            for e in episodes:
                if e.outcome.error is not None:
                    out.reward_failures[e.outcome.finish_reason] += 1
        out.trim(dp, g)  # a short batch must still split evenly over the trainer ranks
        out.metrics = EpisodeStats.of(everything).values  # time_generate_s: the episodes' wall time, env included
        return out

    def evaluate(self, ctl: Controller, setup: TaskSetup, cfg, *, max_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = -1) -> dict[str, Any]:  # fmt: skip
        """Held-out episodes: greedy accuracy (the environment's verdict) and reward, the episode metrics, and with
        `cfg.samples` = k mean@k / pass@k. Seeds from `cfg.seed`, never the run's RNG."""
        from meshrl.evaluation import summarize

        rows = list(setup.eval.rows)
        runner = self.runner(ctl, dataclasses.replace(self.limits, turn_max_tokens=max_tokens))
        stop = setup.renderer.stop_token_ids
        greedy = runner.run(rows, 1, SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop),
                            seed=cfg.seed)  # fmt: skip
        record: dict[str, Any] = {
            "accuracy": sum(e.outcome.correct for e in greedy) / len(greedy),
            "reward_mean": sum(e.outcome.reward for e in greedy) / len(greedy),
            "reward_failures": sum(e.outcome.error is not None for e in greedy),
            **EpisodeStats.of(greedy).values,
            "samples": [transcript(e) for e in greedy[:5]],
        }
        if cfg.samples:
            k = cfg.samples
            sampled = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                     stop_token_ids=stop)  # fmt: skip
            episodes = runner.run(rows, k, sampled, seed=cfg.seed + 1)
            correct = [[e.outcome.correct for e in episodes[i * k : (i + 1) * k]] for i in range(len(rows))]
            record.update(summarize(correct, cfg.ks))
            # How the policy behaves when it samples (e.g. how often it calls a tool), beside the greedy figures.
            stats = EpisodeStats.of(episodes).values
            record.update({f"sampled/{name}": v for name, v in stats.items() if name.startswith(("env/", "turns"))})
        return record

    def demonstrations(self, setup: TaskSetup, max_len: int) -> list[Datum]:
        """The environment's demonstrations, played through the environment itself (its replies fill the turns
        between) and tokenized as episodes: the loss on the demonstrated model turns only."""
        limits = dataclasses.replace(self.limits, max_tokens=min(self.limits.max_tokens, max_len))

        async def all_rows() -> list[EpisodeTokens | None]:
            return await asyncio.gather(*(scripted_episode(self.make_env(), r, self.renderer, limits)
                                          for r in setup.train.rows))  # fmt: skip

        data = [t.datum(with_logprobs=False) for t in asyncio.run(all_rows()) if t is not None]
        if not data:
            raise ConfigError(
                f"--env {self.cfg.name}: no training row has a demonstration that fits in {limits.max_tokens} "
                "tokens, so there is nothing to warm up on; set --warmup.steps 0 (or implement "
                "Environment.demonstration)"
            )
        return data


async def scripted_episode(env, row: Row, renderer: EpisodeRenderer, limits: EpisodeLimits) -> EpisodeTokens | None:
    """`env.demonstration(row)` played as an episode (None: no demonstration, or it does not fit)."""
    demo = env.demonstration(row)
    if not demo:
        return None
    opening = await maybe_await(env.reset(row, 0))
    messages, ids = renderer.opening(row, None if opening is None else as_messages(opening))
    tokens = EpisodeTokens()
    tokens.add_context(ids)
    for turn, text in enumerate(demo[: limits.max_turns]):
        turn_ids = renderer.scripted_turn_ids(text)
        tokens.add_scripted(turn_ids)
        messages.append({"role": "assistant", "content": text})
        result = await maybe_await(env.step(text))
        if result.done or turn + 1 == len(demo):
            break
        observation = as_messages(result.observation)
        tokens.add_context(renderer.bridge_ids(messages, observation, turn_ids))
        messages += observation
    return tokens if len(tokens.tokens) <= limits.max_tokens else None


def transcript(episode: Episode) -> str:
    """An episode as text, for the eval record's samples."""
    return " | ".join(f"{m['role']}: {m['content']}" for m in episode.outcome.messages)
