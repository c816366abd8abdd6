"""PolicyTrainer: one actor per trainer rank, FSDP2 across the mesh. Every rank gets every call (`.call()`),
takes its share of the batch and returns the same, already-reduced result."""

from __future__ import annotations

import os

import torch
from monarch.actor import Actor, current_rank, endpoint

from meshrl.timeline import BusyLog
from meshrl.types import Datum, ForwardBackwardResult, LossSpec, OptimParams, OptimResult
from meshrl.weight_sync.cuda_ipc import CudaIpcHandle, device_identity, remove_shared_files
from meshrl.weight_sync.transport import DEFAULT_STORE, SHARED_BUFFER_TRANSPORTS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class PolicyTrainer(Actor):
    def __init__(self, model_dir: str, model_cfg, trainer_cfg, pad_id: int = 0) -> None:
        torch.set_num_threads(trainer_cfg.num_threads)
        self.model_dir, self.model_cfg, self.trainer_cfg, self.pad_id = (
            model_dir,
            model_cfg,
            trainer_cfg,
            pad_id,
        )
        self.policy = None
        self.weight_transport = "torchstore"  # set_weight_sync: the controller resolves it once the processes run
        self.weight_handle = None  # rank 0, shared-buffer transports: the buffer's handle, for the generators
        self.busy_log = BusyLog(f"trainer:{current_rank().rank}")  # the run's timeline (meshrl.timeline)

    def _policy(self):
        if self.policy is None:
            raise RuntimeError("PolicyTrainer.setup() was not called")
        return self.policy

    @endpoint
    async def setup(self) -> dict:
        from meshrl.policy import policy_from_env

        self.policy = policy_from_env(
            self.model_dir,
            attn_backend=self.model_cfg.attn_backend,
            param_dtype=self.model_cfg.dtype,
            device=self.trainer_cfg.device,
            pad_id=self.pad_id,
            backend=self.model_cfg.backend,
            backend_options=self.model_cfg.backend_options(),
            **self.trainer_cfg.policy_options(),  # speed levers
        )
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
            "device_identity": device_identity(p.device),
            # this rank's peak device memory since the trainer started (None on CPU)
            "peak_memory_gib": (torch.cuda.max_memory_allocated(p.device) / 2**30 if p.device.type == "cuda" else None),
        }

    @endpoint
    async def forward_backward(
        self, data: list[Datum], loss: LossSpec, step: OptimParams | None = None
    ) -> ForwardBackwardResult:
        with self.busy_log.busy("forward_backward"):
            return self._policy().forward_backward(data, loss, step)

    @endpoint
    async def forward(self, data: list[Datum], temperature: float = 1.0) -> list[list[float]]:
        with self.busy_log.busy("forward"):
            return self._policy().forward(data, temperature)

    @endpoint
    async def timeline(self) -> list[dict]:
        """This rank's busy intervals since the last call (meshrl.timeline)."""
        return self.busy_log.take()

    @endpoint
    async def optim_step(self, params: OptimParams) -> OptimResult:
        return self._policy().optim_step(params)

    @endpoint
    async def set_weight_sync(self, transport: str) -> None:
        """'torchstore', 'cuda_ipc' or 'shm' (resolved by the controller, meshrl.weight_sync.transport)."""
        if transport not in ("torchstore", *SHARED_BUFFER_TRANSPORTS):
            raise ValueError(f"weight transport {transport!r}; use 'torchstore', 'cuda_ipc' or 'shm'")
        self.weight_transport = transport

    @endpoint
    async def push_weights(self, version: int, dtype: str = "float32", store_name: str = DEFAULT_STORE) -> int:
        """Gather the full weights (collective) and publish them from rank 0 under `version`, cast to `dtype`:
        into torchstore, or into rank 0's shared flat buffer (allocated on the first push; 'cuda_ipc' on its GPU,
        'shm' in /dev/shm on CPU). Returns the bytes published (0 on the other ranks)."""
        with self.busy_log.busy("push_weights"):
            return await self._push_weights(version, dtype, store_name)

    async def _push_weights(self, version: int, dtype: str, store_name: str) -> int:
        p = self._policy()
        if self.weight_transport == "torchstore":
            from meshrl.weight_sync.store import push_weights

            state_dict = p.hf_state_dict(_DTYPES[dtype])
            return await push_weights(state_dict, version, store_name=store_name) if p.rank == 0 else 0
        handle = p.publish_weights_ipc(version, _DTYPES[dtype])  # collective; the handle on rank 0 only
        if handle is None:
            return 0
        backing = "shm" if handle.buffer[0] == "shm" else "cuda_ipc"
        if backing != self.weight_transport:  # the config checks rule this out; say so if they ever disagree
            raise RuntimeError(f"weight transport {self.weight_transport!r}, but the trainer's buffer is {backing!r}")
        self.weight_handle = handle
        return handle.layout.payload_nbytes

    @endpoint
    async def weight_buffer(self) -> CudaIpcHandle | None:
        """The shared buffer's handle (rank 0, after the first push with a shared-buffer transport), else None."""
        return self.weight_handle

    async def __cleanup__(self, exc: Exception | None) -> None:
        # Monarch calls this when the mesh stops. The buffer's host files (and a CPU buffer's /dev/shm memory) would
        # otherwise outlive the run; mappings that generators hold keep working until they exit.
        if self.weight_handle is not None:
            remove_shared_files(self.weight_handle)
            self.weight_handle = None

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
