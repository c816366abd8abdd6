"""PolicyTrainer: one actor per trainer rank, FSDP2 across the mesh. Every rank gets every call (`.call()`),
takes its share of the batch and returns the same, already-reduced result."""

from __future__ import annotations

import os

import torch
from monarch.actor import Actor, current_rank, endpoint

from meshrl.devices import freeze_startup_heap, machine_identity, pin_process
from meshrl.timeline import BusyLog
from meshrl.types import Datum, ForwardBackwardResult, LossSpec, OptimParams, OptimResult
from meshrl.weight_sync.pubsub import StorePublisher, make_publisher
from meshrl.weight_sync.shared_buffer import SharedBufferHandle, device_identity
from meshrl.weight_sync.transport import DEFAULT_STORE

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class PolicyTrainer(Actor):
    def __init__(self, model_dir: str, model_cfg, trainer_cfg, pad_id: int = 0) -> None:
        # Before CUDA starts in this process. `devices` are GPUs of each host: index them by the rank on this host.
        here = current_rank()
        pin_process(trainer_cfg.devices, here["procs"] if "procs" in here.keys() else here.rank)
        torch.set_num_threads(trainer_cfg.num_threads)
        self.model_dir, self.model_cfg, self.trainer_cfg, self.pad_id = (
            model_dir,
            model_cfg,
            trainer_cfg,
            pad_id,
        )
        self.policy = None
        # torchstore until set_weight_sync: the controller resolves the transport once the processes run.
        self.publisher = make_publisher("torchstore")
        self.busy_log = BusyLog(f"trainer:{current_rank().rank}")  # the run's timeline (meshrl.timeline)

    def _policy(self):
        if self.policy is None:
            raise RuntimeError("PolicyTrainer.setup() was not called")
        return self.policy

    @endpoint
    async def setup(self) -> dict:
        from meshrl.policy import policy_from_env

        self.policy = policy_from_env(self.model_dir, self.model_cfg, self.trainer_cfg, self.pad_id)
        freeze_startup_heap()
        return self._info()

    @endpoint
    async def info(self) -> dict:
        return self._info()

    def _info(self) -> dict:
        p = self._policy()
        return {
            "rank": p.rank,
            "world_size": p.world_size,
            "num_params": p.num_params,
            "num_trainable_params": sum(q.numel() for g in p.optimizer.param_groups for q in g["params"]),
            "policy_version": p.policy_version,
            "max_seq_len": p.max_seq_len,
            "pid": os.getpid(),
            "machine": machine_identity(),  # whose pid this is (the controller kills only its own machine's)
            "device_identity": device_identity(p.device),
            # this rank's peak device memory since the trainer started (None on CPU)
            "peak_memory_gib": (torch.cuda.max_memory_allocated(p.device) / 2**30 if p.device.type == "cuda" else None),
        }

    @endpoint
    async def forward_backward(
        self, data: list[Datum], loss: LossSpec, step: OptimParams | None = None, split: list[int] | None = None
    ) -> ForwardBackwardResult:
        """`split`: how many of `data` (rank-major) each rank computes; None: an even split. Returns numbers reduced
        over the ranks (loss, metrics, logprob mismatch); per-datum logprobs only with `loss.return_logprobs`."""
        with self.busy_log.busy("forward_backward"):
            return self._policy().forward_backward(data, loss, step, split)

    @endpoint
    async def forward(
        self, data: list[Datum], temperature: float = 1.0, split: list[int] | None = None
    ) -> list[list[float]]:
        with self.busy_log.busy("forward"):
            return self._policy().forward(data, temperature, split)

    @endpoint
    async def token_budget(self) -> int:
        """Tokens this rank can take in one forward_backward call now (Policy.token_budget)."""
        return self._policy().token_budget()

    @endpoint
    async def memory(self) -> dict:
        """This rank's device memory (GiB): allocated and reserved now, peak since the last call."""
        return self._policy().memory()

    @endpoint
    async def release_cached_memory(self) -> int:
        """The allocator's cached blocks back to the device (for a colocated generator); bytes released."""
        return self._policy().release_cached_memory()

    @endpoint
    async def offload_optimizer_state(self) -> int:
        """AdamW state to host memory while a colocated generator runs; the next forward_backward / optim_step /
        checkpoint brings it back. Returns the bytes moved."""
        with self.busy_log.busy("offload"):
            return self._policy().offload_optimizer_state()

    @endpoint
    async def timeline(self) -> list[dict]:
        """This rank's busy intervals since the last call (meshrl.timeline)."""
        return self.busy_log.take()

    @endpoint
    async def optim_step(self, params: OptimParams) -> OptimResult:
        return self._policy().optim_step(params)

    @endpoint
    async def set_weight_sync(self, transport: str, store_name: str = DEFAULT_STORE, gather: bool = False) -> None:
        """'torchstore', 'cuda_ipc' or 'shm' (resolved by the controller, meshrl.weight_sync.transport). `gather`:
        over torchstore, gather whole tensors to rank 0 instead of each rank publishing its shards (a baseline)."""
        if self.publisher is not None:
            self.publisher.close()
        self.publisher = make_publisher(transport, store_name, gather)

    @endpoint
    async def push_weights(self, version: int, dtype: str = "float32", store_name: str | None = None) -> int:
        """Publish the weights under `version`, cast to `dtype`, with the run's transport (collective;
        meshrl.weight_sync.pubsub): over torchstore each rank its own shards, over a shared buffer rank 0 the
        gathered weights. Returns the bytes this rank published."""
        if store_name is not None and isinstance(self.publisher, StorePublisher):
            self.publisher.store_name = store_name
        with self.busy_log.busy("push_weights"):
            return await self.publisher.publish(self._policy(), version, _DTYPES[dtype])

    @endpoint
    async def weight_buffer(self) -> SharedBufferHandle | None:
        """The shared buffer's handle (rank 0, after the first push with a shared-buffer transport), else None."""
        return self.publisher.handle()

    async def __cleanup__(self, exc: Exception | None) -> None:
        # Monarch calls this when the mesh stops: the publisher removes what would outlive the run.
        if self.publisher is not None:
            self.publisher.close()

    @endpoint
    async def save_checkpoint(self, path: str) -> None:
        """Full training state (model + optimiser + policy version), torch DCP, sharded over the ranks."""
        self._policy().save_state(path)

    @endpoint
    async def load_checkpoint(self, path: str) -> int:
        """Restore `save_checkpoint`'s state (any number of ranks); returns the restored policy version."""
        return self._policy().load_state(path)

    @endpoint
    async def export_hf(self, path: str, dtype: str | None = None) -> str | None:
        """Weights in HF format (rank 0 writes atomically); returns the path."""
        return self._policy().save_hf(path, _DTYPES[dtype] if dtype else None)

    @endpoint
    async def export_adapter(self, path: str) -> str | None:
        """LoRA adapters only, in peft's format (adapter_model.safetensors + adapter_config.json; rank 0 writes
        atomically); `export_hf` writes the merged model instead. Returns the path."""
        return self._policy().backend.save_adapter(path)

    @endpoint
    async def load_hf(self, path: str) -> int:
        """Load HF weights (fresh optimiser); returns the new policy version."""
        self._policy().load_hf(path)
        return self._policy().policy_version
