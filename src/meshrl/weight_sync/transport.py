"""Which weight-sync transport a run uses (`GeneratorConfig.weight_sync`); the transports themselves are the
publisher / subscriber pairs of `pubsub.py`. No Monarch in here: the controller calls these with plain data.

- 'torchstore': every trainer rank puts its own shards (cast to the generator dtype) into torchstore's storage
  volume beside it, and every generator gets all of them and puts whole tensors together (`store.py`,
  `shards.py`). Works whatever the placement; no rank gathers the model; the weights travel through host memory.
- 'cuda_ipc': generators on GPUs of trainer rank 0's host — on its GPU (the colocated layout) or on others (the
  split layout: trainer on GPU 0, generators on GPU 1). Rank 0 copies the weights into one persistent flat buffer
  on its GPU; generators copy out of it through a CUDA IPC handle sent to them once (`shared_buffer.py`), peer to
  peer from another GPU. No host round trip: 3 ms for the 0.6B model across two H100s, where torchstore took
  0.56–0.76 s (issue 32).
- 'shm': the same flat buffer and version protocol, backed by a /dev/shm file instead of GPU memory, for a CPU
  trainer and CPU generators on one host. It is not CUDA IPC: it exists so that CPU runs (and the CPU tests)
  go through the shared-buffer path of the actors for real.
- 'auto': 'cuda_ipc' when every generator sits on a GPU of trainer rank 0's host, else 'torchstore' (generators
  on other hosts). It never picks 'shm': CPU runs keep torchstore unless 'shm' is asked for. Where two GPUs of the
  host cannot reach each other's memory (no peer access), the generators cannot open the buffer and the run goes
  on with torchstore (controller/weight_sync.py says so).

Both shared-buffer transports keep files in /dev/shm ('shm' the whole buffer, 'cuda_ipc' a page of control
block), and a /dev/shm without room for them ends a run with a SIGBUS at the first push. So the choice checks the
free space at launch: an explicit choice that does not fit is a ConfigError that says how much is free and needed
and what to do; 'auto' falls back to torchstore with a note.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from meshrl.errors import ConfigError
from meshrl.generation.config import WEIGHT_SYNC_TRANSPORTS
from meshrl.weight_sync.shared_buffer import (
    buffer_space_problem,
    choose_transport,
    control_space_problem,
    same_device,
)

SHARED_BUFFER_TRANSPORTS = ("cuda_ipc", "shm")
"""Transports that go through the trainer's flat buffer (a handle is sent to the generators once)."""
DEFAULT_STORE = "meshrl"
"""The torchstore name when none is given (each Controller uses its own)."""


def _host(identity: str) -> str:
    return identity.rsplit("@", 1)[-1]


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_nbytes(num_params: int, dtype: str) -> int:
    """Bytes of `num_params` weights in the generator's `dtype` (what one version of the shared buffer holds, but
    for alignment and weights the state dict repeats, such as a tied output embedding: the trainer checks the
    exact size again before it allocates)."""
    return int(num_params) * _DTYPE_BYTES[str(dtype).removeprefix("torch.")]


def resolve_transport(
    requested: str,
    trainer: str,
    generators: Sequence[str],
    *,
    weight_bytes: int | None = None,
    note: Callable[[str], None] = print,
) -> str:
    """The transport to run with. `trainer`: the `shared_buffer.device_identity` of trainer rank 0 (the rank that
    publishes); `generators`: those of every generator. An explicit shared-buffer transport that cannot work
    with this placement is a `ConfigError` naming what to set instead.

    The shared memory a shared-buffer transport needs is checked here, at launch: `weight_bytes` (one version in
    the generator dtype, `weight_nbytes`) for 'shm', a control block for 'cuda_ipc'. Too little: an explicit
    choice is a ConfigError ('/dev/shm has X free, the weights need Y; enlarge it ... or use ... torchstore'),
    'auto' falls back to torchstore and says so through `note`."""
    if requested not in WEIGHT_SYNC_TRANSPORTS:
        raise ConfigError(f"generator.weight_sync={requested!r}; use one of {list(WEIGHT_SYNC_TRANSPORTS)}")
    if requested == "torchstore" or not generators:
        return "torchstore"
    host_gpus = all(choose_transport(trainer, g) == "cuda_ipc" for g in generators)
    if requested == "auto":
        if not host_gpus:
            return "torchstore"
        if problem := control_space_problem():
            note(f"[meshrl] weight sync: {problem.split('; ')[0]}: 'auto' uses torchstore instead of cuda_ipc")
            return "torchstore"
        return "cuda_ipc"
    if requested == "cuda_ipc" and not host_gpus:
        elsewhere = sorted({g for g in generators if choose_transport(trainer, g) != "cuda_ipc"})
        raise ConfigError(
            f"generator.weight_sync='cuda_ipc' needs every generator on a GPU of trainer rank 0's host ({trainer}), "
            f"but generators run on {elsewhere}; set --generator.weight-sync auto (torchstore for this placement) "
            "or place the generators on that host's GPUs"
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
        if weight_bytes is not None and (problem := buffer_space_problem(weight_bytes)):
            raise ConfigError(f"generator.weight_sync='shm': {problem}")
    if requested == "cuda_ipc" and (problem := control_space_problem()):
        raise ConfigError(f"generator.weight_sync='cuda_ipc': {problem}")
    return requested


def describe_transport(transport: str, trainer: str, generators: Sequence[str]) -> str:
    """One log line: the transport and why."""
    peers = sum(not same_device(trainer, g) for g in generators)
    where = {
        "cuda_ipc": f"{len(generators)} generator(s) read trainer rank 0's buffer on {trainer}"
        + (f", {peers} of them from another GPU of the host, peer to peer" if peers else ", on its GPU"),
        "shm": f"CPU trainer and {len(generators)} generator(s) share host memory on {_host(trainer)}",
        "torchstore": f"trainer ranks from {trainer} on, generators on {sorted(set(generators))}",
    }[transport]
    return f"weight sync: {transport} ({where})"


__all__ = ["DEFAULT_STORE", "SHARED_BUFFER_TRANSPORTS", "describe_transport", "resolve_transport", "weight_nbytes"]
