"""Make torchstore 0.1.2 (PyPI) run on torchmonarch 0.7.0.

torchstore 0.1.2 was written against torchmonarch 0.1.2; we install it ``--no-deps`` on top of
monarch 0.7.0. Three things need fixing, all done by :func:`apply_torchstore_compat`:

1. **Controller endpoint kinds.** ``torchstore.controller.Controller`` mixes ``async`` endpoints
   (``init``, ``teardown``) with plain ``def`` endpoints (``locate_volumes``, ``notify_put``, ...).
   Monarch 0.7.0 refuses to spawn such an actor ("mixes both async and sync endpoints", see
   ``monarch/_src/actor/actor_mesh.py``) because a blocking sync endpoint could deadlock the
   actor's asyncio loop. :class:`CompatController` re-declares every sync endpoint as ``async``
   (delegating to the original function) and is installed as ``torchstore.api.Controller``, which
   is the name ``torchstore.api._controller`` hands to ``get_or_spawn_controller``. It is a
   module-level class so it pickles by reference (``meshrl.weight_sync.torchstore_compat``).

2. **Transport.** ``torchstore.transport.buffers.rdma_available()`` picks RDMA when
   ``TORCHSTORE_RDMA_ENABLED`` (default "1") and monarch reports ibverbs. Its RDMA buffer code
   targets the 0.1.x ``RDMABuffer`` API, and our CPU boxes have no RDMA anyway, so we default
   ``TORCHSTORE_RDMA_ENABLED=0`` (``setdefault``: export ``TORCHSTORE_RDMA_ENABLED=1`` to opt back
   in). Tensors then travel as plain Monarch messages (``MonarchTransportBuffer``). The flag is
   read on every put/get by the *calling* process, so this must run in each process that calls
   put/get; the ``meshrl.weight_sync.store`` functions call it for you.

3. **Import side effects.** Importing torchstore without ``HYPERACTOR_CODEC_MAX_FRAME_LENGTH`` set
   calls ``torchstore.init_logging()`` (root logger -> INFO + a stdout handler) and sets the frame
   limit to ~900 GB. We set the variable first to monarch 0.7.0's own default (10 GiB, ample for a
   single tensor) so the import changes nothing.

4. **Shared memory on one host** (not a fix; a faster path): between a client and a storage volume that share
   /dev/shm, tensors travel as files there instead of inside Monarch messages (`torchstore_shm.py`, which says
   why and by how much). A volume elsewhere falls back to messages by itself. ``MESHRL_TORCHSTORE_SHM=0`` turns
   it off (the benchmarks' baseline).

Everything is idempotent: applying twice in a process is a no-op.
"""

from __future__ import annotations

import os
import threading

_DEFAULT_FRAME_LENGTH = str(10 * 1024**3)  # monarch 0.7.0's default codec_max_frame_length

_lock = threading.Lock()
_applied = False


def _set_env_defaults() -> None:
    os.environ.setdefault("HYPERACTOR_CODEC_MAX_FRAME_LENGTH", _DEFAULT_FRAME_LENGTH)
    os.environ.setdefault("TORCHSTORE_RDMA_ENABLED", "0")


# The env defaults must be in place before torchstore is first imported (point 3).
_set_env_defaults()

from monarch.actor import current_rank, endpoint  # noqa: E402
from torchstore.controller import Controller as _TSController  # noqa: E402
from torchstore.strategy import TorchStoreStrategy  # noqa: E402


def _orig(name: str):
    """The plain function behind a torchstore Controller endpoint."""
    return getattr(_TSController, name)._method


