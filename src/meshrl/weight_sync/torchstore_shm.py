"""A torchstore transport buffer through shared memory, for a client and a storage volume on one host.

torchstore 0.1.2 moves a tensor either over RDMA (not on these machines) or pickled inside a Monarch message. The
message path costs copies and a socket transfer per byte: a 0.6B sync (1.19 GB in bf16) took 2.0-2.1 s on the H100
host that way, 0.73-0.75 s through this buffer (`bench/weight_sync_ranks.py --gpu`, NOTES.md). On one host the
bytes need not travel at all:

- put: the client writes the tensor into a new file in /dev/shm and sends its name; the volume maps the file and
  keeps the mapping as the stored tensor (it renames the file to its own name, adopting it, and unlinks it when
  the key is dropped).
- get: the volume sends the stored tensor's file name; the client maps it (no copy: the tensor it gets is a view
  of the volume's memory, valid after the volume drops the key too).

Whether both sides share /dev/shm is decided by comparing `devices.machine_identity()` (boot id and the /dev/shm
mount): a put to a volume elsewhere is refused by the volume (`ShmUnreachable`) and re-sent through a Monarch message
(`torchstore_compat` does that, and stops trying shared memory from that process); a get from elsewhere gets the
tensor inside the message. A /dev/shm too small for a chunk is an OSError while writing (ENOSPC), never a SIGBUS
later, and the put is re-sent the same way. Files are named `meshrl-wsync-<pid>-ts-...`, so
`shared_buffer.remove_stale_files` removes those of processes that died.

No Monarch in here; torchstore's TransportBuffer is the base class.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import uuid
import weakref
from typing import Any

import torch
from torchstore.transport.buffers import TransportBuffer

from meshrl.devices import machine_identity
from meshrl.weight_sync.shared_buffer import shm_dir


class ShmUnreachable(RuntimeError):
    """The volume cannot see the client's shared memory (another host or container)."""


def _new_path() -> str:
    return os.path.join(shm_dir(), f"meshrl-wsync-{os.getpid()}-ts-{uuid.uuid4().hex}")


def _map(path: str, nbytes: int) -> torch.Tensor:
    """The file's bytes as a tensor over a shared mapping (no copy). Mapping all pages up front (MAP_POPULATE)
    was tried for gets and measured no faster on the H100 host (NOTES.md)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _write_file(t: torch.Tensor) -> str:
    """A new /dev/shm file holding `t`'s bytes. Written with write(2), not through a mapping: the kernel fills
    the new pages as it copies instead of taking a page fault per 4 KiB (the trainer's push of 0.6B took 1.08 s
    through a mapping on the H100 host, 0.28 s this way, in threads), and a full /dev/shm is an OSError (ENOSPC)
    here, never a SIGBUS later."""
    path, data = _new_path(), _as_bytes(t.cpu() if not t.is_cpu else t)
    view = memoryview(data.numpy())
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
    except OSError:
        _unlink(path)
        raise
    finally:
        os.close(fd)
    return path


class ShmTransportBuffer(TransportBuffer):
    """Carries a file name, shape and dtype (or, from a volume that cannot share memory with the client, the
    tensor itself)."""

    requires_meta = False

    def __init__(self) -> None:
        self.identity = machine_identity()  # of the process that made this buffer (the client)
        self.client_pid = os.getpid()
        self.adopt = False  # a put's file, which the volume keeps (a get's file stays the volume's)
        self.path: str | None = None
        self.shape: tuple[int, ...] | None = None
        self.dtype: torch.dtype | None = None
        self.tensor: torch.Tensor | None = None  # the fallback payload of a get from another host
        self._created: str | None = None  # a file this process wrote and must remove unless the volume adopted it

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_created"] = None
        return state

    def allocate(self, tensor_like: Any) -> None:
        return None

    async def write_from(self, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype
        self.adopt = os.getpid() == self.client_pid  # the client writes a put; the volume answers a get
        if self.identity != machine_identity():  # a volume answering a client elsewhere: the message carries it
            self.tensor = tensor
            return
        path = getattr(tensor, "_meshrl_shm_path", None)  # a volume's stored tensor already lives in a file
        if path is None or not os.path.exists(path):
            # In a thread: write(2) releases the GIL, so the puts in flight fill their files in parallel.
            path = self._created = await asyncio.to_thread(_write_file, tensor)
        self.path = path

    async def read_into(self, tensor: torch.Tensor | None = None) -> torch.Tensor:
        if self.path is None:
            got = self.tensor
        else:
            if self.identity != machine_identity():
                raise ShmUnreachable(f"{self.path} was written on another host or container")
            nbytes = math.prod(self.shape) * self.dtype.itemsize
            got = _map(self.path, nbytes).view(self.dtype).view(self.shape)
            if self.adopt:  # a put's file becomes the volume's; a get's stays the volume's
                got = self._adopt(got)
        if tensor is not None:
            tensor.copy_(got)
            return tensor
        return got

    def _adopt(self, mapped: torch.Tensor) -> torch.Tensor:
        """The volume keeps the client's file as the stored tensor: renamed to this process's name (so the client
        leaves it alone, and it counts as stale if this process dies) and unlinked when the key is dropped."""
        own = _new_path()
        os.rename(self.path, own)
        mapped._meshrl_shm_path = own
        weakref.finalize(mapped, _unlink, own)
        return mapped

    def update(self, other_buffer: TransportBuffer) -> None:
        super().update(other_buffer)
        for name in ("path", "shape", "dtype", "tensor", "adopt"):
            setattr(self, name, getattr(other_buffer, name))
        self.identity = other_buffer.identity

    async def drop(self) -> None:
        # After a put: the volume renamed the file if it took it; otherwise (refused, failed) it is removed here.
        if self._created is not None:
            _unlink(self._created)
            self._created = None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
