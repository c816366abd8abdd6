"""The run's rollouts, one seam for single-turn tasks and environments: draw rows, roll out G episodes each, score
them, keep the groups with a learning signal, trim to the trainer ranks — and evaluate, and run ahead of the
trainer in the asynchronous loop.

    source = SingleTurnRollout(setup)  or  EnvRollout(cfg.env, setup, max_model_len=..., turn_max_tokens=...)
    rollouts = Rollouts(ctl, setup, source, sampling, cfg.grpo, dp=cfg.trainer.num_procs)
    batch = rollouts.sample(sampler, rng)                 # a step's groups (DAPO's dynamic sampling refills)
    record = rollouts.evaluate(cfg.eval, max_tokens=...)  # greedy accuracy, mean@k / pass@k
    ahead = AheadSchedule(rollouts, max_staleness=K, total_steps=N)   # --grpo.max-staleness K
    batch = ahead.next_batch(step, sampler, rng)

A *source* makes one round of episodes from rows (`launch` → `Round`, whose `episodes()` waits for them):
`SingleTurnRollout` in one generator call per round (n = G samples per prompt, the round's seed; a one-turn
episode per sample, `meshrl.rollout.SingleTurnEnv`), `EnvRollout` through `meshrl.rollout.EpisodeRunner` (the
environment's turns, its rewards). Everything after that is one code path: the rubric (the run's reward functions,
in the reward processes) adds its score of each episode's last answer to the environment's reward — a single-turn
task's episodes have only the rubric's — then DAPO's overlong shaping and dynamic sampling, the trim, the metrics.

The prompts come from the sampler (deterministic shuffled epochs) and each round's seed from the run's RNG, so
restoring both reproduces a step exactly — e.g. after a resume.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from meshrl.algorithms import overlong_penalty
from meshrl.data.sampler import EpochSampler
from meshrl.errors import ConfigError
from meshrl.rollout import Episode, EpisodeRenderer, EpisodeTokens, SingleTurnEnv
from meshrl.rollout.batch import RolloutBatch
from meshrl.rollout.runner import EpisodeLimits, EpisodeRunner, EpisodeStats
from meshrl.tasks.setup import PromptSet, TaskSetup
from meshrl.types import Completion, Datum, SamplingParams


# ---- one round of episodes ---------------------------------------------------------------------------------------
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

    def __init__(self, setup: TaskSetup, max_tokens: int) -> None:
        self.setup = setup
        self.max_model_tokens = max_tokens  # DAPO's overlong shaping counts against one turn's budget

    def launch(self, ctl: Any, split: PromptSet, picks: list[int], params: SamplingParams, seed: int | None,
               *, version: int | None = None, background: bool = False) -> Round:  # fmt: skip
        """Send the round's generation (returns at once); `params.n` samples per prompt, seeded with `seed`."""
        params = dataclasses.replace(params, seed=seed)
        pending = ctl.generate([split.prompt_ids[i] for i in picks], params)
        return self._round(split, picks, seed, pending.result)

    def _round(self, split: PromptSet, picks: list[int], seed: int | None, groups: Callable) -> Round:
        completions: list[list[Completion]] = []

        def wait() -> list[Episode]:
            completions[:] = groups()
            flat = [c for group in completions for c in group]
            texts = self.setup.renderer.completion_texts([c.token_ids for c in flat])
            rows = [split.rows[picks[i]] for i, group in enumerate(completions) for _ in group]
            return [SingleTurnEnv.episode_of(r, c, t) for r, c, t in zip(rows, flat, texts, strict=True)]

        def state() -> dict[str, Any]:
            return {"groups": [[_completion_state(c) for c in group] for group in completions]}

        return Round(list(picks), seed, wait, state)

    def restore(self, split: PromptSet, state: dict[str, Any]) -> Round:
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

    def __init__(self, cfg: Any, setup: TaskSetup, *, max_model_len: int, turn_max_tokens: int) -> None:
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

    def runner(self, ctl: Any, limits: EpisodeLimits | None = None, version: int | None = None) -> EpisodeRunner:
        def generate(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
            return ctl.complete(prompts, params) if version is None else ctl.complete(prompts, params, version=version)

        return EpisodeRunner(
            self.make_env, self.renderer, generate, limits or self.limits,
            batches=self.cfg.batches, max_threads=self.cfg.max_threads, group_rewards=self.env_cls.group_rewards,
        )  # fmt: skip

    def launch(self, ctl: Any, split: PromptSet, picks: list[int], params: SamplingParams, seed: int | None,
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

    def restore(self, split: PromptSet, state: dict[str, Any]) -> Round:
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
        return EpisodeStats.of(episodes).values

    def demonstrations(self, setup: TaskSetup, max_len: int) -> list[Datum]:
        """The environment's demonstrations for the supervised warm-up, played through the environment itself (its
        replies fill the turns between) under the episode rules — `--env.timeout-s`, worker threads, a failure
        ends that row's demonstration — and tokenized as episodes: the loss on the demonstrated model turns only."""
        limits = dataclasses.replace(self.limits, max_tokens=min(self.limits.max_tokens, max_len))

        def no_generation(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
            raise RuntimeError("a demonstration is scripted: nothing is generated")

        runner = EpisodeRunner(self.make_env, self.renderer, no_generation, limits, max_threads=self.cfg.max_threads)
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


# ---- sampling, scoring, evaluation -----------------------------------------------------------------------------
class Rollouts:
    """The run's rollouts on the Controller's generators and reward processes (see the module docstring)."""

    def __init__(self, ctl: Any, setup: TaskSetup, source: Any, sampling: SamplingParams, cfg: Any, *, dp: int) -> None:
        self.ctl, self.setup, self.source, self.sampling, self.cfg, self.dp = ctl, setup, source, sampling, cfg, dp
        self.watch = RubricWatch()
        if cfg is not None and len(setup.train) < cfg.prompts_per_step:
            print(
                f"[meshrl] WARNING: the training data has {len(setup.train)} rows, fewer than one step's "
                f"--grpo.prompts-per-step {cfg.prompts_per_step}: every step draws some rows more than once (their "
                "groups then share a prompt); add rows or lower --grpo.prompts-per-step",
                file=sys.stderr,
                flush=True,
            )

    def launch(self, sampler: EpochSampler, rng: random.Random, *, background: bool = False) -> Round:
        """Draw a round's rows and seed, and send it (returns at once)."""
        picks = sampler.next_indices(self.cfg.prompts_per_step)
        seed = rng.getrandbits(32)
        version = self.ctl.policy_version if background else None
        return self.source.launch(self.ctl, self.setup.train, picks, self.sampling, seed, version=version,
                                  background=background)  # fmt: skip

    def restore_round(self, state: dict[str, Any]) -> Round:
        return self.source.restore(self.setup.train, state)

    def sample(self, sampler: EpochSampler, rng: random.Random, *, first: Round | None = None) -> RolloutBatch:
        """`cfg.prompts_per_step` groups of `cfg.group_size` episodes (cfg: a GRPOConfig), with DAPO's overlong
        shaping. With `cfg.dynamic_sampling`, groups whose rewards are all equal are dropped and refilled from new
        rows (prompts_per_step more per round, at most `cfg.max_sampling_rounds` rounds): the result never holds
        an all-equal group. If the rounds run out it holds fewer groups, trimmed to a count the trainer ranks can
        split (possibly none). `first`: the first round, already launched (the asynchronous schedule's)."""
        cfg, g = self.cfg, self.cfg.group_size
        out = RolloutBatch(multi_turn=self.source.multi_turn)
        everything: list[Episode] = []
        while len(out.groups) < cfg.prompts_per_step and out.rounds < (
            cfg.max_sampling_rounds if cfg.dynamic_sampling else 1
        ):
            t0 = time.perf_counter()
            launched = first if first is not None and out.rounds == 0 else self.launch(sampler, rng)
            episodes = launched.episodes()
            t1 = time.perf_counter()
            self.score(episodes, self.setup.train, launched.picks, g, out)
            out.time_generate_s += t1 - t0
            out.time_score_s += time.perf_counter() - t1
            rewards = [
                e.outcome.reward + overlong_penalty(e.tokens.num_model_tokens, self.source.max_model_tokens,
                                                    cfg.overlong_buffer, cfg.overlong_penalty)
                for e in episodes
            ]  # fmt: skip
            out.add_round(launched.picks, episodes, rewards, cfg, cfg.prompts_per_step)
            everything += episodes
        out.trim(self.dp)  # a short batch must still split evenly over the trainer ranks
        self.watch.step(everything)
        out.metrics = self.source.stats(everything)  # episodes: turns, tool calls, environment time, finish reasons
        return out

    def score(
        self, episodes: list[Episode], split: PromptSet, picks: list[int], g: int, into: RolloutBatch | None = None
    ) -> None:
        """The rubric's score of each episode's last answer (the reward processes), added to the environment's
        reward; the verdict (an environment's own, else the verifier's >= 1); failures and parts counted `into`."""
        setup = self.setup
        scored = None
        if setup.rewards is not None or not self.source.multi_turn:  # one-turn episodes have only the rubric
            texts = [e.answer_text for e in episodes]
            scored = self.ctl.score(texts, [split.views[i] for i in picks], group_size=g).result()
        for k, e in enumerate(episodes):
            out = e.outcome
            if scored is not None:
                s = scored[k]
                if out.error is None:  # an episode that failed scores 0
                    out.reward += s.reward
                    out.reward_parts = dict(s.parts)
                if not self.source.multi_turn:
                    out.correct = is_correct(s, setup.verifier)
                    out.turn_rewards = [out.reward]
                for name, why in s.failures.items():
                    out.reward_failures[name] = why
            if into is None:
                continue
            into.task_rewards.append(out.reward)
            into.correct.append(out.correct)
            if out.error is not None:
                into.reward_failures[out.finish_reason] += 1
            for name, why in out.reward_failures.items():
                into.reward_failures[f"{name}: {why.split(':')[0]}"] += 1
            for name, value in out.reward_parts.items():
                into.reward_parts.setdefault(name, []).append(value)

    def evaluate(self, cfg: Any, *, max_tokens: int, temperature: float, top_p: float = 1.0,
                 top_k: int = -1) -> dict[str, Any]:  # fmt: skip
        """Held-out evaluation (cfg: an EvalConfig): greedy accuracy and mean reward; with `cfg.samples` = k > 0
        also mean@k and pass@k (unbiased) over k samples per row at the training temperature. Sampling seeds come
        from `cfg.seed`, never the run's RNG, so evaluating never changes what a run trains on."""
        from meshrl.evaluation import summarize

        split, stop = self.setup.eval, self.setup.renderer.stop_token_ids
        rows = list(range(len(split)))
        greedy_seed, sampled_seed = self.source.eval_seeds(cfg.seed)
        greedy = self.source.launch(self.ctl, split, rows,
                                    SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop),
                                    greedy_seed)  # fmt: skip
        sampled = None
        if cfg.samples:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    n=cfg.samples, stop_token_ids=stop)  # fmt: skip
            sampled = self.source.launch(self.ctl, split, rows, params, sampled_seed)
        episodes = greedy.episodes()
        self.score(episodes, split, rows, 1)
        record: dict[str, Any] = {
            "accuracy": sum(e.outcome.correct for e in episodes) / len(episodes),
            "reward_mean": sum(e.outcome.reward for e in episodes) / len(episodes),
            "reward_failures": sum(_failed(e) for e in episodes),
            **self.source.stats(episodes),
            "samples": [self.source.describe(e) for e in episodes[:5]],
        }
        if sampled is not None:
            k = cfg.samples
            episodes = sampled.episodes()
            self.score(episodes, split, rows, k)
            correct = [[e.outcome.correct for e in episodes[i * k : (i + 1) * k]] for i in range(len(rows))]
            record.update(summarize(correct, cfg.ks))
            record["reward_failures"] += sum(_failed(e) for e in episodes)
            # How the policy behaves when it samples (e.g. how often it calls a tool), beside the greedy figures.
            stats = self.source.stats(episodes)
            record.update({f"sampled/{name}": v for name, v in stats.items() if name.startswith(("env/", "turns"))})
        return record


class RubricWatch:
    """Says once, loudly, what a step's metrics alone would hide: a reward function that failed on more than half
    of a step's samples (with its first exception), and one that scored exactly 0 on every sample of a step and
    has never scored anything else (a function that misreads its arguments scores 0 without failing)."""

    def __init__(self) -> None:
        self.scored_nonzero: set[str] = set()
        self.said: set[tuple[str, str]] = set()

    def step(self, episodes: Sequence[Episode]) -> None:
        names = {name for e in episodes for name in e.outcome.reward_parts} | {
            name for e in episodes for name in e.outcome.reward_failures
        }
        for name in sorted(names):
            failures = [e.outcome.reward_failures[name] for e in episodes if name in e.outcome.reward_failures]
            values = [e.outcome.reward_parts.get(name, 0.0) for e in episodes if name not in e.outcome.reward_failures]
            if any(v != 0.0 for v in values):
                self.scored_nonzero.add(name)
            if len(failures) > len(episodes) / 2:
                self._say(name, "fails", f"reward function {name!r} failed on {len(failures)} of {len(episodes)} "
                          f"samples this step (scored 0 for them); the first: {failures[0]}")  # fmt: skip
            elif values and name not in self.scored_nonzero:
                self._say(name, "zero", f"reward function {name!r} scored exactly 0 on all {len(values)} samples "
                          "this step and has never scored anything else. If the policy can reach it, check that it "
                          "reads its arguments as fn(completion: str, row: dict) -> float (the answer is "
                          "row['answer'])")  # fmt: skip

    def _say(self, name: str, what: str, message: str) -> None:
        if (name, what) in self.said:
            return
        self.said.add((name, what))
        rule = "!" * 100
        print(f"{rule}\n[meshrl] WARNING: {message} (said once)\n{rule}", file=sys.stderr, flush=True)


def _failed(episode: Episode) -> bool:
    return episode.outcome.error is not None or bool(episode.outcome.reward_failures)


def is_correct(scored: Any, verifier: str) -> bool:
    """A rubric's verdict: the verifier function gave >= 1 (and did not fail)."""
    return scored.parts.get(verifier, 0.0) >= 1.0 - 1e-9 and verifier not in scored.failures


def sample_groups(ctl: Any, setup: TaskSetup, sampler: EpochSampler, rng: random.Random, sampling: SamplingParams,
                  cfg: Any, *, dp: int, source: Any = None) -> RolloutBatch:  # fmt: skip
    """One step's groups (`Rollouts.sample`) without building the `Rollouts` first; `source` defaults to the task's
    rows as one-turn episodes."""
    source = source or SingleTurnRollout(setup, sampling.max_tokens)
    return Rollouts(ctl, setup, source, sampling, cfg, dp=dp).sample(sampler, rng)


def evaluate(ctl: Any, setup: TaskSetup, cfg: Any, *, max_tokens: int, temperature: float, top_p: float = 1.0,
             top_k: int = -1, source: Any = None) -> dict[str, Any]:  # fmt: skip
    """Held-out evaluation (`Rollouts.evaluate`) for programs without a training loop (sft, eval)."""
    source = source or SingleTurnRollout(setup, max_tokens)
    sampling = SamplingParams(max_tokens=max_tokens)
    return Rollouts(ctl, setup, source, sampling, None, dp=1).evaluate(
        cfg, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k
    )


# ---- the asynchronous schedule -----------------------------------------------------------------------------------
class AheadSchedule:
    """The asynchronous loop's schedule (`--grpo.max-staleness K`, K >= 1): generation runs ahead of training by
    at most K policy versions.

    Before training step t the rounds of steps t+1 .. t+K are already out, from the weights of steps t-K+1 .. t:
    the generators sample the next steps while the trainer trains this one. The trainer's new weights are
    published once per step, and the generators' `pull_weights` is queued behind the calls they are serving (an
    actor serves its calls in order), so each single-turn round is sampled from exactly the version the schedule
    says. An environment's round makes its calls turn by turn, so it runs in a background thread with every call
    pinned to its launch version, and it is finished before the next version is published: either way the run is
    reproducible, and resumable bitwise (the rounds in flight at a checkpoint are waited for and saved with it).

        step t:   [finish env rounds] → publish v_t → send round t+K (from v_t) → wait for round t → score → train

    A sample's staleness is the trainer's version when it trains minus the version that generated it: 0 for the
    first K steps' rounds generated before RL started moving, then exactly K, and 0 for dynamic sampling's refill
    rounds (generated when they are needed). Groups older than K versions are dropped and counted, never trained
    silently (the schedule never makes one; a resumed run with a larger K could)."""

    def __init__(self, rollouts: Rollouts, *, max_staleness: int, total_steps: int) -> None:
        self.rollouts, self.max_staleness, self.total_steps = rollouts, max_staleness, total_steps
        self.ctl = rollouts.ctl
        self.ahead: dict[int, Round] = {}

    def next_batch(self, step: int, sampler: EpochSampler, rng: random.Random) -> RolloutBatch:
        """Step `step`'s groups: first send what the schedule asks for (the trainer's weights, then the rounds of
        steps up to step + K), then wait for this step's round and score it (refilled by dynamic sampling)."""
        self.finish_in_flight()
        self.ctl.sync_weights(wait=False)  # v_step, queued behind the generators' work; no-op if already there
        for s in range(step, min(step + self.max_staleness, self.total_steps - 1) + 1):
            if s not in self.ahead:
                self.ahead[s] = self.rollouts.launch(sampler, rng, background=True)
        batch = self.rollouts.sample(sampler, rng, first=self.ahead.pop(step))
        return self._drop_stale(batch)

    def finish_in_flight(self) -> None:
        """Call before publishing new weights: an environment's rounds in flight finish on the weights they started
        with (a single-turn round's one call is queued ahead of the load already)."""
        if self.rollouts.source.multi_turn:
            for launched in self.ahead.values():
                launched.episodes()

    def _drop_stale(self, batch: RolloutBatch) -> RolloutBatch:
        """Staleness per trained sample (in the batch's metrics), and the groups over K dropped, counted."""
        version = self.ctl.policy_version
        kept = [g for g in batch.groups if version - g.oldest_version <= self.max_staleness]
        dropped = len(batch.groups) - len(kept)
        batch.groups = kept
        batch.trim(self.rollouts.dp)
        staleness = [version - min(e.tokens.policy_versions, default=version) for e in batch.episodes]
        batch.metrics.update(
            {
                "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
                "staleness_max": max(staleness, default=0),
                "staleness_hist": {str(k): staleness.count(k) for k in sorted(set(staleness))},
                "groups_dropped_stale": dropped,
            }
        )
        return batch

    def state(self) -> dict[str, Any]:
        """The rounds in flight, waited for: a checkpoint holds them, so a resumed run trains on exactly these."""
        return {str(step): r.state() for step, r in sorted(self.ahead.items())}

    def restore(self, state: dict[str, Any]) -> None:
        self.ahead = {int(step): self.rollouts.restore_round(r) for step, r in state.items()}
