"""The trainer's sections, read whole by `meshrl.policy.Policy` and the backends it builds: `ModelConfig`
(`--model.*`: the checkpoint or new model to start from, its trainer code, dtype and LoRA) and `TrainerConfig`
(`--trainer.*`: processes, devices, micro-batches, speed and memory levers). Imports neither torch nor transformers,
so `meshrl.config` nests them cheaply.

    Policy(model_dir, ModelConfig(backend="hf"), TrainerConfig(num_procs=1, logprob_chunk_size=4096), pad_id)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshrl.devices import check_devices
from meshrl.errors import ConfigError

VLM_FLAVORS = {"tiny-qwen2.5-vl": "qwen2_5_vl", "tiny-qwen3-vl": "qwen3_vl"}
"""New tiny vision-language models (meshrl.models.tiny_vlm), by flavor name."""


@dataclass
class ModelConfig:
    path: str | None = None
    """HF-format checkpoint dir (config.json, model.safetensors, tokenizer) to start from. If unset, a model of
    `flavor` is initialised at random (seeded) and saved into the run directory first."""
    flavor: str = "tiny"
    """Used only without `path`: 'tiny' (a few hundred thousand parameters, for CPU), 'small' (a ~63M-parameter
    Qwen3, for a GPU: the gpu-math preset), a torchtitan Qwen3 flavor ('0.6B', '1.7B', '4B', '8B', '14B', '32B'),
    or a tiny vision-language model: 'tiny-qwen2.5-vl', 'tiny-qwen3-vl' (with --model.backend hf)."""
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
    freeze_vision: bool = False
    """Vision-language models: keep the vision tower (and its projector into the language model) as the checkpoint
    has it; only the language model trains. Off: every weight trains, and weight sync carries the vision weights."""

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
        if self.path is None and self.flavor in VLM_FLAVORS and self.backend != "hf":
            raise ConfigError(
                f"model.flavor={self.flavor!r} is a vision-language model: it trains with --model.backend hf"
            )
        if self.path is None and self.flavor not in ("tiny", "small") and self.flavor not in VLM_FLAVORS:
            from meshrl.models.qwen3 import TITAN_FLAVORS

            if self.flavor not in TITAN_FLAVORS:
                raise ConfigError(
                    f"model.flavor={self.flavor!r} is unknown; use 'tiny', 'small' or one of {sorted(TITAN_FLAVORS)}, "
                    "or set model.path to an HF checkpoint dir"
                )

    def lora_options(self) -> dict | None:
        """The `peft.LoraConfig` fields of the adapters (`HFBackend` builds them, seeded by `seed`); None without
        LoRA."""
        if not self.lora_rank:
            return None
        t = self.lora_target_modules.strip()
        targets = t if t == "all-linear" else [m.strip() for m in t.split(",") if m.strip()]
        return {"r": self.lora_rank, "lora_alpha": self.lora_alpha, "target_modules": targets}


@dataclass
class TrainerConfig:
    num_procs: int = 2
    """Trainer processes (FSDP2 data-parallel shards)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer processes compute."""
    micro_batch_size: int = 32
    """At most this many sequences per `forward_backward` call, summed over all trainer ranks (the token budget
    below may make calls smaller). A cap, not a divisor: a step's batch smaller than it is one call."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of one `forward_backward` call per trainer rank, counted as the trainer lays the sequences out
    (packed rows, or rows padded to the longest). A step's sequences are binned by length into calls under it,
    balanced over the ranks; the update equals one big batch either way. None: what the device has free when the
    step starts, over an estimate of the memory per token (meshrl.batching), so long completions never need a
    hand-set micro_batch_size."""
    devices: list[int] | None = None
    """GPU index of each trainer rank (rank r on devices[r]; meshrl.devices). None: rank r on its LOCAL_RANK.
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
    values to float32 rounding. 2048-8192 suits a 151k vocabulary; 4096 trained faster on one H100 (bench/NOTES.md,
    'after+chunk') and is what --run.gpu-defaults sets on a machine with GPUs."""
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
    defer_grad_sync: bool = False
    """Speed/memory lever, several trainer ranks (FSDP2): the gradients of a step's `forward_backward` calls
    accumulate unsharded on each rank and are reduce-scattered once, in the step's last call, instead of once per
    call; the parameters also stay gathered between the calls (no all-gather per call). Costs the unsharded
    gradients and parameters on every rank (e.g. ~7 GB at 0.6B parameters with fp32 masters) for k-1 fewer
    reduce-scatters and all-gathers per step of k calls. The same update to float rounding (summed in another
    order; tested); no effect on one rank."""
    optimizer_cuda_graph: bool = False
    """Speed lever, one GPU without FSDP sharding (e.g. master_dtype='bfloat16', num_procs=1): the optimiser step
    (grad norm, clip, AdamW, zeroing) is replayed as CUDA graphs instead of launches built on the host (~5 ms of
    host work per step at 0.6B parameters). It pays off when `optim_step` is a call of its own (the GPU idles
    while the host builds the launches); when the step rides on the last `forward_backward` (the controller
    loops' way) that host work hides behind the backward and the graph's cost wins: gradients stay allocated
    and backward adds into them (~2 ms more GPU work per step at 0.6B). Falls back to the eager step, with a
    warning, if capture fails; no effect on CPU or with FSDP."""
    expandable_segments: bool = True
    """GPU: torch's CUDA allocator maps memory into growing segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
    torchtitan's default) instead of caching fixed blocks. Token-budget calls of different sizes otherwise fragment
    the cache: on 4x H100 (0.6B, 1024 sequences a step) a rank held 19 GiB reserved but unusable beside 58.5 GiB in
    use and ran out of memory in step 1's first call (bench/NOTES.md). A PYTORCH_CUDA_ALLOC_CONF of your own takes
    precedence. The weight buffer that generators read over CUDA IPC is allocated outside these segments."""
    collective_timeout_s: float = 600.0
    """Several trainer ranks: a collective (FSDP all-gather / reduce-scatter, the weight gather) that waits longer
    than this for the other ranks fails the trainer (torch's NCCL watchdog) instead of hanging it. With
    TORCH_NCCL_TRACE_BUFFER_SIZE=N and TORCH_NCCL_DUMP_ON_TIMEOUT=1 in the environment, each rank then writes its
    last N collectives (torch's flight recorder) to TORCH_FR_DUMP_TEMP_FILE<rank>: which rank stopped where."""

    def __post_init__(self) -> None:
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"trainer.collective_timeout_s={self.collective_timeout_s} must be > 0 (seconds)")
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


def check_precision(model: ModelConfig, trainer: TrainerConfig) -> None:
    if trainer.master_dtype == "bfloat16" and model.dtype != "bfloat16":
        raise ConfigError(
            f"trainer.master_dtype='bfloat16' with model.dtype={model.dtype!r}: the compute cannot be more precise "
            "than the weights; use --model.dtype bfloat16, or keep trainer.master_dtype float32"
        )
