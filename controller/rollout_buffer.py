"""The asynchronous GRPO loop's schedule: generation runs ahead of training by at most K policy versions.

With `--grpo.max-staleness K` (K >= 1), before training step t the groups of steps t+1 .. t+K are already being
generated, from the weights of step t - K + 1 .. t: the generators sample the next steps while the trainer trains
this one. Nothing here waits for a generator in order to sync: the trainer's new weights are published once per
step and the generators' `pull_weights` is queued behind the batches they are already generating (an actor serves
its calls in order), so each batch is sampled from exactly the version the schedule says, however fast or slow the
trainer and the generators are. That makes the run reproducible — and resumable bitwise: the rounds in flight at a
checkpoint are waited for and saved with it.

    step t:   publish v_t (queued pull) → send round t+K (from v_t) → wait for round t → score → train → v_{t+1}

A sample's staleness is the trainer's version when it trains minus the version that generated it (every completion
carries `policy_version`): 0 for the first K steps' rounds generated before RL started moving, then exactly K, and
0 for the refill rounds of dynamic sampling (generated when they are needed). Groups older than K versions are
dropped and counted, never trained silently (the schedule never makes one; a resumed run with a larger K could).
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from meshrl.controller.api import Controller
from meshrl.controller.rollouts import LaunchedRound, SampledGroups, launch_round, sample_groups
from meshrl.data.sampler import EpochSampler
from meshrl.tasks.setup import TaskSetup
from meshrl.types import SamplingParams


class RolloutBuffer:
    """The rounds of generation sent ahead of the trainer, by step."""

    def __init__(
        self,
        ctl: Controller,
        setup: TaskSetup,
        sampling: SamplingParams,
        cfg: Any,
        *,
        dp: int,
        total_steps: int,
    ) -> None:
        self.ctl, self.setup, self.sampling, self.cfg = ctl, setup, sampling, cfg  # cfg: a GRPOConfig
        self.dp, self.total_steps = dp, total_steps
        self.max_staleness = cfg.max_staleness
        self.ahead: dict[int, LaunchedRound] = {}

    def next_batch(self, step: int, sampler: EpochSampler, rng: random.Random) -> SampledGroups:
        """Step `step`'s groups: first send what the schedule asks for (the trainer's weights, then the rounds of
        steps up to step + K), then wait for this step's round and score it (refilled by dynamic sampling)."""
        self.ctl.sync_weights(wait=False)  # v_step, queued behind the generators' work; no-op if already there
        for s in range(step, min(step + self.max_staleness, self.total_steps - 1) + 1):
            if s not in self.ahead:
                want = self.cfg.prompts_per_step
                self.ahead[s] = launch_round(self.ctl, self.setup, sampler, rng, self.sampling, want)
        first = self.ahead.pop(step)
        batch = sample_groups(self.ctl, self.setup, sampler, rng, self.sampling, self.cfg, dp=self.dp, first=first)
        return self._drop_stale(batch)

    def _drop_stale(self, batch: SampledGroups) -> SampledGroups:
        """Staleness per trained sample (in the batch's metrics), and the groups over K dropped, counted."""
        g, version = self.cfg.group_size, self.ctl.policy_version
        staleness = [version - c.policy_version for c in batch.completions]
        keep = [i for i in range(len(batch.rows)) if max(staleness[i * g : (i + 1) * g]) <= self.max_staleness]
        dropped = len(batch.rows) - len(keep)
        if dropped:
            batch.rows = [batch.rows[i] for i in keep]
            batch.completions = [c for i in keep for c in batch.completions[i * g : (i + 1) * g]]
            batch.rewards = [r for i in keep for r in batch.rewards[i * g : (i + 1) * g]]
            staleness = [s for i in keep for s in staleness[i * g : (i + 1) * g]]
            while len(batch.completions) % self.dp:
                batch.rows.pop()
                del batch.completions[-g:], batch.rewards[-g:], staleness[-g:]
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
        self.ahead = {int(step): LaunchedRound.from_state(r) for step, r in state.items()}
