"""Run configuration: one dataclass per program (`GRPORunConfig`, `SFTRunConfig`, `EvalRunConfig`), nesting the
sections of the components it runs, each defined beside the component that reads it and passed to it whole:

    ModelConfig, TrainerConfig     meshrl.models.config       Policy and its backends (--model.*, --trainer.*)
    OptimConfig                    meshrl.optim_config        learning-rate schedule, AdamW (--optim.*)
    GeneratorConfig                meshrl.generation.config   the engines, beside VLLMEngineConfig and
                                                              TransformersEngineConfig (--generator.*)
    GRPOConfig                     meshrl.algorithms_config   the RL loop and its algorithm (--grpo.*)
    EvalConfig                     meshrl.evaluation          held-out evaluation (--eval.*)
    RunConfig                      meshrl.run_dir             run directory, checkpoints, faults (--run.*)
    LogConfig                      meshrl.metric_sinks        metric backends (--log.*)
    PlacementConfig                below                      where the processes start (--placement.*)
    SFTDataConfig                  meshrl.data.sft            SFT rows (--data.* of SFT)
    DataConfig, EnvConfig, ...     meshrl.data.prompts, meshrl.envs, meshrl.tasks.*, meshrl.rollout.render,
                                                              meshrl.rewards

All of them stay importable from here. A section checks its own fields in `__post_init__`; the run configs check
what crosses sections (batch arithmetic, lengths, the weight transport against the trainer's device), so a bad
command line fails in milliseconds with a message that names the numbers that disagree. Checks that read files or
devices are `meshrl.preflight`'s. Presets live in `meshrl.configs`; the CLI (tyro) is built over these same classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshrl.algorithms_config import GRPOConfig, check_algorithm
from meshrl.data.prompts import DataConfig
from meshrl.data.sft import SFTDataConfig
from meshrl.envs import EnvConfig
from meshrl.errors import ConfigError
from meshrl.evaluation import EvalConfig
from meshrl.generation.config import WEIGHT_SYNC_TRANSPORTS, GeneratorConfig, check_weight_sync
from meshrl.generation.transformers_engine.config import TransformersEngineConfig
from meshrl.generation.vllm_config import VLLMEngineConfig
from meshrl.metric_sinks import METRIC_BACKENDS, LogConfig
from meshrl.models.config import ModelConfig, TrainerConfig, check_precision
from meshrl.optim_config import OptimConfig
from meshrl.rewards import ScoringConfig
from meshrl.rollout.render import RenderConfig
from meshrl.run_dir import RunConfig
from meshrl.tasks.arithmetic import ArithmeticConfig
from meshrl.tasks.reasoning_gym import ReasoningGymConfig
from meshrl.tasks.reverse import ReverseTaskConfig

__all__ = [  # the run configs, and every section they nest (importable from here as before they moved)
    "ArithmeticConfig",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "EvalRunConfig",
    "GeneratorConfig",
    "GRPOConfig",
    "GRPORunConfig",
    "LogConfig",
    "METRIC_BACKENDS",
    "ModelConfig",
    "OptimConfig",
    "PlacementConfig",
    "ReasoningGymConfig",
    "RenderConfig",
    "ReverseTaskConfig",
    "RunConfig",
    "ScoringConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTRunConfig",
    "TrainerConfig",
    "TransformersEngineConfig",
    "VLLMEngineConfig",
    "WarmupConfig",
    "WEIGHT_SYNC_TRANSPORTS",
    "check_algorithm",
    "check_eval_tokens",
    "check_precision",
    "check_task",
    "check_weight_sync",
    "validate_batch_arithmetic",
]


def check_eval_tokens(eval_cfg: EvalConfig, generator: GeneratorConfig) -> None:
    """eval.max_tokens replaces generator.max_tokens in evaluation: it must leave room for a prompt too (else the
    prompt budget check blames generator.max_tokens, a flag the user may never have set)."""
    if eval_cfg.max_tokens is not None and eval_cfg.max_tokens >= generator.max_model_len:
        raise ConfigError(
            f"eval.max_tokens={eval_cfg.max_tokens} leaves no room for a prompt within generator.max_model_len="
            f"{generator.max_model_len}; use --eval.max-tokens in [1, {generator.max_model_len - 1}] or raise "
            "--generator.max-model-len"
        )


@dataclass
class WarmupConfig:
    """Supervised warm-up on the task's demonstrations before RL (cross-entropy on response tokens)."""

    steps: int = 0
    """Cross-entropy steps on the task's reference answers before RL (rendered like the RL prompts); 0: none."""
    batch_size: int = 32
    """Sequences per warm-up step."""
    lr: float = 3e-3
    """Peak learning rate of the warm-up (cosine decay to 10 %)."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or not self.lr > 0:
            raise ConfigError(
                f"warmup: steps={self.steps} must be >= 0, batch_size={self.batch_size} >= 1, lr={self.lr} > 0"
            )


@dataclass
class PlacementConfig:
    kind: str = "local"
    """Where the run's processes start: 'local' (this machine); 'hosts' (Monarch workers already running, one per
    host, started with `python -m meshrl.controller.worker --address tcp://HOST:PORT`; the controller attaches to
    them); or a Monarch job that the run starts and ends itself: 'slurm' (an sbatch allocation), 'k8s' (Kubernetes
    pods), 'process' (each host a local subprocess running Monarch's worker loop: Monarch's stand-in for several
    hosts on one machine). A job has two host meshes: 'trainer' (trainer ranks, reference model) and 'rollout'
    (generator replicas and reward processes)."""
    workers: str | None = None
    """kind=hosts: the workers' addresses, comma-separated, e.g. 'tcp://node0:26600,tcp://node1:26600'; host i is
    the i-th."""
    trainer_host: int = 0
    """kind=hosts: the host (index into --placement.workers; negative counts from the end) of the trainer ranks."""
    generator_host: int = -1
    """kind=hosts: the host of the generator replicas (default: the last)."""
    reward_host: int = -1
    """kind=hosts: the host of the reward processes (default: the last)."""
    trainer_nodes: int = 1
    """slurm/k8s/process: hosts of the 'trainer' mesh. The trainer ranks are spread evenly over them
    (trainer.num_procs a multiple of it); the reference model goes beside them."""
    rollout_nodes: int = 1
    """slurm/k8s/process: hosts of the 'rollout' mesh; generator replicas and reward processes go round-robin over
    them. 0: no such mesh, they share the trainer's hosts."""
    spawn_timeout_s: float = 60.0
    """Any kind but local: a host that has not started a process this long after being asked is lost (dead or cut
    off). The run ends with the resume command, instead of waiting run.call_timeout_s for a host that is gone; a
    replica on it is not replaced there."""
    job_cache: str | None = None
    """slurm/k8s/process: Monarch's job file (e.g. .monarch/job_state.pkl). The run reuses the job saved there when
    it is still alive with the same spec (else starts one and saves it), and leaves it running at the end, for the
    next run or a resume: end it yourself (scancel, kubectl delete). Unset: the run's own job, ended with the run."""
    start_timeout_s: int | None = None
    """slurm: the longest wait in the queue; k8s: for the pods to be ready. Unset: wait as long as it takes."""
    slurm_partition: str | None = None
    """slurm: the partition (sbatch --partition); unset: the cluster's default."""
    slurm_time: str | None = None
    """slurm: the time limit (sbatch --time), e.g. '4:00:00' or '1-12:00:00'; unset: the partition's default."""
    slurm_gpus_per_node: int | None = None
    """slurm: GPUs per node (sbatch --gpus-per-node); unset: none asked for."""
    slurm_account: str | None = None
    """slurm: the account charged (sbatch --account)."""
    slurm_qos: str | None = None
    """slurm: the quality of service (sbatch --qos)."""
    slurm_args: str = ""
    """slurm: more sbatch options, space-separated, each as --name=value, e.g. '--constraint=h100 --mem=0'."""
    slurm_python: str | None = None
    """slurm: the Python that runs Monarch's worker on each node (it needs meshrl installed); unset: the
    controller's own interpreter, which a shared filesystem makes the same path on every node."""
    slurm_port: int = 22222
    """slurm: the TCP port the workers listen on, on each node."""
    k8s_namespace: str = "default"
    """k8s: the namespace of the pods."""
    k8s_image: str | None = None
    """k8s: provision the meshes with this container image (a MonarchMesh resource each, for the MonarchMesh
    operator, deleted at the end). Unset: attach to pods already running, labelled
    app.kubernetes.io/name=monarch-worker and monarch.pytorch.org/mesh-name=MESH, with their rank in
    apps.kubernetes.io/pod-index (a StatefulSet sets it)."""
    k8s_gpus_per_pod: int = 0
    """k8s with --placement.k8s-image: nvidia.com/gpu asked for per pod."""
    k8s_trainer_mesh: str = "trainer"
    """k8s: the name of the trainer's mesh (the mesh-name label of its pods, or its MonarchMesh)."""
    k8s_rollout_mesh: str = "rollout"
    """k8s: the name of the rollout mesh (generators and reward processes)."""
    k8s_kubeconfig: str | None = None
    """k8s: a kubeconfig file, for a controller outside the cluster (Monarch port-forwards to a pod). Unset: the
    controller runs in the cluster (a pod or Job) and uses the in-cluster config."""

    # Which kinds each field is for: setting one for another kind is refused (it would be silently ignored).
    _JOBS = ("process", "slurm", "k8s")
    _SCOPES = {
        "workers": ("hosts",), "trainer_host": ("hosts",), "generator_host": ("hosts",), "reward_host": ("hosts",),
        "trainer_nodes": _JOBS, "rollout_nodes": _JOBS, "job_cache": _JOBS, "start_timeout_s": ("slurm", "k8s"),
        "spawn_timeout_s": ("hosts", *_JOBS),
    }  # fmt: skip

    def __post_init__(self) -> None:
        if self.kind not in ("local", "hosts", *self._JOBS):
            raise ConfigError(
                f"--placement {self.kind!r}: use local, hosts (Monarch workers you started), process, slurm or k8s "
                "(a Monarch job the run starts); the README's 'Running on several machines' shows each"
            )
        self._check_scopes()
        if not self.spawn_timeout_s > 0:
            raise ConfigError(f"--placement.spawn-timeout-s={self.spawn_timeout_s} must be > 0 (seconds)")
        if self.kind == "hosts":
            self._check_hosts()
        if self.trainer_nodes < 1 or self.rollout_nodes < 0:
            raise ConfigError(
                f"--placement.trainer-nodes={self.trainer_nodes} must be >= 1 and --placement.rollout-nodes="
                f"{self.rollout_nodes} >= 0 (0: generators and reward processes on the trainer's hosts)"
            )
        if self.start_timeout_s is not None and self.start_timeout_s <= 0:
            raise ConfigError(f"--placement.start-timeout-s={self.start_timeout_s} must be > 0 (or unset: no limit)")
        if self.kind == "slurm":
            self._check_slurm()
        if self.kind == "k8s":
            self._check_k8s()

    def _check_scopes(self) -> None:
        from dataclasses import fields

        for f in fields(self):
            kinds = self._SCOPES.get(f.name)
            if kinds is None and f.name.startswith(("slurm_", "k8s_")):
                kinds = (f.name.split("_", 1)[0],)
            if kinds and self.kind not in kinds and getattr(self, f.name) != f.default:
                flag = f"--placement.{f.name.replace('_', '-')}"
                raise ConfigError(
                    f"{flag} has no effect with --placement {self.kind}: it is for --placement {' / '.join(kinds)}"
                )

    def _check_hosts(self) -> None:
        addresses = self.worker_addresses
        if not addresses:
            raise ConfigError("--placement hosts needs --placement.workers tcp://HOST:PORT,... (one per host)")
        for a in addresses:
            if "://" not in a:
                raise ConfigError(f"--placement.workers entry {a!r} is not an address like tcp://HOST:PORT")
        for name in ("trainer_host", "generator_host", "reward_host"):
            index = getattr(self, name)
            if not -len(addresses) <= index < len(addresses):
                raise ConfigError(
                    f"--placement.{name.replace('_', '-')}={index}, but --placement.workers names {len(addresses)} "
                    f"host(s): use 0..{len(addresses) - 1} (or -1 for the last)"
                )

    def _check_slurm(self) -> None:
        import re

        if self.slurm_time is not None and not re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", self.slurm_time):
            raise ConfigError(
                f"--placement.slurm-time={self.slurm_time!r} is not a Slurm time limit: use MINUTES, HH:MM:SS or "
                "DAYS-HH:MM:SS"
            )
        if self.slurm_gpus_per_node is not None and self.slurm_gpus_per_node < 0:
            raise ConfigError(f"--placement.slurm-gpus-per-node={self.slurm_gpus_per_node} must be >= 0")
        if not 0 < self.slurm_port < 65536:
            raise ConfigError(f"--placement.slurm-port={self.slurm_port} is not a TCP port (1..65535)")
        for arg in self.slurm_arg_list:
            if not arg.startswith("-"):
                raise ConfigError(
                    f"--placement.slurm-args: {arg!r} is not an option; write each as --name=value (e.g. "
                    "'--constraint=h100 --mem=0'), one sbatch directive each"
                )

    def _check_k8s(self) -> None:
        for name in ("k8s_trainer_mesh", "k8s_rollout_mesh"):
            mesh = getattr(self, name)
            # Monarch's rule for mesh names (an RFC 1123 label that is also a host name part).
            if not (0 < len(mesh) <= 63 and mesh.isalnum() and mesh.islower() and mesh[0].isalpha()):
                raise ConfigError(
                    f"--placement.{name.replace('_', '-')}={mesh!r}: a mesh name is 1-63 lowercase letters and digits, "
                    "starting with a letter"
                )
        if self.k8s_trainer_mesh == self.k8s_rollout_mesh and self.rollout_nodes:
            raise ConfigError(
                f"--placement.k8s-trainer-mesh and --placement.k8s-rollout-mesh are both {self.k8s_trainer_mesh!r}: "
                "name two meshes, or set --placement.rollout-nodes 0 to put everything on the trainer's"
            )
        if self.k8s_gpus_per_pod < 0:
            raise ConfigError(f"--placement.k8s-gpus-per-pod={self.k8s_gpus_per_pod} must be >= 0")
        if self.k8s_gpus_per_pod and self.k8s_image is None:
            raise ConfigError(
                "--placement.k8s-gpus-per-pod needs --placement.k8s-image (pods the run provisions); pods already "
                "running have the resources their own spec asks for"
            )

    @property
    def worker_addresses(self) -> list[str]:
        return [a.strip() for a in (self.workers or "").split(",") if a.strip()]

    @property
    def slurm_arg_list(self) -> list[str]:
        import shlex

        return shlex.split(self.slurm_args)


