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
    PlacementConfig                meshrl.placement           where the processes start (--placement.*)
    SFTDataConfig                  meshrl.data.sft            SFT rows (--data.* of SFT)
    DataConfig, EnvConfig, ...     meshrl.data.prompts, meshrl.envs, meshrl.tasks.*, meshrl.rollout.render,
                                                              meshrl.rewards

All of them stay importable from here. A section checks its own fields in `__post_init__`; the run configs check
what crosses sections (batch arithmetic, lengths, the weight transport against the trainer's device), so a bad
command line fails in milliseconds with a message that names the numbers that disagree. Checks that read files or
devices are `meshrl.preflight`'s. Presets live in `meshrl.configs`; the CLI (tyro) is built over these same classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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
from meshrl.placement import PlacementConfig
from meshrl.rewards import ScoringConfig
from meshrl.rollout.render import RenderConfig
from meshrl.run_dir import RunConfig
from meshrl.tasks.arithmetic import ArithmeticConfig
from meshrl.tasks.reasoning_gym import ReasoningGymConfig
from meshrl.tasks.reverse import ReverseTaskConfig
from meshrl.tasks.shapes import ShapesConfig

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
    "ShapesConfig",
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
class GRPORunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    task: str | None = None
    """The RL task: 'reverse' (built-in string reversal), 'arithmetic' (built-in procedural math, math-verify),
    'shapes' (built-in questions about drawn shapes, for vision-language models), 'data' (prompt rows from
    --data.train/--data.eval), 'reasoning_gym:NAME' (a procedural reasoning-gym task, e.g. countdown), or
    package.module:function returning a meshrl.tasks.Task. Default: 'data' when --data.train is given, else
    'reverse'."""
    reward: str | None = None
    """Reward functions and weights, e.g. 'math_verify=1.0,format=0.1' or 'task=1.0,my_pkg.my_mod:fn=0.5': built-in
    (exact_match, char_match, exact, regex, math_verify, format, length_penalty), 'task' (the task's own verifier),
    or importable functions fn(completion: str, row: dict) -> float (sync or async). Default: the task's. With
    --env: a rubric scoring each episode's last answer, added to the environment's reward (default: none)."""
    data: DataConfig = field(default_factory=DataConfig)
    reverse: ReverseTaskConfig = field(default_factory=ReverseTaskConfig)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    shapes: ShapesConfig = field(default_factory=ShapesConfig)
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
        if self.placement.gpus is not None:
            self._lay_out_gpus(self.placement.gpus)
            k = self.grpo.max_staleness
        if k and self.generator.sleep_level:
            raise ConfigError(
                f"generator.sleep_level={self.generator.sleep_level} with grpo.max_staleness={k}: the asynchronous "
                "loop generates while the trainer trains, so the generators cannot sleep then; leave "
                "--generator.sleep-level unset (or 0), or run the synchronous loop (--grpo.max-staleness 0)"
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

    def _lay_out_gpus(self, gpus: int) -> None:
        """--placement.gpus N: the measured layout (meshrl.placement.gpu_layout), filling in only what was not
        placed explicitly (devices unset, counts and the micro-batch cap at their defaults). Runs again on each copy
        (dataclasses.replace) and gives the same result."""
        from meshrl.placement import gpu_layout

        if self.trainer.device != "cuda":
            # Placing GPUs says where the trainer computes: --trainer.device cuda is implied, not demanded (a
            # machine without the GPUs is refused at launch, preflight.check_gpu_count).
            self.trainer = replace(self.trainer, device="cuda")
        placed = self.trainer.devices is not None
        if not placed:
            chosen = self.trainer.num_procs == TrainerConfig.num_procs  # the CPU default: the layout chooses
            layout = gpu_layout(gpus, None if chosen else self.trainer.num_procs, self.placement.layout)
            trainer_gpus = layout.trainer_gpus
            self.trainer = replace(self.trainer, num_procs=len(trainer_gpus), devices=trainer_gpus)
        trainer_gpus = set(self.trainer.devices)
        if self.generator.devices is None:
            if placed:  # the user's trainer GPUs: generators on the others, else beside the trainer
                generator_gpus = [g for g in range(gpus) if g not in trainer_gpus] or sorted(trainer_gpus)
            else:
                generator_gpus = layout.generator_gpus
            replicas = self.generator.num_replicas
            if replicas == GeneratorConfig.num_replicas:
                replicas = len(generator_gpus)  # one replica per generator GPU
            self.generator = replace(self.generator, devices=generator_gpus, num_replicas=replicas)
        alone = not set(self.generator.devices) & trainer_gpus
        if alone and self.grpo.max_staleness == 0:
            self.grpo = replace(self.grpo, max_staleness=1)  # generation on GPUs of its own overlaps training
        if self.trainer.micro_batch_size == TrainerConfig.micro_batch_size:
            from meshrl.placement import ALONE_MICRO_BATCH_PER_RANK, SHARED_MICRO_BATCH_PER_RANK

            per_rank = ALONE_MICRO_BATCH_PER_RANK if alone else SHARED_MICRO_BATCH_PER_RANK
            # The cap counts sequences over all ranks (TrainerConfig.micro_batch_size): it grows with them, so that
            # each rank's calls stay as large as one rank's (4 ranks at 32: 8 calls of 8 sequences per rank).
            self.trainer = replace(self.trainer, micro_batch_size=per_rank * self.trainer.num_procs)

    def gpu_layout_note(self) -> str | None:
        """What --placement.gpus chose, for the run's log (None when it is unset)."""
        from meshrl.placement import gpu_layout

        gpus = self.placement.gpus
        if gpus is None:
            return None
        ranks, chosen = self.trainer.num_procs, gpu_layout(gpus, layout=self.placement.layout)
        measured = (self.trainer.devices, self.generator.devices) == (chosen.trainer_gpus, chosen.generator_gpus)
        if not measured and ranks == gpus and self.generator.devices == self.trainer.devices:
            measured, chosen = True, gpu_layout(gpus, ranks)  # colocated, as --trainer.num-procs asked
        why = chosen.why if measured else "placed partly by your flags: not a measured layout"
        return (
            f"--placement.gpus {gpus}: {ranks} trainer rank(s) on GPU {self.trainer.devices}, "
            f"{self.generator.num_replicas} generator(s) on GPU {self.generator.devices}, max-staleness "
            f"{self.grpo.max_staleness}, micro-batches of up to {self.trainer.micro_batch_size} sequences over the "
            f"ranks ({why})"
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
    """The most `forward_backward` calls a step of `global_batch_size` sequences takes: `micro_batch_size` is a cap
    on sequences per call (a batch smaller than it is one call; meshrl.batching bins sequences under it and the
    token budget), not a divisor. Refuses, naming the numbers, a batch the trainer ranks cannot split evenly."""
    if global_batch_size % dp:
        sizes = [m for m in range(max(dp, global_batch_size - 3 * dp), global_batch_size + 3 * dp + 1) if m % dp == 0]
        raise ConfigError(
            f"global_batch_size={global_batch_size} ({what}) does not split evenly over trainer.num_procs={dp} "
            f"trainer ranks; use a multiple of {dp} (e.g. {sizes}) or another --trainer.num-procs"
        )
    return -(-global_batch_size // min(micro_batch_size, global_batch_size))


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
    shapes: ShapesConfig = field(default_factory=ShapesConfig)
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
    shapes: ShapesConfig = field(default_factory=ShapesConfig)
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
