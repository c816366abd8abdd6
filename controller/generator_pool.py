"""The generators — `Generator` × `generator.num_replicas`, one process each — as futures-returning calls.

    generators = GeneratorPool(provision, model_dir, generator_cfg, seed, weights=weights, budget=RestartBudget(3),
                               timeout_s=600, heartbeat_s=20)   # spawned; the engines build meanwhile
    generators.start()                                          # each replica's info
    groups = generators.generate(prompt_ids, SamplingParams(n=8), version=0).result()

A replica that dies or freezes is replaced and its calls sent again (controller/replicas.py); the replacement is
brought to the run's state: the weights the others serve (`WeightSync.bring_up`) and their sleep level.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from meshrl.actors import Generator
from meshrl.controller.futures import Pending
from meshrl.controller.provision import Provisioner
from meshrl.controller.replicas import ReplicaPool, RestartBudget
from meshrl.controller.weight_sync import WeightSync
from meshrl.types import Completion, SamplingParams


class GeneratorPool(ReplicaPool):
    """`cfg`: the GeneratorConfig. `weights`: the run's weight sync (its queued loads are waited on with the next
    `generate`; None: nothing loads weights). `replaceable` False: a failed replica ends the run instead (the
    asynchronous loop)."""

    def __init__(
        self,
        provision: Provisioner,
        model_dir: str,
        cfg: Any,
        seed: int,
        *,
        weights: WeightSync | None,
        budget: RestartBudget,
        timeout_s: float,
        heartbeat_s: float,
        replaceable: bool = True,
    ) -> None:
        def spawn(i: int) -> tuple[Any, Any]:
            procs = provision.procs("generator", 1)
            return procs, procs.spawn("generator", Generator, model_dir, cfg, seed, i)

        self.cfg, self.weights = cfg, weights
        self.info: list[Any] = []  # each replica's `setup` result, once started
        self.asleep = 0  # the sleep level the generators are at (a replacement is put there too)
        self._submit = threading.Lock()  # `complete` from several threads
        super().__init__(
            "generator", cfg.num_replicas, spawn, budget=budget, timeout_s=timeout_s, heartbeat_s=heartbeat_s,
            setup="setup", bring_up=self._bring_up, replaceable=replaceable,
        )  # fmt: skip

    def start(self) -> list[Any]:
        self.info = super().start()
        return self.info

    def _bring_up(self, i: int) -> None:
        """A replacement generator joins the run: the weights the others serve, and their sleep level."""
        self.info[i] = self.replicas[i].info
        if self.weights is not None:
            self.weights.bring_up(i)
        if self.asleep:
            self.actor(i).sleep.call_one(self.asleep).get(timeout=self.timeout_s)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, version: int,
        images: list[tuple[bytes, ...]] | None = None,
    ) -> Pending[list[list[Completion]]]:  # fmt: skip
        """Spread prompts over the replicas; completions come back in prompt order, each stamped with the policy
        version that produced it (checked to be `version`). `images`: per prompt, its encoded images (None: a
        text-only call); they go with their prompt to its replica."""
        # Loads queued by sync(wait=False) run before this call on every generator: wait on them with it, so that a
        # failed load fails this call (with its own message) instead of passing unnoticed.
        loads = self.weights.take_loads_in_flight() if self.weights is not None else []
        n = len(self)
        shards = [prompts[i::n] for i in range(n)]
        futures = [
            self.send(i, "generate", shard, self.replica_params(params, i, len(prompts)), version,
                      *([images[i::n]] if images is not None else []))
            for i, shard in enumerate(shards)
            if shard
        ]  # fmt: skip
        load_calls = [call for _, calls in loads for call in calls]

        def interleave(parts: list[Any]) -> list[list[Completion]]:
            WeightSync.check_loaded(loads, parts[: len(load_calls)])
            parts = parts[len(load_calls) :]
            out: list[list[Completion]] = [None] * len(prompts)  # type: ignore[list-item]
            for i, part in enumerate(parts):
                out[i::n] = part
            return out

        return Pending(load_calls + futures, interleave, self.timeout_s, "generate")

    def complete(
        self, prompts: list[list[int]], params: SamplingParams, version: int,
        images: list[tuple[bytes, ...]] | None = None,
    ) -> list[Completion]:  # fmt: skip
        """One completion per prompt (params.n is 1), waited for. Safe to call from several threads at once, as
        the episode runner's cohorts do: the calls are sent one at a time and waited on together."""
        with self._submit:
            pending = self.generate(prompts, params, version, images)
        return [group[0] for group in pending.result()]

    @staticmethod
    def replica_params(params: SamplingParams, replica: int, num_prompts: int) -> SamplingParams:
        """Engines give sample j of their prompt i the seed params.seed + i·n + j; offset the seed per replica
        by the size of the whole call so that no two replicas draw the same noise."""
        if params.seed is None or replica == 0:
            return params
        return dataclasses.replace(params, seed=params.seed + replica * num_prompts * params.n)

    def prompt_logprobs(
        self, sequences: list[list[int]], images: list[tuple[bytes, ...]] | None = None
    ) -> Pending[list[list[float]]]:
        """Generator-side logprobs of fixed sequences (replica 0), for parity checks against `forward`."""
        fut = self.send(0, "prompt_logprobs", sequences, *([images] if images is not None else []))
        return Pending([fut], lambda v: v[0], self.timeout_s, "prompt_logprobs")

    def sleep(self, level: int = 1) -> None:
        """Every generator releases its KV cache (level 2: its weights too) until `wake` (controller/memory.py: the
        colocated hand-off). Weight loads still reach a generator asleep at level 1."""
        Pending(self.send_all("sleep", level), lambda v: None, self.timeout_s, "Generator.sleep").result()
        self.asleep = level

    def wake(self) -> None:
        Pending(self.send_all("wake_up"), lambda v: None, self.timeout_s, "Generator.wake_up").result()
        self.asleep = 0

    def memory(self) -> list[dict[str, float]]:
        """Each generator's device memory (GiB): allocated / reserved now, peak since the last call."""
        return Pending(self.send_all("memory"), list, self.timeout_s, "Generator.memory").result()
