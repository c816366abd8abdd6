"""RL sampling (with DAPO's dynamic sampling and overlong shaping) and greedy / pass@k evaluation through the
generators and the reward processes."""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from meshrl.algorithms import informative_groups, overlong_penalty
from meshrl.config import EvalConfig
from meshrl.controller.api import Controller
from meshrl.data.sampler import EpochSampler
from meshrl.rewards import ScoredSample
from meshrl.tasks.setup import TaskSetup
from meshrl.types import Completion, Datum, SamplingParams


def evaluate(
    ctl: Controller,
    setup: TaskSetup,
    cfg: EvalConfig,
    *,
    max_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
) -> dict[str, Any]:
    """Held-out evaluation through the Generator and the reward processes: greedy accuracy and mean reward; with
    `cfg.samples` = k > 0 also mean@k and pass@k (unbiased) over k samples per prompt at the training temperature.
    Correct means `setup.verifier` gives >= 1. Sampling seeds come from `cfg.seed`, not the run's RNG, so evaluating
    never changes what a run trains on."""
    from meshrl.evaluation import summarize

    prompts, views, stop = setup.eval.prompt_ids, setup.eval.views, setup.renderer.stop_token_ids
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop)
    sampled = None
    if cfg.samples:
        sampled = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=cfg.samples,
            stop_token_ids=stop, seed=cfg.seed,
        )  # fmt: skip
    pending_greedy = ctl.generate(prompts, greedy)
    pending_sampled = ctl.generate(prompts, sampled) if sampled else None
    texts = setup.renderer.completion_texts([group[0].token_ids for group in pending_greedy.result()])
    scored = ctl.score(texts, views).result()
    correct = [is_correct(s, setup.verifier) for s in scored]
    record: dict[str, Any] = {
        "accuracy": sum(correct) / len(correct),
        "reward_mean": sum(s.reward for s in scored) / len(scored),
        "reward_failures": sum(bool(s.failures) for s in scored),
        "samples": [
            f"{_prompt_text(row.prompt)}{text}" for row, text in zip(setup.eval.rows[:5], texts[:5], strict=False)
        ],
    }
    if pending_sampled is not None:
        k = cfg.samples
        groups = pending_sampled.result()
        texts_k = setup.renderer.completion_texts([c.token_ids for group in groups for c in group])
        scored_k = ctl.score(texts_k, views, group_size=k).result()
        correct_k = [[is_correct(s, setup.verifier) for s in scored_k[i * k : (i + 1) * k]] for i in range(len(views))]
        record.update(summarize(correct_k, cfg.ks))
        record["reward_failures"] += sum(bool(s.failures) for s in scored_k)
    return record


def is_correct(scored: ScoredSample, verifier: str) -> bool:
    return scored.parts.get(verifier, 0.0) >= 1.0 - 1e-9 and verifier not in scored.failures


def _prompt_text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else str(prompt[-1].get("content", "")) + " -> "


@dataclass
class SampledGroups:
    """What one RL step trains on, group by group (`group_size` completions per prompt)."""

    rows: list[int]  # indices into the training prompts of the groups kept
    drawn: list[int]  # indices of every prompt drawn this step, in order (kept or dropped)
    completions: list[Completion]
    rewards: list[float]  # per completion: task reward + overlong shaping (what advantages are computed from)
    task_rewards: list[float]  # the task reward of EVERY completion generated this step (kept or dropped)
    correct: list[bool]  # the verifier's verdict on every completion generated this step
    reward_failures: dict[str, int]  # "name: timeout" / "name: error" -> samples (scored 0 for that function)
    reward_parts: dict[str, list[float]]  # each reward function's raw value on every completion generated
    prompts_drawn: int
    rounds: int
    groups_dropped: int
    time_generate_s: float
    time_score_s: float
    # Multi-turn runs (controller/episodes.py): the kept episodes in place of `completions`, and their metrics.
    episodes: list[Any] = field(default_factory=list)  # meshrl.envs.rollout.Episode
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.completions or self.episodes)

    def datums(self) -> list[Datum]:
        """One training sequence per completion (loss on it) or per episode (loss on the model's turns)."""
        if self.episodes:
            return [e.tokens.datum() for e in self.episodes]
        return [Datum.from_completion(c.prompt_ids, c.token_ids, c.logprobs) for c in self.completions]

    def lengths(self) -> list[int]:
        """Model tokens per completion / episode."""
        if self.episodes:
            return [e.tokens.num_model_tokens for e in self.episodes]
        return [len(c.token_ids) for c in self.completions]

    def turn_rewards(self) -> list[list[float]] | None:
        return [list(e.outcome.turn_rewards) for e in self.episodes] if self.episodes else None

    @classmethod
    def start(cls) -> SampledGroups:
        return cls([], [], [], [], [], [], Counter(), {}, 0, 0, 0, 0.0, 0.0)

    def add_round(
        self, picks: list[int], samples: list[Any], rewards: list[float], into: list[Any], cfg, want: int
    ) -> None:
        """One sampling round's groups (`samples`: completions or episodes, `group_size` per pick): those DAPO's
        dynamic sampling keeps (every group without it), up to `want` groups in all, go `into` the batch; the
        round is counted either way."""
        g = cfg.group_size
        keep = informative_groups(rewards, g) if cfg.dynamic_sampling else list(range(len(picks)))
        keep = keep[: want - len(self.rows)]
        for i in keep:
            self.rows.append(picks[i])
            into += samples[i * g : (i + 1) * g]
            self.rewards += rewards[i * g : (i + 1) * g]
        self.drawn += picks
        self.prompts_drawn += len(picks)
        self.rounds += 1
        self.groups_dropped += len(picks) - len(keep)

    def trim(self, dp: int, group_size: int) -> None:
        """Drop whole groups from the end until the batch splits evenly over the `dp` trainer ranks."""
        samples = self.episodes or self.completions
        while len(samples) % dp:
            self.rows.pop()
            del samples[-group_size:], self.rewards[-group_size:]