@dataclass
class GRPORunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    task: str | None = None
    """The RL task: 'reverse' (built-in string reversal), 'arithmetic' (built-in procedural math, math-verify),
    'data' (prompt rows from --data.train/--data.eval), 'reasoning_gym:NAME' (a procedural reasoning-gym task, e.g.
    countdown), or package.module:function returning a meshrl.tasks.Task. Default: 'data' when --data.train is
    given, else 'reverse'."""
    reward: str | None = None
    """Reward functions and weights, e.g. 'math_verify=1.0,format=0.1' or 'task=1.0,my_pkg.my_mod:fn=0.5': built-in
    (exact_match, char_match, exact, regex, math_verify, format, length_penalty), 'task' (the task's own verifier),
    or importable functions fn(completion: str, row: dict) -> float (sync or async). Default: the task's. With
    --env: a rubric scoring each episode's last answer, added to the environment's reward (default: none)."""
    data: DataConfig = field(default_factory=DataConfig)
    reverse: ReverseTaskConfig = field(default_factory=ReverseTaskConfig)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    render: RenderConfig = field(default_factory=RenderConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        check_precision(self.model, self.trainer)
        k = self.grpo.max_staleness
        if k < 0:
            raise ConfigError(f"grpo.max_staleness={k} must be >= 0 (0: the synchronous loop)")
        if k > 1 and self.generator.weight_sync != "torchstore":
            raise ConfigError(
                f"grpo.max_staleness={k} keeps {k + 1} weight versions alive while generators catch up; the shared "
                "buffer of --generator.weight-sync shm/cuda_ipc/auto holds 2: use --generator.weight-sync torchstore, "
                "or --grpo.max-staleness 1"
            )
        if self.env.name is not None:
            limit = self.generator.max_model_len
            if self.env.max_tokens is not None and self.env.max_tokens > limit:
                raise ConfigError(
                    f"env.max_tokens={self.env.max_tokens} is over generator.max_model_len={limit}: an episode must "
                    "fit the generator's context; raise --generator.max-model-len or lower --env.max-tokens"
                )
        check_weight_sync(self.trainer, self.generator)
        validate_batch_arithmetic(
            global_batch_size=self.grpo.global_batch_size,
            micro_batch_size=self.trainer.micro_batch_size,
            dp=self.trainer.num_procs,
            what=f"grpo.prompts_per_step={self.grpo.prompts_per_step} × grpo.group_size={self.grpo.group_size}",
        )
        if self.warmup.steps:
            validate_batch_arithmetic(
                global_batch_size=self.warmup.batch_size,
                micro_batch_size=self.trainer.micro_batch_size,
                dp=self.trainer.num_procs,
                what=f"warmup.batch_size={self.warmup.batch_size}",
            )
        if self.grpo.overlong_buffer and self.grpo.overlong_buffer >= self.generator.max_tokens:
            raise ConfigError(
                f"grpo.overlong_buffer={self.grpo.overlong_buffer} must be < generator.max_tokens="
                f"{self.generator.max_tokens} (the penalty starts at max_tokens - overlong_buffer)"
            )
        check_eval_tokens(self.eval, self.generator)
        check_task(self)
        if self.task in (None, "reverse") and self.data.train is None and self.model.path is None and not self.env.name:
            # The built-in task on a new model (character tokenizer): prompt lengths are known before launch.
            longest_prompt = self.reverse.max_len + 1  # letters + '='
            if longest_prompt + self.generator.max_tokens > self.generator.max_model_len:
                raise ConfigError(
                    f"task prompts are up to {longest_prompt} tokens and generator.max_tokens="
                    f"{self.generator.max_tokens}, which exceeds generator.max_model_len="
                    f"{self.generator.max_model_len}; raise max_model_len to at least "
                    f"{longest_prompt + self.generator.max_tokens}"
                )


def check_task(cfg) -> None:
    """--task / --data / --reward combinations that cannot work, refused before anything starts."""
    if cfg.data.train is not None and cfg.task not in (None, "data"):
        raise ConfigError(
            f"--data.train is given but --task is {cfg.task!r}: data files are the 'data' task; drop --task or "
            "use --task data"
        )
    if cfg.reward is not None:
        from meshrl.rewards import parse_reward_spec

        parse_reward_spec(cfg.reward)  # raises ConfigError naming the bad item


def validate_batch_arithmetic(*, global_batch_size: int, micro_batch_size: int, dp: int, what: str) -> int:
    """Return the number of micro-batches per optimiser step, or raise saying which numbers disagree."""
    if global_batch_size % micro_batch_size:
        divisors = [m for m in range(dp, global_batch_size + 1, dp) if global_batch_size % m == 0]
        raise ConfigError(
            f"global_batch_size={global_batch_size} ({what}) is not divisible by "
            f"trainer.micro_batch_size={micro_batch_size} (split over trainer.num_procs={dp}); "
            f"micro batch sizes that work: {divisors}"
        )
    return global_batch_size // micro_batch_size


@dataclass
class SFTConfig:
    max_steps: int = 200
    """Optimiser steps (the run also stops at max_epochs)."""
    max_epochs: float | None = None
    """Stop after this many passes over the training rows (fractions allowed); None: max_steps decides."""
    batch_size: int = 64
    """Sequences per optimiser step (global, split into trainer.micro_batch_size calls)."""
    eval_every: int = 50
    """Evaluate every this many steps (and at the end); 0: only at the end."""
    eval_generate: bool = True
    """For task data: also measure exact-match accuracy from greedy generations through the Generator."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ConfigError(f"sft.max_steps={self.max_steps} must be >= 1")
        if self.batch_size < 1:
            raise ConfigError(f"sft.batch_size={self.batch_size} must be >= 1 (sequences per optimiser step)")
        if self.max_epochs is not None and self.max_epochs <= 0:
            raise ConfigError(f"sft.max_epochs={self.max_epochs} must be > 0")
        if self.eval_every < 0:
            raise ConfigError(f"sft.eval_every={self.eval_every} must be >= 0")


@dataclass
class SFTRunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3, schedule="cosine", warmup_steps=10))
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    task: str | None = None
    """With data.train='task': the task whose demonstrations to train on ('reverse', 'reasoning_gym:NAME', or
    package.module:function); default 'reverse'."""
    reverse: ReverseTaskConfig = field(default_factory=ReverseTaskConfig)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    render: RenderConfig = field(default_factory=RenderConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    run: RunConfig = field(default_factory=RunConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        check_precision(self.model, self.trainer)
        check_weight_sync(self.trainer, self.generator)
        validate_batch_arithmetic(
            global_batch_size=self.sft.batch_size,
            micro_batch_size=self.trainer.micro_batch_size,
            dp=self.trainer.num_procs,
            what=f"sft.batch_size={self.sft.batch_size}",
        )
        if self.task == "data":
            raise ConfigError("SFT reads its own data files: use --data.train FILE (and --data.eval), not --task data")
        if self.model.path is None and (self.data.train != "task" or self.data.eval not in (None, "task")):
            raise ConfigError(
                "SFT on your own data files needs model.path (an HF checkpoint dir with its tokenizer); only the "
                "built-in task data (data.train=task) works with a randomly initialised model"
            )


@dataclass
class EvalRunConfig:
    """`python -m meshrl.controller.eval`: evaluate a checkpoint on a task's held-out rows (no trainer)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    task: str | None = None
    """As for GRPO: 'reverse', 'data' (--data.eval rows), 'reasoning_gym:NAME' or package.module:function."""
    reward: str | None = None
    """Reward functions reported beside accuracy (as for GRPO); default: the task's."""
    data: DataConfig = field(default_factory=DataConfig)
    reverse: ReverseTaskConfig = field(default_factory=ReverseTaskConfig)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    render: RenderConfig = field(default_factory=RenderConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(samples=8))
    run: RunConfig = field(default_factory=RunConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def __post_init__(self) -> None:
        if self.data.train is not None:
            raise ConfigError("evaluation reads held-out rows only: use --data.eval, not --data.train")
        check_eval_tokens(self.eval, self.generator)
        if self.reward is not None:
            from meshrl.rewards import parse_reward_spec

            parse_reward_spec(self.reward)
