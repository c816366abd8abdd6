"""Which weight-sync transport a run uses (`GeneratorConfig.weight_sync`), and the generator side of the
shared-buffer transports. No Monarch in here: the actors and the controller call these with plain data.

- 'torchstore': trainer rank 0 puts the full weights (cast to the generator dtype) into torchstore's storage
  process and every generator gets them from there (`store.py`). Works whatever the placement; the weights
  travel through host memory twice.
- 'cuda_ipc': generators on trainer rank 0's GPU (the colocated layout). Rank 0 copies the weights into one
  persistent flat buffer on that GPU; generators copy out of it through a CUDA IPC handle sent to them once
  (`cuda_ipc.py`). No host round trip.
- 'shm': the same flat buffer and version protocol, backed by a /dev/shm file instead of GPU memory, for a CPU
  trainer and CPU generators on one host. It is not CUDA IPC: it exists so that CPU runs (and the CPU tests)
  go through the shared-buffer path of the actors for real.
- 'auto': 'cuda_ipc' when every generator sits on trainer rank 0's GPU (compared by device UUID), else
  'torchstore'. It never picks 'shm': CPU runs keep torchstore unless 'shm' is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshrl.config import WEIGHT_SYNC_TRANSPORTS, ConfigError
from meshrl.weight_sync.cuda_ipc import CudaIpcHandle, CudaIpcReceiver, choose_transport

SHARED_BUFFER_TRANSPORTS = ("cuda_ipc", "shm")
DEFAULT_STORE = "meshrl"  # the torchstore name when none is given (each Controller uses its own)
"""Transports that go through the trainer's flat buffer (a handle is sent to the generators once)."""


def _host(identity: str) -> str:
    return identity.rsplit("@", 1)[-1]


def resolve_transport(requested: str, trainer: str, generators: Sequence[str]) -> str:
    """The transport to run with. `trainer`: the `cuda_ipc.device_identity` of trainer rank 0 (the rank that
    publishes); `generators`: those of every generator. An explicit shared-buffer transport that cannot work
    with this placement is a `ConfigError` naming what to set instead."""
    if requested not in WEIGHT_SYNC_TRANSPORTS:
        raise ConfigError(f"generator.weight_sync={requested!r}; use one of {list(WEIGHT_SYNC_TRANSPORTS)}")
    if requested == "torchstore" or not generators:
        return "torchstore"
    same_gpu = all(choose_transport(trainer, g) == "cuda_ipc" for g in generators)
    if requested == "auto":
        return "cuda_ipc" if same_gpu else "torchstore"
    if requested == "cuda_ipc" and not same_gpu:
        elsewhere = sorted({g for g in generators if g != trainer})
        raise ConfigError(
            f"generator.weight_sync='cuda_ipc' needs every generator on the GPU of trainer rank 0 ({trainer}), but "
            f"generators run on {elsewhere}; set --generator.weight-sync auto (torchstore for this placement) "
            "or place the generators on that GPU"
        )
    if requested == "shm":
        if not trainer.startswith("cpu@"):
            raise ConfigError(
                f"generator.weight_sync='shm' is the host-memory buffer of a CPU trainer, but trainer rank 0 runs on "
                f"{trainer}; set --generator.weight-sync auto (cuda_ipc on a shared GPU, else torchstore)"
            )
        other_hosts = sorted({_host(g) for g in generators} - {_host(trainer)})
        if other_hosts:
            raise ConfigError(
                f"generator.weight_sync='shm' needs the generators on the trainer's host ({_host(trainer)}), but "
                f"some run on {other_hosts}; set --generator.weight-sync torchstore"
            )
    return requested


def describe_transport(transport: str, trainer: str, generators: Sequence[str]) -> str:
    """One log line: the transport and why."""
    where = {
        "cuda_ipc": f"trainer rank 0 and {len(generators)} generator(s) share {trainer}",
        "shm": f"CPU trainer and {len(generators)} generator(s) share host memory on {_host(trainer)}",
        "torchstore": f"trainer rank 0 on {trainer}, generators on {sorted(set(generators))}",
    }[transport]
    return f"weight sync: {transport} ({where})"


class SharedBufferLoader:
    """Generator side of 'cuda_ipc' / 'shm': the handle (sent once) and `load(engine, version)`, which loads
    exactly `version` or raises.

    The trainer only overwrites a slot that is neither the latest version nor being read, and a reader only
    reads a slot marked with the version it asked for (`cuda_ipc.py`), so what is loaded is one whole version.
    """

    def __init__(self, handle: CudaIpcHandle, engine: Any) -> None:
        self.handle = handle
        # vLLM copies inside its worker processes, which open the handle themselves (VLLMEngine.load_weights_ipc);
        # any other engine (HFEngine) loads views that this process maps once, here, so a bad handle fails now.
        self._in_workers = hasattr(engine, "load_weights_ipc")
        self._receiver = None if self._in_workers else CudaIpcReceiver(handle)

    @property
    def transport(self) -> str:
        return "shm" if self.handle.buffer[0] == "shm" else "cuda_ipc"

    def load(self, engine: Any, version: int) -> int:
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


__all__ = ["SHARED_BUFFER_TRANSPORTS", "SharedBufferLoader", "describe_transport", "resolve_transport"]
