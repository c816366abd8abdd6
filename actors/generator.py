"""Generator: one actor per engine replica. Token ids in, token ids + per-token logprobs out, each completion
stamped with the policy version of the weights that produced it."""

from __future__ import annotations

import os

import torch
from monarch.actor import Actor, current_rank, endpoint

from meshrl.devices import freeze_startup_heap, pin_process
from meshrl.generation.base import Engine
from meshrl.timeline import BusyLog
from meshrl.types import Completion, SamplingParams
from meshrl.weight_sync.shared_buffer import device_identity
from meshrl.weight_sync.transport import DEFAULT_STORE


class StaleWeightsError(RuntimeError):
    pass


def _renice(increment: int) -> None:
    """Lower the priority of the thread that runs this actor's endpoints (generation) by `increment`. Linux keeps a
    niceness per thread, and this one is deliberately the only one: Monarch's runtime threads keep theirs, so the
    messages they carry (weight loads, the next batch) are not delayed. Measured on the CPU main job: 0.72x of the
    synchronous RL time this way, 0.79x with every thread of the process reniced (bench/NOTES.md)."""
    os.nice(increment)


class Generator(Actor):
    def __init__(self, model_dir: str, gen_cfg, seed: int = 0, replica: int | None = None) -> None:
        # `replica`: this generator's index in the run (each replica is a mesh of its own: its rank there is 0).
        replica = current_rank().rank if replica is None else replica
        pin_process(gen_cfg.devices, replica)  # before CUDA starts in this process
        torch.set_num_threads(1)
        if gen_cfg.nice:
            _renice(gen_cfg.nice)  # the trainer ranks run first where processes outnumber cores
        self.model_dir, self.cfg, self.seed = model_dir, gen_cfg, seed
        self.engine: Engine | None = None
        self.policy_version = 0
        self.subscriber = None  # torchstore until attach_weight_buffer (meshrl.weight_sync.pubsub)
        self.busy_log = BusyLog(f"generator:{replica}")  # the run's timeline (meshrl.timeline)

    def _engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("Generator.setup() was not called")
        return self.engine

    @endpoint
    async def setup(self) -> dict:
        c = self.cfg
        # The engine's own config goes whole; the generator's shared settings beside it.
        shared = dict(
            dtype=c.dtype,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            kv_cache_memory_bytes=c.kv_cache_memory_bytes,
            seed=self.seed,
        )
        if c.engine == "transformers":  # no vLLM needed: machines without it, any transformers causal LM
            from meshrl.generation.transformers_engine import TransformersEngine

            self.engine = TransformersEngine(self.model_dir, c.transformers, **shared)
        else:
            from meshrl.generation.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(self.model_dir, c.vllm, **shared)
        freeze_startup_heap()
        return {
            "policy_version": self.policy_version,
            "max_model_len": self.engine.max_model_len,
            "engine": c.engine,
            "device_identity": device_identity(self.engine.device),
            "supports_sleep": self.engine.supports_sleep,
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    @endpoint
    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, expected_version: int | None = None,
        images: list[tuple[bytes, ...]] | None = None,
    ) -> list[list[Completion]]:  # fmt: skip
        """`images`: per prompt, its encoded images (a vision-language model; None: text only)."""
        if expected_version is not None and expected_version != self.policy_version:
            raise StaleWeightsError(
                f"generator holds policy_version={self.policy_version} but {expected_version} was asked for; "
                "call pull_weights first"
            )
        with self.busy_log.busy("generate"):
            if images is None:
                return self._engine().generate(prompts, params, self.policy_version)
            return self._engine().generate(prompts, params, self.policy_version, images=images)

    @endpoint
    async def sleep(self, level: int = 1) -> dict:
        """Free device memory while a colocated trainer trains: level 1 the KV cache (weights stay loadable), level 2
        the weights too (`meshrl.generation.base` says what each engine keeps). `generate` / `prompt_logprobs` wake
        the engine again by themselves; `pull_weights` works while asleep. A no-op where the engine cannot sleep
        (vLLM on CPU). Returns `memory()` after the sleep."""
        with self.busy_log.busy("sleep"):
            self._engine().sleep(level)
        return self._engine().memory()

    @endpoint
    async def wake_up(self) -> dict:
        """Re-allocate what `sleep` freed (CUDA graphs are captured again on first use). Returns `memory()`."""
        with self.busy_log.busy("wake_up"):
            self._engine().wake_up()
        return self._engine().memory()

    @endpoint
    async def memory(self) -> dict:
        """This process's memory on the engine's device: 'allocated_bytes', 'reserved_bytes' (torch; 0 on CPU),
        'rss_bytes', 'sleep_level' (0: awake), and per engine e.g. 'kv_cache_bytes', 'device_used_bytes'."""
        return self._engine().memory()

    @endpoint
    async def timeline(self) -> list[dict]:
        """This replica's busy intervals since the last call (meshrl.timeline)."""
        return self.busy_log.take()

    @endpoint
    async def prompt_logprobs(
        self, sequences: list[list[int]], images: list[tuple[bytes, ...]] | None = None
    ) -> list[list[float]]:
        if images is None:
            return self._engine().prompt_logprobs(sequences)
        return self._engine().prompt_logprobs(sequences, images=images)

    @endpoint
    async def attach_weight_buffer(self, handle) -> str:
        """Pull weights from now on from the trainer's shared buffer ('cuda_ipc' / 'shm' transport; `handle`:
        `meshrl.weight_sync.shared_buffer.SharedBufferHandle`, sent once by the controller); None: from torchstore
        again (the controller's fallback where the buffer cannot be opened). Returns the transport."""
        from meshrl.weight_sync.pubsub import SharedBufferSubscriber

        # The new one first: a handle that cannot be opened leaves this generator on the buffer it had.
        subscriber = None if handle is None else SharedBufferSubscriber(handle, self._engine())
        if self.subscriber is not None:
            self.subscriber.close()
        self.subscriber = subscriber
        return "torchstore" if subscriber is None else subscriber.transport

    @endpoint
    async def pull_weights(self, version: int, store_name: str = DEFAULT_STORE) -> int:
        """Load exactly the weights pushed under `version` in place (from the shared buffer once one is attached,
        else from torchstore) and reset the prefix cache. An unavailable version raises and keeps the old one."""
        from meshrl.weight_sync.pubsub import StoreSubscriber

        if version < self.policy_version:
            raise StaleWeightsError(f"refusing to go back from policy_version={self.policy_version} to {version}")
        subscriber = self.subscriber or StoreSubscriber(store_name)
        with self.busy_log.busy("pull_weights"):
            await subscriber.load(self._engine(), version)  # checks that exactly `version` was loaded
        self.policy_version = version
        return version

    async def __cleanup__(self, exc: Exception | None) -> None:
        # Monarch calls this when the mesh stops: let go of the trainer's shared buffer before this process exits,
        # so CUDA IPC's reference count on the trainer's side drops to zero.
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None

    @endpoint
    async def info(self) -> dict:
        transport = "torchstore" if self.subscriber is None else self.subscriber.transport
        return {"policy_version": self.policy_version, "engine": self.cfg.engine, "weight_sync": transport}