class CompatController(_TSController):
    """torchstore's Controller with all endpoints async (monarch 0.7.0 forbids mixing)."""

    @endpoint
    async def get_controller_strategy(self):
        return _orig("get_controller_strategy")(self)

    @endpoint
    async def locate_volumes(self, key: str):
        return _orig("locate_volumes")(self, key)

    @endpoint
    async def notify_put(self, key: str, request, storage_volume_id: str) -> None:
        return _orig("notify_put")(self, key, request, storage_volume_id)

    @endpoint
    async def keys(self, prefix=None):
        return _orig("keys")(self, prefix)

    @endpoint
    async def notify_delete(self, key: str, storage_volume_id: str) -> None:
        return _orig("notify_delete")(self, key, storage_volume_id)


class RankVolumes(TorchStoreStrategy):
    """One storage volume per trainer rank: a process puts into volume RANK % num_volumes (RANK as
    torch.distributed sets it; 0 where unset), so the ranks' chunks land in parallel, in different processes.
    Gets find any key through torchstore's controller, whichever volume holds it. (torchstore's LocalRankStrategy
    keys on LOCAL_RANK, which is the same on every host and is not set in every process.)"""

    def __init__(self, num_volumes: int) -> None:
        super().__init__()
        self.num_volumes = num_volumes

    @classmethod
    def get_volume_id(cls) -> str:
        return str(current_rank().rank)  # called in each volume process as it starts: its rank in the volume mesh

    def get_client_id(self) -> str:
        return str(int(os.environ.get("RANK", "0")) % self.num_volumes)


def _all_endpoints_async(cls) -> bool:
    import inspect

    from monarch._src.actor.endpoint import EndpointProperty

    kinds = {
        inspect.iscoroutinefunction(v._method)
        for n in dir(cls)
        if isinstance(v := getattr(cls, n, None), EndpointProperty)
    }
    return kinds == {True}


def apply_torchstore_compat() -> None:
    """Patch torchstore for monarch 0.7.0 in this process. Idempotent and thread-safe."""
    global _applied
    if _applied:
        return
    with _lock:
        if _applied:
            return
        _set_env_defaults()
        import torchstore.api

        # If a future torchstore release adds another sync endpoint, fail here, loudly,
        # rather than with monarch's spawn error deep inside torchstore.initialize().
        assert _all_endpoints_async(CompatController), "torchstore Controller has unpatched sync endpoints"
        torchstore.api.Controller = CompatController
        _use_shared_memory_on_one_host()
        _applied = True


_shm_puts = True  # this process still tries shared memory for its puts (a volume elsewhere turns it off)


def _use_shared_memory_on_one_host() -> None:
    """Point 4: tensors between a client and a volume on one host go through /dev/shm (`torchstore_shm.py`) instead
    of inside Monarch messages; RDMA, where enabled, keeps precedence. MESHRL_TORCHSTORE_SHM=0 turns it off."""
    if os.environ.get("MESHRL_TORCHSTORE_SHM", "1") == "0":
        return
    from torchstore.transport import pipe as ts_pipe

    from meshrl.weight_sync.torchstore_shm import ShmTransportBuffer

    monarch_buffer = ts_pipe.Pipe.create_transport_buffer
    put = ts_pipe.Pipe.put_to_storage_volume

    def create_transport_buffer(self):
        if ts_pipe.rdma_available() or not _shm_puts and getattr(self, "_meshrl_put", False):
            return monarch_buffer(self)
        return ShmTransportBuffer()

    async def put_to_storage_volume(self, key, request):
        global _shm_puts
        self._meshrl_put = True
        if _shm_puts and not ts_pipe.rdma_available():
            try:
                return await put(self, key, request)
            except Exception as e:  # noqa: BLE001 - the volume's refusal arrives wrapped in an actor error
                if "ShmUnreachable" not in f"{type(e).__name__} {e}" and not isinstance(e, OSError):
                    raise
                _shm_puts = False  # a volume elsewhere, or /dev/shm full: messages from now on
        return await put(self, key, request)

    ts_pipe.Pipe.create_transport_buffer = create_transport_buffer
    ts_pipe.Pipe.put_to_storage_volume = put_to_storage_volume


def is_applied() -> bool:
    return _applied
