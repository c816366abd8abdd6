"""The reward processes — `RewardActor` × `scoring.num_procs`, one process each — as futures-returning calls.

    reward = RewardPool(provision, Rubric({"math_verify": 1.0}), budget=RestartBudget(3), timeout_s=600,
                        heartbeat_s=20)
    reward.start()
    scored = reward.score(texts, [row.verifier_view() for row in rows], group_size=8).result()

A reward process that dies or freezes is replaced and its calls sent again (controller/replicas.py). When the
replacement is lost on the same request too, the request itself is the suspect (a reward function that segfaults,
aborts or hangs holding the interpreter on one sample): it is scored again in a fresh process one function and one
group (then one sample) at a time, and what kills the process is scored 0 and counted as that function's failure
('name: crashed'), named with its row; the run goes on (`RewardPool.isolate`).
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

from meshrl.actors import RewardActor
from meshrl.controller.futures import Pending
from meshrl.controller.provision import Provisioner
from meshrl.controller.replicas import ReplicaCall, ReplicaFailedError, ReplicaLostError, ReplicaPool, RestartBudget
from meshrl.rewards import Rubric, ScoredSample, check_score_inputs


class RewardPool(ReplicaPool):
    """`rewards`: the Rubric every process scores with; its ScoringConfig (`rewards.cfg`) says how many processes."""

    def __init__(
        self, provision: Provisioner, rewards: Rubric, *, budget: RestartBudget, timeout_s: float, heartbeat_s: float
    ) -> None:
        def spawn(i: int) -> tuple[Any, Any]:
            procs = provision.procs("reward", 1)
            return procs, procs.spawn("reward", RewardActor, rewards, i)

        self.rewards = rewards
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

    def isolate(self, call: ReplicaCall, why: str) -> list[ScoredSample]:
        """A `score` request on which two processes in a row were lost: scored again in a fresh process, one
        function and one group at a time (a per-sample function's group that kills it: one sample at a time), so
        that what kills the process is found, scored 0 and counted as that function's failure ('name: crashed'),
        and everything else scores as usual. The losses it explains are not counted against run.max_restarts; more
        than run.max_restarts + 1 samples of one request that kill their process end the run (a function that
        crashes on so many is broken, not unlucky)."""
        completions, rows, group_size = call.args[:3]
        i, weights = call.index, self.rewards.weights
        print(
            f"[meshrl] reward {i}: the replacement was lost on the same request of {len(completions)} samples "
            f"({why}): scoring it again one function and one group at a time in a fresh process, to find what kills it",
            file=sys.stderr,
            flush=True,
        )
        self.replace(i, call.generation, why, charge=False)
        parts = [dict.fromkeys(weights, 0.0) for _ in completions]
        failures: list[dict[str, str]] = [{} for _ in completions]
        crashed: list[tuple[str, int]] = []

        def alone(lo: int, hi: int, g: int, size: int, name: str) -> list[ScoredSample] | str:
            replica = self.replicas[i]
            future = replica.actor.score.call_one(completions[lo:hi], [rows[g]], size, name)
            try:
                return self.wait(i, future, self.timeout_s)
            except ReplicaLostError as e:
                self.replace(i, replica.generation, f"{e} on one sample", charge=False)
                return str(e)

        def crash(j: int, g: int, name: str, lost: str, size: int) -> None:
            crashed.append((name, j))
            if len(crashed) > self.budget.max_restarts + 1:
                raise ReplicaFailedError(
                    f"reward function(s) {sorted({n for n, _ in crashed})} killed the reward process on "
                    f"{len(crashed)} samples of one request (more than run.max_restarts + 1): fix the function"
                )
            for k in range(j, j + size):
                parts[k][name] = 0.0
                failures[k][name] = f"crashed: its reward process {lost}"
            which = f"samples {j}..{j + size - 1} (a group)" if size > 1 else f"sample {j}"
            print(
                f"[meshrl] reward function {name!r} kills its reward process ({lost}) on {which} of the request: "
                f"row {_describe_row(rows[g])}, completion {_short(completions[j])}; scored 0 and counted as its "
                f"failure ('{name}: crashed'), not against run.max_restarts; the run goes on",
                file=sys.stderr,
                flush=True,
            )

        def take(lo: int, name: str, scored: list[ScoredSample]) -> None:
            for k, sample in enumerate(scored, start=lo):
                parts[k][name] = sample.parts[name]
                if name in sample.failures:
                    failures[k][name] = sample.failures[name]

        for g in range(len(rows)):
            lo, hi = g * group_size, (g + 1) * group_size
            for name in weights:
                out = alone(lo, hi, g, group_size, name)
                if not isinstance(out, str):
                    take(lo, name, out)
                elif self.rewards.is_group(name) or group_size == 1:
                    crash(lo, g, name, out, group_size)
                else:  # one of the group's samples: which
                    for j in range(lo, hi):
                        one = alone(j, j + 1, g, 1, name)
                        take(j, name, one) if not isinstance(one, str) else crash(j, g, name, one, 1)
        if crashed:
            self.budget.refund(call.charged)  # the losses on this request were its sample's fault
        return [
            ScoredSample(sum(weights[n] * v for n, v in p.items()), p, f) for p, f in zip(parts, failures, strict=True)
        ]


def _short(text: Any, n: int = 60) -> str:
    text = str(text)
    return repr(text if len(text) <= n else text[:n] + "...")


def _describe_row(row: dict) -> str:
    """A row's answer and prompt (shortened): enough to find it in the data."""
    prompt = row.get("prompt")
    if isinstance(prompt, list):  # chat messages: the last one
        prompt = prompt[-1].get("content", prompt[-1]) if prompt and isinstance(prompt[-1], dict) else prompt
    return f"(answer {_short(row.get('answer'), 40)}, prompt {_short(prompt)})"
