"""The run's rollouts, one seam for single-turn tasks and environments: draw rows, roll out G episodes each, score
them, keep the groups with a learning signal, trim to the trainer ranks — and evaluate, and run ahead of the
trainer in the asynchronous loop.

    source = SingleTurnRollout(setup, max_tokens)  or  EnvRollout(cfg.env, setup, ...)   (meshrl.rollout.sources)
    rollouts = Rollouts(ctl, setup, source, sampling, cfg.grpo, dp=cfg.trainer.num_procs)
    batch = rollouts.sample(sampler, rng)                 # a step's groups (DAPO's dynamic sampling refills)
    record = rollouts.evaluate(cfg.eval, max_tokens=...)  # greedy accuracy, mean@k / pass@k
    ahead = AheadSchedule(rollouts, max_staleness=K, total_steps=N)   # --grpo.max-staleness K
    batch = ahead.next_batch(step, sampler, rng)

A *source* (meshrl.rollout.sources) makes one round of episodes from rows: `SingleTurnRollout` in one generator
call per round (n = G samples per prompt, the round's seed; a one-turn episode per sample), `EnvRollout` through
`EpisodeRunner` (the environment's turns, its rewards). Everything after that is one code path, here: the rubric
(the run's reward functions, in the reward processes) adds its score of each episode's last answer to the
environment's reward — a single-turn task's episodes have only the rubric's — then DAPO's overlong shaping and
dynamic sampling, the trim, the metrics.

The prompts come from the sampler (deterministic shuffled epochs) and each round's seed from the run's RNG, so
restoring both reproduces a step exactly — e.g. after a resume.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from meshrl.algorithms import overlong_penalty
from meshrl.data.sampler import EpochSampler
from meshrl.rollout import Episode
from meshrl.rollout.batch import RolloutBatch
from meshrl.rollout.sources import EnvRollout, Round, SingleTurnRollout  # noqa: F401 - EnvRollout: re-exported
from meshrl.tasks.setup import PromptSet, TaskSetup
from meshrl.types import SamplingParams


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
