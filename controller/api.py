"""The small Controller API that `grpo`, `sft` and `eval` are written in, and that users can drive from Python.

The run's processes by role, each a client of its own module: the trainer (`TrainerClient`, PolicyTrainer ×
trainer.num_procs), the generators (`GeneratorPool`, Generator × generator.num_replicas), the reward processes
(`RewardPool`, RewardActor × scoring.num_procs), the reference model (`ReferenceClient`, started by programs with a
KL term) and the weight sync between trainer and generators (`WeightSync`, which owns the run's torchstore). Their
endpoints are calls that return `Pending` results: start several, then `.result()` them, so generation, scoring,
training and weight transfer can overlap. Every wait has a timeout, so a dead actor fails the run instead of hanging
it. Generator and reward processes are replaced when they die or freeze, their requests sent again
(controller/replicas.py); a dead trainer ends the run.

A program prepares its process, provisions, then starts the Controller from its run config:

    prepare_process()                                   # controller/process.py
    provision = Provisioner(cfg.placement)              # controller/provision.py: where each role's processes run
    with Controller.start(cfg, model_dir=model_dir, rewards=rubric, tokenizer=tok, provision=provision) as ctl:
        ...
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

from meshrl.config import EvalRunConfig, GRPORunConfig, SFTRunConfig
from meshrl.controller.futures import ActorDiedError, Pending  # noqa: F401 - ActorDiedError: re-exported
from meshrl.controller.generator_pool import GeneratorPool
from meshrl.controller.process import prepare_process, record_faults, stop_recording
from meshrl.controller.provision import Provisioner
from meshrl.controller.reference_client import ReferenceClient
from meshrl.controller.replicas import RestartBudget
from meshrl.controller.reward_pool import RewardPool
from meshrl.controller.trainer_client import TrainerClient
from meshrl.controller.weight_sync import WeightSync, WeightSyncTiming
from meshrl.rewards import Rubric, ScoredSample
from meshrl.types import (
    Completion,
    Datum,
    ForwardBackwardResult,
    LossSpec,
    OptimParams,
    OptimResult,
    SamplingParams,
)
from meshrl.weight_sync.transport import DEFAULT_STORE

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


class Controller:
    """The run's actor meshes, as futures-returning calls.

        with Controller(model_dir="ckpt/", model_cfg=ModelConfig(backend="hf"), trainer_cfg=TrainerConfig(),
                        generator_cfg=GeneratorConfig(), rewards=Rubric({"math_verify": 1.0})) as ctl:
            groups = ctl.generate(prompt_ids, SamplingParams(n=8)).result()

    `trainer_cfg` / `generator_cfg` None: no trainer (evaluating a checkpoint: the generators load `model_dir` as it
    is) / no generators (SFT on files). `rewards`: a Rubric (or a name -> weight dict) scored by
    `ScoringConfig.num_procs` reward processes; None: no reward processes. `tokenizer` is optional: the padding id
    comes from it, else from the model directory. `placement`: a Provisioner (the program's) or a PlacementConfig
    (None: this machine). `max_staleness` K > 0: the asynchronous loop — the weight store keeps K + 1 versions while
    loads are queued, and a failed generator ends the run (resume instead: its queued requests wait on the weights
    version they were sent for). Programs build from their run config with `Controller.start`."""

    def __init__(
        self,
        *,
        model_dir: str,
        model_cfg,
        trainer_cfg,
        generator_cfg,
        rewards: Rubric | dict[str, float] | None = None,
        tokenizer: Any = None,
        seed: int = 0,
        call_timeout_s: float = 600.0,
        reward_weights: dict[str, float] | None = None,
        max_restarts: int = 3,
        heartbeat_s: float = 20.0,
        placement: Any = None,
        max_staleness: int = 0,
    ) -> None:
        from meshrl.config import check_weight_sync

        if generator_cfg is not None:
            check_weight_sync(trainer_cfg, generator_cfg)  # before anything is spawned
            generator_cfg = _niced(generator_cfg, trainer_cfg, max_staleness)
        if rewards is None and reward_weights is not None:  # the older keyword
            rewards = reward_weights
        if rewards is not None and not isinstance(rewards, Rubric):
            rewards = Rubric(dict(rewards))  # resolves every name now: a bad one fails before any spawn
        self.model_dir, self.model_cfg, self.generator_cfg = str(model_dir), model_cfg, generator_cfg
        self.timeout_s, self.max_staleness = call_timeout_s, max_staleness
        self._trainer_cfg = trainer_cfg  # the trainer's, once it runs (`trainer_cfg`)
        self.pad_id = padding_id(tokenizer, self.model_dir)
        prepare_process()  # a program has done it already; a Controller built directly needs it too
        self.failures: list[str] = []  # actor failures (controller/process.py), "trainer frozen"
        record_faults(self.failures)
        self._episode_renderers: dict[str, Any] = {}  # run_episodes: render config -> EpisodeRenderer
        self._env_processes: dict[str, Any] = {}  # run_episodes: environment config -> its processes (EnvWorkers)
        # Every process mesh comes from the provisioner: this machine, or Monarch workers on other hosts.
        self.provision = placement if isinstance(placement, Provisioner) else Provisioner(placement)
        # Generator and reward processes are replaced when they die or freeze, within one run-wide budget.
        self.restarts = RestartBudget(max_restarts)
        pools = dict(budget=self.restarts, timeout_s=call_timeout_s, heartbeat_s=heartbeat_s)
        # A store of its own: two Controllers in one process (tests, a user's script) never see each other's
        # versions, and shutting one down leaves the other's store alone.
        self.store_name = f"{DEFAULT_STORE}-{os.getpid()}-{next(_controller_ids)}"

        # Spawned role by role, set up in parallel: models and engines load while the next role spawns.
        self.trainer: TrainerClient | None = None
        if trainer_cfg is not None:
            self.trainer = TrainerClient(
                self.provision, self.model_dir, model_cfg, trainer_cfg, self.pad_id,
                timeout_s=call_timeout_s, heartbeat_s=heartbeat_s, failures=self.failures,
            )  # fmt: skip
        self.weights: WeightSync | None = None  # trainer -> generators (controller/weight_sync.py)
        self.generators: GeneratorPool | None = None
        if generator_cfg is not None:
            versions_kept = max_staleness + 1 if max_staleness else 2
            self.weights = WeightSync(generator_cfg, self.store_name, call_timeout_s, versions_kept=versions_kept)
            host = self.provision.host("trainer") if trainer_cfg is not None else None
            self.weights.open_store(host=host, num_volumes=trainer_cfg.num_procs if trainer_cfg is not None else 1)
            self.generators = GeneratorPool(
                self.provision, self.model_dir, generator_cfg, seed, weights=self.weights,
                replaceable=not max_staleness, **pools,
            )  # fmt: skip
        self.reward = RewardPool(self.provision, rewards, **pools) if rewards is not None else None
        self.reference: ReferenceClient | None = None  # start_reference

        if self.trainer is not None:
            self.trainer.wait_ready()
        if self.generators is not None:
            self.generators.start()
            if self.trainer is not None:
                self._start_weight_sync()
        if self.reward is not None:
            self.reward.start()

    @classmethod
    def start(
        cls,
        cfg: GRPORunConfig | SFTRunConfig | EvalRunConfig,
        *,
        model_dir: str | None = None,
        rewards: Rubric | dict[str, float] | None = None,
        tokenizer: Any = None,
        provision: Provisioner | None = None,
        generate: bool = True,
    ) -> Controller:
        """The run's processes as its run config says: `cfg.model`, `cfg.trainer` (none in an EvalRunConfig),
        `cfg.generator` (unless `generate` is False: SFT without generated evaluations), `cfg.run` (seed, call
        timeout, restarts, heartbeat), `cfg.placement` (unless `provision`, the program's Provisioner, is given) and
        `cfg.grpo.max_staleness` (the asynchronous loop). `model_dir`: the checkpoint the processes load (default
        `cfg.model.path`); `rewards`: the reward processes' Rubric (None: none); `tokenizer`: for the padding id.

            ctl = Controller.start(cfg, model_dir=model_dir, rewards=setup.rewards, tokenizer=tok, provision=provision)
        """
        trainer_cfg = None if isinstance(cfg, EvalRunConfig) else cfg.trainer
        return cls(
            model_dir=cfg.model.path if model_dir is None else model_dir,
            model_cfg=cfg.model,
            trainer_cfg=trainer_cfg,
            generator_cfg=cfg.generator if generate else None,
            rewards=rewards,
            tokenizer=tokenizer,
            seed=cfg.run.seed,
            call_timeout_s=cfg.run.call_timeout_s,
            max_restarts=cfg.run.max_restarts,
            heartbeat_s=cfg.run.heartbeat_s,
            placement=cfg.placement if provision is None else provision,
            max_staleness=cfg.grpo.max_staleness if isinstance(cfg, GRPORunConfig) else 0,
        )

    def _start_weight_sync(self) -> None:
        """The run's one weight-sync object, its transport resolved against where the processes actually run."""
        identities = [g["device_identity"] for g in self.generators.info]
        try:
            self.weights.start(
                self.trainer.actors, self.generators, self.trainer.info["device_identity"], identities,
                num_params=self.trainer.info["num_params"],
            )  # fmt: skip
        except Exception:
            self.shutdown()  # a placement that cannot do what was asked: fail at launch, leave no processes
            raise

    # ---- what runs ----------------------------------------------------------------------------------------
    @property
    def trainer_cfg(self) -> Any:
        return self.trainer.cfg if self.trainer is not None else self._trainer_cfg

    @trainer_cfg.setter
    def trainer_cfg(self, cfg: Any) -> None:  # e.g. another token budget from now on (tests)
        self._trainer_cfg = cfg
        if self.trainer is not None:
            self.trainer.cfg = cfg

    @property
    def trainer_info(self) -> dict[str, Any]:
        """Trainer rank 0's `info()` at start ({"policy_version": 0} without a trainer)."""
        return self.trainer.info if self.trainer is not None else {"policy_version": 0}

    @property
    def trainer_pids(self) -> list[int]:
        return self.trainer.pids if self.trainer is not None else []

    @property
    def generator_info(self) -> list[Any]:
        """Each generator replica's `setup()` result (a replacement's once it runs)."""
        return self.generators.info if self.generators is not None else []

    @property
    def num_replicas(self) -> int:
        return len(self.generators) if self.generators is not None else 0

    @property
    def num_reward_procs(self) -> int:
        return len(self.reward) if self.reward is not None else 0

    @property
    def reference_procs(self) -> int:
        return self.reference.num_procs if self.reference is not None else 0

    @property
    def policy_version(self) -> int:
        """The trainer's policy version as its last result reported it (what `generate` checks completions against)."""
        return self.trainer.policy_version if self.trainer is not None else 0

    @property
    def generators_asleep(self) -> int:
        """The sleep level the generators are at (a replacement is put there too)."""
        return self.generators.asleep if self.generators is not None else 0

    @property
    def replicas_restarted(self) -> int:
        """Generator and reward processes replaced so far (run.max_restarts bounds them)."""
        return self.restarts.used

    @property
    def weight_transport(self) -> str | None:
        return None if self.weights is None else self.weights.transport

    @property
    def versions_kept(self) -> int:
        """torchstore versions kept while generators' loads are queued (the asynchronous loop: max_staleness + 1)."""
        return self.weights.versions_kept if self.weights is not None else 2

    # ---- trainer ------------------------------------------------------------------------------------------
    def forward_backward(
        self, data: list[Datum], loss: LossSpec, step: OptimParams | None = None, split: list[int] | None = None
    ) -> Pending[ForwardBackwardResult]:
        """`step`: this call ends an optimiser step and takes it (result in `.optim`; see Policy.forward_backward).
        `split`: how many of `data` (rank-major) each trainer rank computes; None: an even split."""
        return self._need("a trainer", self.trainer).forward_backward(data, loss, step, split)

    def forward(
        self, data: list[Datum], temperature: float = 1.0, split: list[int] | None = None
    ) -> Pending[list[list[float]]]:
        return self._need("a trainer", self.trainer).forward(data, temperature, split)

    def token_budget(self) -> int:
        """Tokens per trainer rank and `forward_backward` call (TrainerClient.token_budget)."""
        return self._need("a trainer", self.trainer).token_budget()

    def micro_batch_plan(self, lengths: list[int], max_seqs: int | None = None) -> list[list[list[int]]]:
        """Sequences (by length) -> `forward_backward` calls -> per-rank indices (TrainerClient.micro_batch_plan)."""
        return self._need("a trainer", self.trainer).micro_batch_plan(lengths, max_seqs)

    def trainer_memory(self) -> list[dict[str, float]]:
        """Each trainer rank's device memory (GiB): allocated / reserved now, peak since the last call."""
        return self._need("a trainer", self.trainer).memory()

    def release_trainer_memory(self) -> int:
        """Every trainer rank's cached allocator blocks back to the device (bytes released, summed)."""
        return self._need("a trainer", self.trainer).release_memory()

    def offload_optimizer_state(self) -> Pending[int]:
        """The trainer's AdamW state to host memory until its next forward_backward / optim_step (bytes moved)."""
        return self._need("a trainer", self.trainer).offload_optimizer_state()

    def optim_step(self, params: OptimParams) -> Pending[OptimResult]:
        return self._need("a trainer", self.trainer).optim_step(params)

    def trainer_peak_memory_gib(self) -> float | None:
        """The largest peak device memory of any trainer rank since it started (None for trainers on CPU)."""
        return self._need("a trainer", self.trainer).peak_memory_gib()

    def save_checkpoint(self, path: str) -> None:
        """The trainer's full state (model + optimiser, torch DCP) into `path` (see meshrl.checkpoint for the
        atomic run checkpoints that also hold the controller's state)."""
        self._need("a trainer", self.trainer).save_checkpoint(path)

    def load_checkpoint(self, path: str) -> int:
        """Restore the trainer's full state, or — for an HF checkpoint dir — just its weights. Returns the policy
        version now held by the trainer."""
        return self._need("a trainer", self.trainer).load_checkpoint(path)

    def export_hf(self, path: str, dtype: str | None = None) -> str:
        """The trainer's weights as an HF checkpoint (config, safetensors, tokenizer), written atomically."""
        return self._need("a trainer", self.trainer).export_hf(path, dtype)

    # ---- reference model (KL) -----------------------------------------------------------------------------
    def start_reference(self, model_dir: str, num_procs: int = 1) -> None:
        """Spawn the ReferenceModel mesh: a frozen, forward-only copy of the policy loaded from `model_dir` (an HF
        checkpoint dir), FSDP-sharded over `num_procs` processes. Only programs with a KL term need it."""
        if self.reference is not None:
            raise RuntimeError("the reference model is already running")
        self.reference = ReferenceClient(
            self.provision, model_dir, self.model_cfg, self.trainer_cfg, self.pad_id, num_procs=num_procs,
            timeout_s=self.timeout_s,
        )  # fmt: skip
        self.reference.wait_ready()

    def reference_logprobs(self, data: list[Datum], temperature: float = 1.0) -> Pending[list[list[float]]]:
        """Reference-model logprobs of every datum's targets (any batch size: padded to the mesh, then dropped)."""
        return self._need("a reference model (start_reference)", self.reference).logprobs(data, temperature)

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
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, version: int | None = None,
        images: list[tuple[bytes, ...]] | None = None,
    ) -> Pending[list[list[Completion]]]:  # fmt: skip
        """Spread prompts over the generator replicas; completions come back in prompt order, each stamped
        with the policy version that produced it (checked to be `version`, default the current one: an episode
        played in the background while the trainer steps pins the version it started on). `images`: per prompt,
        its encoded images (`Renderer.prompt_images`; None: a text-only call)."""
        generators = self._need("generators", self.generators)
        return generators.generate(prompts, params, self.policy_version if version is None else version, images)

    def complete(
        self, prompts: list[list[int]], params: SamplingParams, version: int | None = None,
        images: list[tuple[bytes, ...]] | None = None,
    ) -> list[Completion]:  # fmt: skip
        """One completion per prompt (params.n is 1), waited for. Safe to call from several threads at once, as
        the episode runner's cohorts do: the calls are sent one at a time and waited on together."""
        generators = self._need("generators", self.generators)
        return generators.complete(prompts, params, self.policy_version if version is None else version, images)

    def prompt_logprobs(
        self, sequences: list[list[int]], images: list[tuple[bytes, ...]] | None = None
    ) -> Pending[list[list[float]]]:
        """Generator-side logprobs of fixed sequences (replica 0), for parity checks against `forward`."""
        return self._need("generators", self.generators).prompt_logprobs(sequences, images)

    def sleep_generators(self, level: int = 1) -> None:
        """Every generator releases its KV cache (level 2: its weights too) until `wake_generators` (controller/
        memory.py: the colocated hand-off). Weight loads still reach a generator asleep at level 1."""
        self._need("generators", self.generators).sleep(level)

    def wake_generators(self) -> None:
        self._need("generators", self.generators).wake()

    def generator_memory(self) -> list[dict[str, float]]:
        """Each generator's device memory (GiB): allocated / reserved now, peak since the last call."""
        return self._need("generators", self.generators).memory()

    def score(self, completions: list[str], rows: list[dict], group_size: int = 1) -> Pending[list[ScoredSample]]:
        """Rewards of completion texts, `group_size` consecutive completions per row (`Row.verifier_view()` dicts),
        split by rows over the reward processes; results in completion order."""
        return self._need("a reward actor", self.reward).score(completions, rows, group_size)

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
        `EnvConfig` — by name or config, the environments run in environment processes (`EnvConfig.workers`),
        a class or function in this process's threads. `rows`: `Row`s, row dicts ({"prompt", "answer", ...}) or
        prompt strings. Each result is a `meshrl.rollout.runner.Episode`: `.tokens.datum(advantage)` is its
        training sequence (loss on the model's tokens only), `.outcome` its reward, per-turn rewards, messages
        and metrics.

            episodes = ctl.run_episodes("calculator", rows, group_size=8, max_turns=3)
        """
        from meshrl.data.prompts import as_row as row_of
        from meshrl.envs import EnvConfig
        from meshrl.rollout.episode import EpisodeRenderer
        from meshrl.rollout.render import Renderer
        from meshrl.rollout.runner import EpisodeLimits, EpisodeRunner
        from meshrl.tasks.base import Row

        self._need("generators", self.generators)
        if isinstance(env, str):
            env = EnvConfig(name=env, timeout_s=timeout_s)
        group_rewards, envs = None, None
        if isinstance(env, EnvConfig):
            cls, make = env.factory()
            group_rewards = cls.group_rewards
            # By name, the environments run in processes of their own (--env.workers), as in the programs: a step
            # that hangs holding the interpreter or crashes costs its episode, not this process. Kept per config
            # for the next calls; stopped at shutdown.
            if (key := repr(env)) not in self._env_processes:
                self._env_processes[key] = env.processes()
            envs = self._env_processes[key]
        else:  # a class or a function: in this process's threads (it may not be importable by name elsewhere)
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

        def as_row(r: Any) -> Row:  # a prompt string, or a Row / row dict as everywhere else (data.prompts.as_row)
            return Row(r) if isinstance(r, str) else row_of(r)

        runner = EpisodeRunner(make, episode_renderer, self.complete, limits, group_rewards=group_rewards, envs=envs)
        return runner.run([as_row(r) for r in rows], group_size, sampling, seed)

    def timeline(self) -> list[dict[str, Any]]:
        """Every actor's busy intervals since the last call (`meshrl.timeline`), by start time. Waits for the
        actors' queued work: call it between steps of a synchronous loop, or at the end of an asynchronous one."""
        futures = [self.trainer.actors.timeline.call()] if self.trainer is not None else []
        for pool in (self.generators, self.reward):
            futures += pool.send_all("timeline") if pool is not None else []
        parts = []
        for fut in futures:
            value = fut.get(timeout=self.timeout_s)
            parts += list(value.values()) if hasattr(value, "values") else [value]
        return sorted((i for part in parts for i in part), key=lambda i: i["start"])

    @staticmethod
    def _need(what: str, role: Any) -> Any:
        if role is None:
            raise RuntimeError(
                f"this Controller was started without {what} (trainer_cfg / generator_cfg / rewards None)"
            )
        return role

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        # After a process died (or its host was lost), do not wait long on a mesh that cannot answer.
        timeout = 10 if self.failures or self.provision.lost else 60
        for envs in self._env_processes.values():
            if envs is not None:
                envs.close()
        if self.weights is not None:
            self.weights.close_store(timeout)
        # Consumers first (all at once), the trainer last where generators map the trainer's GPU buffer (CUDA IPC
        # warns when the producing process exits before them); else every process at once (each mesh takes ~2 s to
        # stop: in sequence that was ~2 s more at the end of every run).
        consumers = [self.reference.procs] if self.reference is not None else []
        trainer = [self.trainer.procs] if self.trainer is not None else []
        if self.weight_transport != "cuda_ipc":
            consumers, trainer = consumers + trainer, []
        for group in (consumers, trainer):
            stopping = []
            for procs in group:
                try:
                    stopping.append(procs.stop())
                except Exception:  # noqa: BLE001 - best effort: the processes may already be gone
                    pass
            if group is consumers:
                for pool in (self.generators, self.reward):
                    stopping += pool.stop() if pool is not None else []
            _wait_all(stopping, timeout)
        if self.weights is not None:
            self.weights.after_shutdown()
        self.provision.shutdown()  # a job the run started ends with it (also at exit, for a Controller left open)
        stop_recording(self.failures)

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _wait_all(futures: list[Any], timeout: float) -> None:
    """Wait for Monarch futures together, at most `timeout` in all (best effort: failures are ignored). A future of
    a `stop` runs only once waited on, so waiting in turn would stop the meshes one after the other (~2 s each)."""
    from concurrent.futures import ThreadPoolExecutor

    def wait(fut: Any) -> None:
        try:
            fut.get(timeout=timeout)
        except Exception:  # noqa: BLE001 - best effort: the processes may already be gone
            pass

    if futures:
        with ThreadPoolExecutor(max_workers=len(futures), thread_name_prefix="meshrl-stop") as pool:
            list(pool.map(wait, futures))


def _niced(generator_cfg: Any, trainer_cfg: Any, max_staleness: int) -> Any:
    """`generator.nice` None: 10 in the asynchronous loop with a trainer on CPU (trainer ranks first, generation in
    the gaps), else none."""
    import dataclasses

    on_cpu = trainer_cfg is not None and trainer_cfg.device == "cpu"
    if generator_cfg.nice is None and max_staleness and on_cpu:
        return dataclasses.replace(generator_cfg, nice=10)
    return generator_cfg
