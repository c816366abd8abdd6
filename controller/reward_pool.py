"""The reward processes — `RewardActor` × `scoring.num_procs`, one process each — as futures-returning calls.

    reward = RewardPool(provision, Rubric({"math_verify": 1.0}), budget=RestartBudget(3), timeout_s=600,
                        heartbeat_s=20)
    reward.start()
    scored = reward.score(texts, [row.verifier_view() for row in rows], group_size=8).result()

A reward process that dies or freezes is replaced and its calls sent again (controller/replicas.py).
"""

from __future__ import annotations

import itertools
from typing import Any

from meshrl.actors import RewardActor
from meshrl.controller.futures import Pending
from meshrl.controller.provision import Provisioner
from meshrl.controller.replicas import ReplicaPool, RestartBudget
from meshrl.rewards import Rubric, ScoredSample, check_score_inputs


class RewardPool(ReplicaPool):
    """`rewards`: the Rubric every process scores with; its ScoringConfig (`rewards.cfg`) says how many processes."""

    def __init__(
        self, provision: Provisioner, rewards: Rubric, *, budget: RestartBudget, timeout_s: float, heartbeat_s: float
    ) -> None:
        def spawn(i: int) -> tuple[Any, Any]:
            procs = provision.procs("reward", 1)
            return procs, procs.spawn("reward", RewardActor, rewards, i)

        super().__init__(
            "reward", rewards.cfg.num_procs, spawn, budget=budget, timeout_s=timeout_s, heartbeat_s=heartbeat_s
        )

    def score(self, completions: list[str], rows: list[dict], group_size: int = 1) -> Pending[list[ScoredSample]]:
        """Rewards of completion texts, `group_size` consecutive completions per row (`Row.verifier_view()` dicts),
        split by rows over the reward processes; results in completion order. Token ids or answer strings in
        place of texts and row dicts are refused here (they would score 0 on every sample)."""
        check_score_inputs(completions, rows, group_size)
        if len(completions) != len(rows) * group_size:
            raise ValueError(f"{len(completions)} completions for {len(rows)} rows x group_size={group_size}")
        n = len(self)
        bounds = [len(rows) * i // n for i in range(n + 1)]
        futures = [
            self.send(i, "score", completions[lo * group_size : hi * group_size], rows[lo:hi], group_size)
            for i, (lo, hi) in enumerate(itertools.pairwise(bounds))
            if hi > lo
        ]
        return Pending(futures, lambda parts: [s for part in parts for s in part], self.timeout_s, "score")