@dataclass
class LaunchedRound:
    """One round of generation sent to the generators: the prompts drawn, its seed, and the completions (a
    `Pending` until they arrive; plain groups once restored from a checkpoint)."""

    picks: list[int]
    seed: int
    pending: Any

    def groups(self) -> list[list[Completion]]:
        return self.pending.result() if hasattr(self.pending, "result") else self.pending

    def state(self) -> dict[str, Any]:
        """Waits for the completions; JSON-able (floats round-trip exactly)."""

        def plain(c: Completion) -> dict[str, Any]:
            return {
                "prompt_ids": [int(t) for t in c.prompt_ids],
                "token_ids": [int(t) for t in c.token_ids],
                "logprobs": [float(x) for x in c.logprobs],
                "finish_reason": c.finish_reason,
                "policy_version": int(c.policy_version),
            }

        return {"picks": list(self.picks), "seed": self.seed, "groups": [[plain(c) for c in g] for g in self.groups()]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LaunchedRound:
        groups = [[Completion(**c) for c in group] for group in state["groups"]]
        return cls(list(state["picks"]), int(state["seed"]), groups)


def launch_round(
    ctl: Controller, setup: TaskSetup, sampler: EpochSampler, rng: random.Random, sampling: SamplingParams, want: int
) -> LaunchedRound:
    """Draw `want` prompts and a seed, and send their generation (returns at once)."""
    picks = sampler.next_indices(want)
    seeded = dataclasses.replace(sampling, seed=rng.getrandbits(32))
    prompts = [setup.train.prompt_ids[i] for i in picks]
    return LaunchedRound(picks, seeded.seed, ctl.generate(prompts, seeded))


def sample_groups(
    ctl: Controller,
    setup: TaskSetup,
    sampler: EpochSampler,
    rng: random.Random,
    sampling: SamplingParams,
    cfg,
    *,
    dp: int,
    first: LaunchedRound | None = None,
) -> SampledGroups:
    """Generate and score `cfg.prompts_per_step` groups (cfg: a GRPOConfig), with DAPO's overlong reward shaping.
    With `cfg.dynamic_sampling`, groups whose rewards are all equal are dropped and refilled from new prompts
    (prompts_per_step more per round, at most `cfg.max_sampling_rounds` rounds): the result never holds an
    all-equal group. If the rounds run out it holds fewer groups, trimmed to a count the `dp` trainer ranks can
    split (possibly none). `first`: the first round, already launched (the asynchronous loop's rollout buffer
    sends it a step or more ahead).

    The prompts come from `sampler` (deterministic shuffled epochs over the training prompts) and each round's
    generation seed from `rng` (the engines derive every sample's noise from it), so restoring both reproduces the
    step exactly — e.g. after a resume."""
    g, want = cfg.group_size, cfg.prompts_per_step
    out = SampledGroups.start()
    while len(out.rows) < want and out.rounds < (cfg.max_sampling_rounds if cfg.dynamic_sampling else 1):
        t0 = time.perf_counter()
        launched = first if first is not None and out.rounds == 0 else None
        launched = launched or launch_round(ctl, setup, sampler, rng, sampling, want)
        picks = launched.picks
        completions = [c for group in launched.groups() for c in group]
        t1 = time.perf_counter()
        texts = setup.renderer.completion_texts([c.token_ids for c in completions])
        scored = ctl.score(texts, [setup.train.views[i] for i in picks], group_size=g).result()
        task_rewards = [s.reward for s in scored]
        for s in scored:
            for name, why in s.failures.items():
                out.reward_failures[f"{name}: {why.split(':')[0]}"] += 1
            for name, value in s.parts.items():
                out.reward_parts.setdefault(name, []).append(value)
        out.correct += [is_correct(s, setup.verifier) for s in scored]
        out.time_generate_s += t1 - t0
        out.time_score_s += time.perf_counter() - t1
        rewards = [
            r + overlong_penalty(len(c.token_ids), sampling.max_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
            for r, c in zip(task_rewards, completions, strict=True)
        ]
        out.add_round(picks, completions, rewards, out.completions, cfg, want)
        out.task_rewards += task_rewards
    out.trim(dp, g)  # a short batch must still split evenly over the trainer ranks
    return out
