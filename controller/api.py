"""The small Controller API that `grpo` and `sft` are written in, and that users can drive from Python.

It spawns the actor meshes (PolicyTrainer × trainer.num_procs, Generator × generator.num_replicas,
RewardActor × scoring.num_procs) on this host and exposes their endpoints as calls that return `Pending` results:
start several, then `.result()` them, so generation, scoring, training and weight transfer can overlap. Every wait
has a timeout, so a dead actor fails the run instead of hanging it. Generator and reward processes are replaced
when they die or freeze, their requests sent again (controller/replicas.py); a dead trainer ends the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import monarch.actor

from meshrl.actors import Generator, PolicyTrainer, RewardActor
from meshrl.controller.futures import ActorDiedError, Pending, _rank0  # noqa: F401 - ActorDiedError: re-exported
from meshrl.controller.provision import Provisioner
from meshrl.controller.replicas import ReplicaPool, RestartBudget, WatchedMesh
from meshrl.controller.weight_sync import WeightSync, WeightSyncTiming
from meshrl.devices import machine_identity
from meshrl.rewards import RewardSet, ScoredSample
from meshrl.types import (
    Completion,
    Datum,
    ForwardBackwardResult,
    LossSpec,
    OptimParams,
    OptimResult,
    SamplingParams,
)
from meshrl.weight_sync.shared_buffer import remove_stale_files
from meshrl.weight_sync.store import init_weight_store, shutdown_weight_store
from meshrl.weight_sync.transport import DEFAULT_STORE, SHARED_BUFFER_TRANSPORTS

T = TypeVar("T")
_controller_ids = itertools.count()


def padding_id(tokenizer: Any, model_dir: str) -> int:
    """The padding id: the given tokenizer's (a transformers tokenizer or meshrl's CharTokenizer), else the model
    directory's tokenizer's, else its EOS (padding is never a target, any id in the vocabulary does)."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for attr in ("pad_token_id", "pad_id", "eos_token_id", "eos_id"):
        if isinstance(value := getattr(tokenizer, attr, None), int):
            return value
    return 0


def _export_import_path() -> None:
    """Actor processes inherit PYTHONPATH: put the controller's script directory and working directory on it, so
    that user code named by import path (rewards, losses, tasks) imports in every process as it does here."""
    import sys

    extra = [p for p in (os.getcwd(), sys.path[0] if sys.path and sys.path[0] else None) if p]
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(current + extra))


