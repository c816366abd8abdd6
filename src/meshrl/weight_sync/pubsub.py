"""Weight sync as one publisher / subscriber pair per transport: the trainer's actors call
`publisher.publish(policy, version, dtype)`, the generators' `subscriber.load(engine, version)`, and neither knows
which transport runs underneath (`transport.py` resolves it; the controller holds one `WeightSync`,
controller/weight_sync.py).

| transport  | publisher (trainer, every rank)                       | subscriber (each generator)                   |
| ---------- | ----------------------------------------------------- | --------------------------------------------- |
| torchstore | each rank puts its own shards into torchstore         | gets every rank's chunks of exactly `version`  |
| cuda_ipc   | rank 0 copies into its persistent flat GPU buffer     | copies out through the IPC handle (sent once) |
| shm        | the same flat buffer in /dev/shm (CPU runs and tests) | the same, from the mapped file                |

No Monarch in here; torchstore is imported only where used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from meshrl.weight_sync.shared_buffer import SharedBufferHandle, SharedBufferReceiver
from meshrl.weight_sync.transport import DEFAULT_STORE, SHARED_BUFFER_TRANSPORTS

if TYPE_CHECKING:
    from meshrl.generation.base import Engine


class WeightPublisher(Protocol):
    transport: str

    async def publish(self, policy: Any, version: int, dtype: torch.dtype) -> int:
        """Publish the policy's full weights under `version`, cast to `dtype` (collective over the trainer ranks);
        the bytes this rank published."""
        ...

    def handle(self) -> Any:
        """What a subscriber needs to attach (the shared buffer's handle, on rank 0 after the first publish), or
        None."""
        ...

    def close(self) -> None: ...


class WeightSubscriber(Protocol):
    transport: str

    async def load(self, engine: Engine, version: int) -> int:
        """Load exactly `version` into `engine` (or raise, keeping the weights it has)."""
        ...

    def close(self) -> None: ...


class StorePublisher:
    """'torchstore': every rank puts its own shards into the store (`store.put_rank`), rank 0 then makes the
    version visible. The chunk buffers (pinned host memory on a GPU) are kept for the next version."""

    transport = "torchstore"

    def __init__(self, store_name: str = DEFAULT_STORE, gather: bool = False) -> None:
        self.store_name = store_name
        self.gather = gather  # gather whole tensors to rank 0 anyway (the benchmarks' baseline)
        self._buffers: list[torch.Tensor] | None = None
        self.gathered = False  # whether the last publish needed whole tensors (rank 0 published them alone)

    async def publish(self, policy: Any, version: int, dtype: torch.dtype) -> int:
        import torch.distributed as dist

        from meshrl.weight_sync.store import finish_version, put_rank

        shards, num_ranks = (None if self.gather else policy.weight_shards()), policy.world_size
        self.gathered = shards is None
        if shards is None:  # the same on every rank: they run the same code on the same model
            whole = policy.hf_state_dict(dtype)  # collective: every rank takes part
            if policy.rank != 0:
                return 0
            shards, num_ranks = whole, 1
        nbytes, self._buffers = await put_rank(
            shards, version, rank=policy.rank, dtype=dtype, store_name=self.store_name, buffers=self._buffers
        )
        if num_ranks > 1:
            dist.barrier()  # every rank's chunks and table are in the store
        if policy.rank == 0:
            await finish_version(version, num_ranks, store_name=self.store_name)
        return nbytes

    def handle(self) -> None:
        return None

    def close(self) -> None:
        self._buffers = None


class SharedBufferPublisher:
    """'cuda_ipc' / 'shm': rank 0 copies into its flat buffer (allocated on the first publish)."""

    def __init__(self, transport: str) -> None:
        if transport not in SHARED_BUFFER_TRANSPORTS:
            raise ValueError(f"{transport!r} is not a shared-buffer transport ({SHARED_BUFFER_TRANSPORTS})")
        self.transport = transport
        self._handle: SharedBufferHandle | None = None

    async def publish(self, policy: Any, version: int, dtype: torch.dtype) -> int:
        handle = policy.publish_weights_ipc(version, dtype)  # collective; the handle on rank 0 only
        if handle is None:
            return 0
        backing = "shm" if handle.buffer[0] == "shm" else "cuda_ipc"
        if backing != self.transport:  # the config checks rule this out; say so if they ever disagree
            raise RuntimeError(f"weight transport {self.transport!r}, but the trainer's buffer is {backing!r}")
        self._handle = handle
        return handle.layout.payload_nbytes

    def handle(self) -> SharedBufferHandle | None:
        return self._handle

    def close(self) -> None:
        # The buffer and its files belong to the trainer's sender (`Policy.publish_weights_ipc`), which goes on
        # publishing into them after this publisher is replaced (`set_weight_sync` again): removing the files here
        # left a live buffer that no replacement generator could open. The sender removes them when it goes (its
        # process's exit included); the controller at the end of its run (a SIGKILLed trainer); the next start
        # those of runs whose processes are all gone (`shared_buffer.remove_stale_files`).
        self._handle = None


def make_publisher(transport: str, store_name: str = DEFAULT_STORE, gather: bool = False) -> WeightPublisher:
    if transport == "torchstore":
        return StorePublisher(store_name, gather)
    if transport in SHARED_BUFFER_TRANSPORTS:
        return SharedBufferPublisher(transport)
    raise ValueError(f"weight transport {transport!r}; use 'torchstore', 'cuda_ipc' or 'shm'")


class StoreSubscriber:
    """'torchstore': get exactly `version` from the store."""

    transport = "torchstore"

    def __init__(self, store_name: str = DEFAULT_STORE) -> None:
        self.store_name = store_name

    async def load(self, engine: Engine, version: int) -> int:
        from meshrl.weight_sync.store import pull_weight_pieces

        # An engine that loads in this process takes blocks already on its GPU (one copy per chunk); vLLM's
        # workers load in their own processes, so they get host tensors.
        device = None if engine.loads_in_workers else engine.device
        engine.load_weight_pieces(await pull_weight_pieces(version, store_name=self.store_name, device=device))
        return version

    def close(self) -> None:
        pass


class SharedBufferSubscriber:
    """'cuda_ipc' / 'shm': the handle (sent once) and `load(engine, version)`, which loads exactly `version` or
    raises. The trainer only overwrites a slot that is neither the latest version nor being read, and a reader only
    reads a slot marked with the version it asked for (`shared_buffer.py`), so what is loaded is one whole version."""

    def __init__(self, handle: SharedBufferHandle, engine: Engine) -> None:
        self.handle = handle
        # vLLM copies inside its worker processes, which open the handle themselves (`engine.load_weights_ipc`); an
        # engine that loads in this process (TransformersEngine) loads views that this process maps once, here, so a bad
        # handle fails now.
        self._in_workers = engine.loads_in_workers
        self._receiver = None if self._in_workers else SharedBufferReceiver(handle)

    @property
    def transport(self) -> str:
        return "shm" if self.handle.buffer[0] == "shm" else "cuda_ipc"

    async def load(self, engine: Engine, version: int) -> int:
        return self.load_now(engine, version)

    def load_now(self, engine: Engine, version: int) -> int:
        if self._in_workers:
            got = engine.load_weights_ipc(self.handle, version)
        else:
            got = self._receiver.load_into(engine, version)
        if got != version:  # the protocol makes this impossible; never serve a version that was not asked for
            raise RuntimeError(f"asked the shared weight buffer for version {version} but version {got} was loaded")
        return got

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None


__all__ = [
    "SharedBufferPublisher",
    "SharedBufferSubscriber",
    "StorePublisher",
    "StoreSubscriber",
    "WeightPublisher",
    "WeightSubscriber",
    "make_publisher",
]