class Controller:
    """The run's actor meshes on this host, as futures-returning calls.

        with Controller(model_dir="ckpt/", model_cfg=ModelConfig(backend="hf"), trainer_cfg=TrainerConfig(),
                        generator_cfg=GeneratorConfig(), rewards=RewardSet({"math_verify": 1.0})) as ctl:
            groups = ctl.generate(prompt_ids, SamplingParams(n=8)).result()

    `rewards`: a RewardSet (or a name -> weight dict) scored by `ScoringConfig.num_procs` reward processes; None:
    no reward processes. `tokenizer` is optional: the padding id comes from it, else from the model directory."""

    def __init__(
        self,
        *,
        model_dir: str,
        model_cfg,
        trainer_cfg,
        generator_cfg,
        rewards: RewardSet | dict[str, float] | None = None,
        tokenizer: Any = None,
        seed: int = 0,
        call_timeout_s: float = 600.0,
        reward_weights: dict[str, float] | None = None,
        max_restarts: int = 3,
        heartbeat_s: float = 20.0,
        placement: Any = None,
    ) -> None:
        from monarch.spmd import setup_torch_elastic_env

        from meshrl.config import check_weight_sync

        if generator_cfg is not None:
            check_weight_sync(trainer_cfg, generator_cfg)  # before anything is spawned
        if rewards is None and reward_weights is not None:  # the older keyword
            rewards = reward_weights
        if rewards is not None and not isinstance(rewards, RewardSet):
            rewards = RewardSet(dict(rewards))  # resolves every name now: a bad one fails before any spawn
        self.model_dir, self.generator_cfg, self.timeout_s = str(model_dir), generator_cfg, call_timeout_s
        self.model_cfg, self.trainer_cfg = model_cfg, trainer_cfg
        pad_id = padding_id(tokenizer, self.model_dir)
        self._model_args = (model_cfg, trainer_cfg, pad_id)  # for a ReferenceModel started later
        self.reference, self.reference_procs = None, 0
        # Monarch's default reaction to a dead actor process is to exit the controller (KeyboardInterrupt in the
        # main thread). We record the failure instead; the waiting call raises ActorDiedError, and the program
        # ends with a message naming the last good checkpoint.
        self.failures: list[str] = []
        self._submit = threading.Lock()  # `complete` from several threads
        self._episode_renderers: dict[str, Any] = {}  # run_episodes: render config -> EpisodeRenderer
        monarch.actor.unhandled_fault_hook = lambda failure: self.failures.append(str(failure))
        _export_import_path()
        remove_stale_files()  # left by an earlier run whose trainer or controller was SIGKILLed
        # Every process mesh comes from the provisioner: this machine, or Monarch workers on other hosts.
        self.provision = placement if isinstance(placement, Provisioner) else Provisioner(placement)
        # Models and engines build in parallel; a program without generation (SFT on files) spawns no generator,
        # one without training (evaluation of a checkpoint) no trainer: its generators load `model_dir` as it is.
        self._procs, self.trainer, trainer_ready = [], None, None
        self._trainer_elsewhere = False  # a trainer rank on another machine (its pid is not ours to kill)
        # Generator and reward processes are replaced when they die or freeze, within one run-wide budget.
        self.restarts = RestartBudget(max_restarts)
        pool_kw = dict(budget=self.restarts, timeout_s=call_timeout_s, heartbeat_s=heartbeat_s)
        if trainer_cfg is not None:
            self._procs.append(self.provision.procs("trainer", trainer_cfg.num_procs))
            setup_torch_elastic_env(self._procs[0])  # RANK/WORLD_SIZE/MASTER_ADDR for torch.distributed
            from meshrl.actors.heartbeat import Heartbeat

            # Not replaceable (its ranks hold the optimiser state), but watched: a frozen rank ends the run named as
            # frozen within heartbeat_s of a call waiting on it (controller/replicas.py).
            self.trainer = WatchedMesh(
                self._procs[0].spawn("trainer", PolicyTrainer, self.model_dir, model_cfg, trainer_cfg, pad_id),
                self._procs[0].spawn("heartbeat", Heartbeat),
                what=f"a trainer process ({trainer_cfg.num_procs} ranks)",
                heartbeat_s=heartbeat_s,
                on_frozen=self._kill_trainer,
            )
            trainer_ready = Pending(  # unwatched: its heartbeat may still be starting while the model loads
                [self.trainer.mesh.setup.call()], lambda v: list(v[0].values()), call_timeout_s, "PolicyTrainer.setup"
            )
        self.generators = self.reward = None
        # A store of its own: two Controllers in one process (tests, a user's script) never see each other's
        # versions, and shutting one down leaves the other's store alone.
        self.store_name = f"{DEFAULT_STORE}-{os.getpid()}-{next(_controller_ids)}"
        self.num_replicas, self.generator_info = 0, []
        self.weights: WeightSync | None = None  # trainer -> generators (controller/weight_sync.py)
        if generator_cfg is not None:
            if generator_cfg.weight_sync not in SHARED_BUFFER_TRANSPORTS:  # 'auto' may end up needing it
                # One storage volume per trainer rank, on the trainer's host: each rank puts its own shards into a
                # process of its own, next to it, and generators fetch from all of them (weight_sync/store.py).
                volumes = trainer_cfg.num_procs if trainer_cfg is not None else 1
                host = self.provision.host("trainer") if trainer_cfg is not None else None
                asyncio.run(init_weight_store(self.store_name, host=host, num_volumes=volumes))

            def spawn_generator(i: int) -> tuple[Any, Any]:
                procs = self.provision.procs("generator", 1)
                return procs, procs.spawn("generator", Generator, self.model_dir, generator_cfg, seed, i)

            self.generators = ReplicaPool(
                "generator", generator_cfg.num_replicas, spawn_generator, setup="setup", **pool_kw
            )
            self.num_replicas = generator_cfg.num_replicas
        self.num_reward_procs = 0
        if rewards is not None:
            self.num_reward_procs = rewards.cfg.num_procs

            def spawn_reward(i: int) -> tuple[Any, Any]:
                procs = self.provision.procs("reward", 1)
                return procs, procs.spawn("reward", RewardActor, rewards, i)

            self.reward = ReplicaPool("reward", self.num_reward_procs, spawn_reward, **pool_kw)
        self.trainer_info, self.trainer_pids = {"policy_version": 0}, []
        if trainer_ready is not None:
            infos = trainer_ready.result()
            self.trainer_info, self.trainer_pids = infos[0], [i["pid"] for i in infos]
            self._trainer_elsewhere = any(i.get("machine") != machine_identity() for i in infos)
        if generator_cfg is not None:
            self.generator_info = self.generators.start()
            if self.trainer is not None:
                self._start_weight_sync(generator_cfg.weight_sync)
            self.generators.bring_up = self._bring_up_generator
        if self.reward is not None:
            self.reward.start()
        self.policy_version = self.trainer_info["policy_version"]
        self.generators_asleep = 0  # the sleep level the generators are at (a replacement is put there too)

    def _kill_trainer(self) -> None:
        """A frozen trainer rank cannot stop itself, and the others wait for it in a collective: kill them all (the
        run ends; its checkpoints are on disk)."""
        import signal

        self.failures.append("trainer frozen")
        if self._trainer_elsewhere:
            # Its pids are another machine's: Monarch's host agents there stop the processes (not waited on).
            self._procs[0].stop()
            return
        for pid in self.trainer_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _bring_up_generator(self, i: int) -> None:
        """A replacement generator joins the run: the weights the others serve, and their sleep level."""
        self.generator_info[i] = self.generators.replicas[i].info
        if self.weights is not None:
            self.weights.bring_up(i)
        if self.generators_asleep:
            self.generators.actor(i).sleep.call_one(self.generators_asleep).get(timeout=self.timeout_s)

    @property
    def replicas_restarted(self) -> int:
        """Generator and reward processes replaced so far (run.max_restarts bounds them)."""
        return self.restarts.used

    def _start_weight_sync(self, requested: str) -> None:
        """The run's one weight-sync object, its transport resolved against where the processes actually run."""
        self.weights = WeightSync(
            self.trainer, self.generators, self.generator_cfg.dtype, self.store_name, self.timeout_s
        )
        trainer = self.trainer_info["device_identity"]
        try:
            self.weights.start(trainer, [g["device_identity"] for g in self.generator_info], requested)
        except Exception:
            self.shutdown()  # a placement that cannot do what was asked: fail at launch, leave no processes
            raise

    @property
    def weight_transport(self) -> str | None:
        return None if self.weights is None else self.weights.transport

    @property
    def versions_kept(self) -> int:
        """torchstore versions kept while generators' loads are queued (the asynchronous loop sets K + 1)."""
        return self.weights.versions_kept if self.weights is not None else 2

    @versions_kept.setter
    def versions_kept(self, n: int) -> None:
        if self.weights is not None:
            self.weights.versions_kept = n

    # ---- trainer ------------------------------------------------------------------------------------------
    def forward_backward(
        self, data: list[Datum], loss: LossSpec, step: OptimParams | None = None, split: list[int] | None = None
    ) -> Pending[ForwardBackwardResult]:
        """`step`: this call ends an optimiser step and takes it (result in `.optim`; see Policy.forward_backward).
        `split`: how many of `data` (rank-major) each trainer rank computes; None: an even split."""

        def done(values: list[Any]) -> ForwardBackwardResult:
            result: ForwardBackwardResult = _rank0(values)
            if result.optim is not None:
                self.policy_version = result.optim.policy_version
            return result

        return Pending(
            [self.trainer.forward_backward.call(data, loss, step, split)], done, self.timeout_s, "forward_backward"
        )

    def forward(
        self, data: list[Datum], temperature: float = 1.0, split: list[int] | None = None
    ) -> Pending[list[list[float]]]:
        return Pending([self.trainer.forward.call(data, temperature, split)], _rank0, self.timeout_s, "forward")

    def token_budget(self) -> int:
        """Tokens per trainer rank and `forward_backward` call: trainer.max_tokens_per_micro_batch, or when unset what
        the tightest rank's device can hold now (Policy.token_budget)."""
        if self.trainer_cfg.max_tokens_per_micro_batch is not None:
            return self.trainer_cfg.max_tokens_per_micro_batch
        budgets = Pending(
            [self.trainer.token_budget.call()], lambda v: list(v[0].values()), self.timeout_s, "token_budget"
        )
        return min(budgets.result())

    def micro_batch_plan(self, lengths: list[int], max_seqs: int | None = None) -> list[list[list[int]]]:
        """Sequences (by length) -> `forward_backward` calls -> per-rank indices, under `token_budget()` and at most
        `max_seqs` sequences per call (meshrl.batching.plan_micro_batches; `split=rank_sizes(call)`)."""
        from meshrl.batching import plan_micro_batches

        tc = self.trainer_cfg
        return plan_micro_batches(
            lengths, num_ranks=tc.num_procs, max_tokens=self.token_budget(), max_seqs=max_seqs,
            pack=tc.pack_sequences, row_len=tc.pack_row_len,
        )  # fmt: skip

    def trainer_memory(self) -> list[dict[str, float]]:
        """Each trainer rank's device memory (GiB): allocated / reserved now, peak since the last call."""
        return Pending([self.trainer.memory.call()], lambda v: list(v[0].values()), self.timeout_s, "memory").result()

    def release_trainer_memory(self) -> int:
        """Every trainer rank's cached allocator blocks back to the device (bytes released, summed)."""
        call = self.trainer.release_cached_memory.call()
        return Pending([call], lambda v: sum(v[0].values()), self.timeout_s, "release_cached_memory").result()

    def offload_optimizer_state(self) -> Pending[int]:
        """The trainer's AdamW state to host memory until its next forward_backward / optim_step (bytes moved)."""
        return Pending(
            [self.trainer.offload_optimizer_state.call()], lambda v: sum(v[0].values()), self.timeout_s, "offload"
        )

    def optim_step(self, params: OptimParams) -> Pending[OptimResult]:
        def done(values: list[Any]) -> OptimResult:
            result: OptimResult = _rank0(values)
            self.policy_version = result.policy_version
            return result

        return Pending([self.trainer.optim_step.call(params)], done, self.timeout_s, "optim_step")

    def trainer_peak_memory_gib(self) -> float | None:
        """The largest peak device memory of any trainer rank since it started (None for trainers on CPU)."""
        infos = Pending([self.trainer.info.call()], lambda v: list(v[0].values()), self.timeout_s, "info").result()
        peaks = [i["peak_memory_gib"] for i in infos if i["peak_memory_gib"] is not None]
        return max(peaks) if peaks else None

    def save_checkpoint(self, path: str) -> None:
        """The trainer's full state (model + optimiser, torch DCP) into `path` (see meshrl.checkpoint for the
        atomic run checkpoints that also hold the controller's state)."""
        Pending([self.trainer.save_checkpoint.call(path)], _rank0, self.timeout_s, "save_checkpoint").result()

    def load_checkpoint(self, path: str) -> int:
        """Restore the trainer's full state, or — for an HF checkpoint dir — just its weights. Returns the policy
        version now held by the trainer."""
        from meshrl.checkpoint import is_hf_dir

        endpoint = self.trainer.load_hf if is_hf_dir(path) else self.trainer.load_checkpoint
        self.policy_version = Pending([endpoint.call(path)], _rank0, self.timeout_s, "load_checkpoint").result()
        return self.policy_version

    def export_hf(self, path: str, dtype: str | None = None) -> str:
        """The trainer's weights as an HF checkpoint (config, safetensors, tokenizer), written atomically."""
        return Pending([self.trainer.export_hf.call(path, dtype)], _rank0, self.timeout_s, "export_hf").result()

    # ---- reference model (KL) -----------------------------------------------------------------------------
    def start_reference(self, model_dir: str, num_procs: int = 1) -> None:
        """Spawn the ReferenceModel mesh: a frozen, forward-only copy of the policy loaded from `model_dir` (an HF
        checkpoint dir), FSDP-sharded over `num_procs` processes. Only programs with a KL term need it."""
        from monarch.spmd import setup_torch_elastic_env

        from meshrl.actors.reference import ReferenceModel

        if self.reference is not None:
            raise RuntimeError("the reference model is already running")
        procs = self.provision.procs("reference", num_procs)
        self._procs.append(procs)
        setup_torch_elastic_env(procs)
        self.reference = procs.spawn("reference", ReferenceModel, str(model_dir), *self._model_args)
        self.reference_procs = num_procs
        Pending([self.reference.setup.call()], _rank0, self.timeout_s, "ReferenceModel.setup").result()

    def reference_logprobs(self, data: list[Datum], temperature: float = 1.0) -> Pending[list[list[float]]]:
        """Reference-model logprobs of every datum's targets (any batch size: padded to the mesh, then dropped)."""
        self._need("a reference model (start_reference)", self.reference)
        n = len(data)
        padded = list(data) + [data[-1]] * ((-n) % self.reference_procs)
        fut = self.reference.forward.call(padded, temperature)
        return Pending([fut], lambda v: _rank0(v)[:n], self.timeout_s, "ReferenceModel.forward")

    # ---- weights ------------------------------------------------------------------------------------------
    def sync_weights(self, version: int | None = None, *, wait: bool = True) -> WeightSyncTiming:
        """Push the trainer's weights under `version` (default: the current policy version) and make every
        generator load them. Returns when all generators serve exactly that version; with `wait=False` as soon as
        the weights are published: the generators' load is queued behind the calls they are already serving (an
        actor serves its calls in order), so it happens between their batches and the next `generate` uses it —
        the asynchronous loop never waits for a batch to end in order to sync. A queued load's failure surfaces in
        the next `generate` result."""
        self._need("generators", self.generators)
        self._need("a trainer", self.trainer)
        return self.weights.sync(self.policy_version if version is None else version, wait=wait)

    # ---- generation and scoring ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Pending[list[list[Completion]]]:
        """Spread prompts over the generator replicas; completions come back in prompt order, each stamped
        with the policy version that produced it (checked to be the current one)."""
        self._need("generators", self.generators)
        # Loads queued by sync_weights(wait=False) run before this call on every generator: wait on them with it,
        # so that a failed load fails this call (with its own message) instead of passing unnoticed.
        loads = self.weights.take_loads_in_flight() if self.weights is not None else []
        shards = [prompts[i :: self.num_replicas] for i in range(self.num_replicas)]
        futures = [
            self.generators.send(
                i, "generate", shard, self._replica_params(params, i, len(prompts)), self.policy_version
            )
            for i, shard in enumerate(shards)
            if shard
        ]
        load_calls = [call for _, calls in loads for call in calls]

        def interleave(parts: list[Any]) -> list[list[Completion]]:
            WeightSync.check_loaded(loads, parts[: len(load_calls)])
            parts = parts[len(load_calls) :]
            out: list[list[Completion]] = [None] * len(prompts)  # type: ignore[list-item]
            for i, part in enumerate(parts):
                out[i :: self.num_replicas] = part
            return out

        return Pending(load_calls + futures, interleave, self.timeout_s, "generate")

    def complete(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt (params.n is 1), waited for. Safe to call from several threads at once, as
        the episode runner's cohorts do: the calls are sent one at a time and waited on together."""
        with self._submit:
            pending = self.generate(prompts, params)
        return [group[0] for group in pending.result()]

    @staticmethod
    def _replica_params(params: SamplingParams, replica: int, num_prompts: int) -> SamplingParams:
        """Engines give sample j of their prompt i the seed params.seed + i·n + j; offset the seed per replica
        by the size of the whole call so that no two replicas draw the same noise."""
        if params.seed is None or replica == 0:
            return params
        return dataclasses.replace(params, seed=params.seed + replica * num_prompts * params.n)

    def prompt_logprobs(self, sequences: list[list[int]]) -> Pending[list[list[float]]]:
        """Generator-side logprobs of fixed sequences (replica 0), for parity checks against `forward`."""
        self._need("generators", self.generators)
        fut = self.generators.send(0, "prompt_logprobs", sequences)
        return Pending([fut], lambda v: v[0], self.timeout_s, "prompt_logprobs")

    def sleep_generators(self, level: int = 1) -> None:
        """Every generator releases its KV cache (level 2: its weights too) until `wake_generators` (controller/
        memory.py: the colocated hand-off). Weight loads still reach a generator asleep at level 1."""
        self._need("generators", self.generators)
        Pending(self.generators.send_all("sleep", level), lambda v: None, self.timeout_s, "Generator.sleep").result()
        self.generators_asleep = level

    def wake_generators(self) -> None:
        self._need("generators", self.generators)
        Pending(self.generators.send_all("wake_up"), lambda v: None, self.timeout_s, "Generator.wake_up").result()
        self.generators_asleep = 0

    def generator_memory(self) -> list[dict[str, float]]:
        """Each generator's device memory (GiB): allocated / reserved now, peak since the last call."""
        self._need("generators", self.generators)
        return Pending(self.generators.send_all("memory"), list, self.timeout_s, "Generator.memory").result()

    def score(self, completions: list[str], rows: list[dict], group_size: int = 1) -> Pending[list[ScoredSample]]:
        """Rewards of completion texts, `group_size` consecutive completions per row (`Row.verifier_view()` dicts),
        split by rows over the reward processes; results in completion order."""
        self._need("a reward actor", self.reward)
        if len(completions) != len(rows) * group_size:
            raise ValueError(f"{len(completions)} completions for {len(rows)} rows x group_size={group_size}")
        n = self.num_reward_procs
        bounds = [len(rows) * i // n for i in range(n + 1)]
        futures = [
            self.reward.send(i, "score", completions[lo * group_size : hi * group_size], rows[lo:hi], group_size)
            for i, (lo, hi) in enumerate(itertools.pairwise(bounds))
            if hi > lo
        ]
        return Pending(futures, lambda parts: [s for part in parts for s in part], self.timeout_s, "score")

    def run_episodes(
        self,
        env: Any,
        rows: Sequence[Any],
        *,
        group_size: int = 1,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        max_turns: int = 4,
        max_tokens: int | None = None,
        timeout_s: float = 30.0,
        render: Any = None,
    ) -> list[Any]:
        """Multi-turn episodes of `env` on the generators: `group_size` per row, laid out row by row. `env`: a
        name ('calculator', 'pkg.mod:Class'), an `meshrl.envs.Environment` subclass, a function making one, or an
        `EnvConfig`. `rows`: `Row`s, row dicts ({"prompt", "answer", ...}) or prompt strings. Each result is a
        `meshrl.envs.rollout.Episode`: `.tokens.datum(advantage)` is its training sequence (loss on the model's
        tokens only), `.outcome` its reward, per-turn rewards, messages and metrics.

            episodes = ctl.run_episodes("calculator", rows, group_size=8, max_turns=3)
        """
        from meshrl.envs import EnvConfig
        from meshrl.envs.episode import EpisodeRenderer
        from meshrl.envs.rollout import EpisodeLimits, EpisodeRunner
        from meshrl.render import Renderer
        from meshrl.tasks.base import Row

        self._need("generators", self.generators)
        if isinstance(env, str):
            env = EnvConfig(name=env)
        group_rewards = None
        if isinstance(env, EnvConfig):
            cls, make = env.factory()
            group_rewards = cls.group_rewards
        else:
            make = env
            group_rewards = getattr(env, "group_rewards", None)
        key = repr(render)  # the model's tokenizer is loaded once per render config, not on every call
        if key not in self._episode_renderers:
            self._episode_renderers[key] = EpisodeRenderer(Renderer.from_model_dir(self.model_dir, render))
        episode_renderer = self._episode_renderers[key]
        renderer = episode_renderer.renderer
        limit = self.generator_cfg.max_model_len
        if sampling is None:
            sampling = SamplingParams(max_tokens=self.generator_cfg.max_tokens, stop_token_ids=renderer.stop_token_ids)
        limits = EpisodeLimits(max_turns, min(max_tokens or limit, limit), sampling.max_tokens, timeout_s)

        def as_row(r: Any) -> Row:
            if isinstance(r, Row):
                return r
            if isinstance(r, str):
                return Row(r)
            rest = {k: v for k, v in r.items() if k not in ("prompt", "answer")}
            return Row(r["prompt"], r.get("answer"), rest)

        runner = EpisodeRunner(make, episode_renderer, self.complete, limits, group_rewards=group_rewards)
        return runner.run([as_row(r) for r in rows], group_size, sampling, seed)

    def timeline(self) -> list[dict[str, Any]]:
        """Every actor's busy intervals since the last call (`meshrl.timeline`), by start time. Waits for the
        actors' queued work: call it between steps of a synchronous loop, or at the end of an asynchronous one."""
        futures = [self.trainer.timeline.call()] if self.trainer is not None else []
        for pool in (self.generators, self.reward):
            futures += pool.send_all("timeline") if pool is not None else []
        parts = []
        for fut in futures:
            value = fut.get(timeout=self.timeout_s)
            parts += list(value.values()) if hasattr(value, "values") else [value]
        return sorted((i for part in parts for i in part), key=lambda i: i["start"])

    @staticmethod
    def _need(what: str, mesh: Any) -> None:
        if mesh is None:
            raise RuntimeError(
                f"this Controller was started without {what} (trainer_cfg / generator_cfg / rewards None)"
            )

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        # After a process died (or its host was lost), do not wait long on a mesh that cannot answer.
        timeout = 10 if self.failures or self.provision.lost else 60
        if self.generators is not None:
            try:
                asyncio.run(asyncio.wait_for(shutdown_weight_store(self.store_name), timeout))
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        # Consumers first (all at once), the trainer last: generators still map the trainer's weight buffer
        # (CUDA IPC warns when the producing process exits before them).
        trainer_procs, consumer_procs = (self._procs[:1], self._procs[1:]) if self.trainer else ([], self._procs)
        for group in (consumer_procs, trainer_procs):
            stopping = []
            for procs in group:
                try:
                    stopping.append(procs.stop())
                except Exception:  # noqa: BLE001 - best effort: the processes may already be gone
                    pass
            if group is consumer_procs:
                for pool in (self.generators, self.reward):
                    stopping += pool.stop() if pool is not None else []
            deadline = time.monotonic() + timeout  # one wait for the group: meshes on a dead host all time out
            for fut in stopping:
                try:
                    fut.get(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001
                    pass
        if self.weights is not None:
            self.weights.after_shutdown()
        self.provision.shutdown()  # a job the run started ends with it (also at exit, for a Controller left open)

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
