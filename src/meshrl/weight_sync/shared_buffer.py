"""The shared weight buffer of the 'cuda_ipc' and 'shm' weight transports: trainer rank 0 publishes each version
into one flat buffer, which generators on the GPUs of its host read over CUDA IPC — on its own GPU (the colocated
layout) or on another GPU, peer to peer over NVLink / PCIe — or CPU processes of one host through a /dev/shm file.

Across GPUs (issue 32): a generator that sees only its own GPU (CUDA_VISIBLE_DEVICES, meshrl.devices) still opens
the handle of a buffer on the trainer's GPU — CUDA maps peer memory into its context — and its engine's copies read
over the link. Measured on 2x H100 (NVLink, bench/cross_gpu_probe.py): 1.19 GB in 3.0 ms (393 GB/s), against
3.3 ms for an NCCL broadcast between the same two processes, which would also need both sides to take part at once
(the trainer would have to serve every generator's pull while it trains in the asynchronous loop); the buffer needs
neither. A pair of GPUs without peer access cannot open it: the generator's attach fails, and 'auto' falls back to
torchstore (controller/weight_sync.py).

Why not hand over the trainer's tensors one by one: opening one IPC handle costs ~50 µs, and a Qwen3-0.6B state
dict has ~300 tensors (GPU.md measured ~15 ms of handle opening per hand-off). Instead the trainer owns one
persistent flat buffer, laid out once (`FlatLayout`: name -> byte offset, shape, dtype), whose IPC handle is
shared once. Per version the trainer only copies (and casts to the generator dtype) into it and publishes the
version number; the generator opened the handle once and loads views of the buffer (name -> view) into its
engine, which copies them into its own weights (so the trainer can overwrite the buffer afterwards).

Never serving a half-updated model — the choice made here: double buffering + per-slot file locks + per-slot
version marks in a small shared control block (a file in /dev/shm):
- `publish(v)` writes into the slot that does NOT hold the latest version, under that slot's exclusive lock:
  mark the slot "being written", copy, synchronise the device (another process's CUDA context does not see
  this process's stream order, so only a host-side sync followed by a host-side flag is a valid "done"), then
  write the slot's version and raise `latest`.
- A reader takes the slot's shared lock, checks the slot still holds the version it wants, lets the engine copy
  the views, synchronises, and only then releases the lock. So the writer can never overwrite a slot while it
  is being read, and a reader never sees a slot that is being written (its mark is not a version).
- With two slots the trainer never waits for a reader that is loading the previous version; it waits (up to
  a timeout) only if it publishes twice while one load is still running. `num_slots=1` halves the memory and
  makes every publish wait for running loads. Locks are `flock`s: released by the kernel if a process dies,
  so a crashed generator cannot wedge the trainer; a crashed writer leaves its slot marked "being written",
  which is never served.

The control block and locks are host files, so both processes must be on one host — which is implied by one
GPU. Buffers on the CPU (tests, or CPU processes of one host) are shared through a /dev/shm file instead of a
CUDA IPC handle, with the same protocol.

Who holds the files, and who may remove them (`meshrl-wsync-<owner pid>-<id>.ctl`, `.ctl.slot<i>.lock`, `.buf`):
- The sender (trainer rank 0) creates them, keeps every one open for its lifetime, and holds a shared `flock` on
  the control block and the CPU buffer; each receiver (generator) holds a shared `flock` on the control block while
  attached. So "every process of the run is gone" is exactly "nobody holds the control block's lock", whatever pid
  namespace the processes live in (containers sharing /dev/shm with `--ipc=host` do not share pids).
- They are removed by the sender's `close()` (or when its process exits normally), by the controller at the end
  of its run (`remove_shared_files`: it may have SIGKILLed the trainer), and by `remove_stale_files` at the next
  start — which removes only files whose owner pid is gone AND whose lock nobody holds. Never by a receiver.
- If the names are removed anyway while the trainer lives (a foreign sweeper, systemd-logind's RemoveIPC, `rm`),
  a new receiver (a replacement generator) opens the same files through the sender's descriptors,
  /proc/<owner pid>/fd/<fd>, checked by inode (`SharedBufferHandle.held`).

A /dev/shm too small for the buffer would be a SIGBUS at the first copy into it (tmpfs pages are allocated on
first touch). The sender checks the free space first and allocates every page up front (`posix_fallocate`), so a
full /dev/shm is a `ShmSpaceError` naming the free space, the need and what to do; the controller checks the same
at launch from the parameter count (`meshrl.weight_sync.transport.resolve_transport`).

`choose_transport` picks "cuda_ipc" when trainer and generator sit on CUDA devices of one host (devices compared
by UUID, since "cuda:0" means different GPUs under different CUDA_VISIBLE_DEVICES) and "torchstore" otherwise.
No Monarch in here: the actors pass `SharedBufferHandle` (picklable) through their endpoints.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import socket
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from meshrl.devices import expandable_segments_on

ALIGN = 256
"""Byte alignment of every tensor in the flat buffer: any dtype can view it, and vectorised copies stay aligned."""

DEFAULT_SLOTS = 2
"""Slots of the buffer (double buffering); `num_slots` of SharedBufferSender."""
SHM_HEADROOM_BYTES = 1 << 20
"""Free space a shared-memory directory must keep beyond the buffer (other users of /dev/shm, page rounding)."""

_MAGIC = 0x6D65736872_6C  # "meshrl"
_WRITING = -1  # a slot being written (never a version)
_EMPTY = -2  # a slot never written
_HDR = 2  # control block: [magic, latest, slot_0 version, slot_1 version, ...]


class WeightVersionUnavailable(LookupError):
    """The asked-for version is not in any slot (not published yet, or already overwritten by newer ones)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


# ---------------------------------------------------------------------------------------------------------------
# the flat layout


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    offset: int  # bytes from the start of a slot
    nbytes: int


@dataclass(frozen=True)
class FlatLayout:
    """Where each named tensor lives in one slot of the flat byte buffer. Plain data: it pickles small."""

    specs: tuple[TensorSpec, ...]
    nbytes: int  # bytes of one slot (a multiple of ALIGN)

    @classmethod
    def of(cls, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> FlatLayout:
        """Layout for `state_dict` with floating-point tensors cast to `dtype` (the generator's dtype); other
        tensors keep theirs. Order is the state dict's, each tensor aligned to ALIGN bytes."""
        specs, offset = [], 0
        for name, t in state_dict.items():
            dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
            nbytes = t.numel() * torch.empty((), dtype=dt).element_size()
            specs.append(TensorSpec(name, tuple(int(s) for s in t.shape), _dtype_name(dt), offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        if not specs:
            raise ValueError("FlatLayout.of: empty state dict")
        return cls(tuple(specs), max(offset, ALIGN))

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def payload_nbytes(self) -> int:
        """Bytes of the tensors themselves (no alignment padding): what one version transfers."""
        return sum(s.nbytes for s in self.specs)

    def views(self, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> tensor view into `slot` (a 1-D uint8 tensor of `nbytes`). No copy."""
        if slot.dtype != torch.uint8 or slot.dim() != 1 or slot.numel() < self.nbytes:
            raise ValueError(f"a slot is a 1-D uint8 tensor of >= {self.nbytes} bytes, got {slot.dtype} {slot.shape}")
        return {s.name: slot[s.offset : s.offset + s.nbytes].view(_dtype(s.dtype)).view(s.shape) for s in self.specs}

    def check(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """The state dict has exactly this layout's names and shapes (a new version of the same model)."""
        if list(state_dict) != self.names:
            missing = set(self.names) - set(state_dict)
            extra = set(state_dict) - set(self.names)
            raise ValueError(
                f"state dict does not match the layout: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}"
                + ("" if missing or extra else " (same names, different order)")
            )
        for s in self.specs:
            if tuple(state_dict[s.name].shape) != s.shape:
                raise ValueError(f"{s.name}: shape {tuple(state_dict[s.name].shape)}, layout {s.shape}")

    def pack(self, slot: torch.Tensor, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy (and cast) `state_dict` into `slot`. Asynchronous on CUDA: synchronise before publishing."""
        self.check(state_dict)
        views = self.views(slot)
        dst, src = [], []
        with torch.no_grad():
            for s in self.specs:
                t = state_dict[s.name].detach()
                if hasattr(t, "full_tensor"):
                    raise TypeError(f"{s.name} is a DTensor: pack full tensors (call .full_tensor())")
                if t.device == slot.device:
                    dst.append(views[s.name])
                    src.append(t)
                else:  # across devices (e.g. GPU weights into a host buffer): a plain copy per tensor
                    views[s.name].copy_(t)
            if dst:
                # Multi-tensor copies instead of ~300 launches where dtypes allow; torch falls back per tensor
                # (casting) where they differ.
                torch._foreach_copy_(dst, src, non_blocking=True)

    def unpack(self, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        """Owned copies of the tensors in `slot` (tests, debugging)."""
        return {k: v.clone() for k, v in self.views(slot).items()}


# ---------------------------------------------------------------------------------------------------------------
# transport choice


def device_identity(device: str | torch.device) -> str:
    """A string naming the physical device, comparable across processes of one host:
    'cuda:<uuid>@<host>' for a GPU (UUID: the same GPU whatever CUDA_VISIBLE_DEVICES says), 'cpu@<host>'."""
    device = torch.device(device)
    host = socket.gethostname()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{torch.cuda.get_device_properties(index).uuid}@{host}"
    return f"{device.type}@{host}"


def same_device(trainer_device: str, generator_device: str) -> bool:
    """Whether two `device_identity()` strings name the same physical CUDA device."""
    return trainer_device == generator_device and trainer_device.startswith("cuda:")


def choose_transport(trainer_device: str | torch.device, generator_device: str | torch.device) -> str:
    """'cuda_ipc' when trainer and generator use CUDA devices of one host (the same GPU, or peers), else
    'torchstore'.

    Pass what `device_identity()` returned in each process (they may see different CUDA_VISIBLE_DEVICES), or,
    when both are resolved in one process, plain devices ('cuda:0', torch.device)."""
    ids = []
    for d in (trainer_device, generator_device):
        s = str(d)
        ids.append(s if ("@" in s) else device_identity(s))
    gpus = all(i.startswith("cuda:") for i in ids)
    return "cuda_ipc" if gpus and _identity_host(ids[0]) == _identity_host(ids[1]) else "torchstore"


def _identity_host(identity: str) -> str:
    return identity.rsplit("@", 1)[-1]


# ---------------------------------------------------------------------------------------------------------------
# shared-memory files: where they live, how much room there is, who holds them


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


_CONTROL_BYTES = mmap.PAGESIZE
"""Host memory of a control block (one page); its slot-lock files are empty."""


class ShmSpaceError(OSError):
    """The shared-memory directory has no room for the weight buffer (errno ENOSPC): said before anything is
    written, instead of a SIGBUS at the first copy into a mapping whose pages tmpfs cannot allocate."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC


def shm_free_bytes(directory: str | None = None) -> int:
    """Bytes an unprivileged process can still allocate in `directory` (default: `shm_dir()`)."""
    st = os.statvfs(directory or shm_dir())
    return st.f_bavail * st.f_frsize


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def shm_space_problem(
    nbytes: int, *, directory: str | None = None, what: str = "the weights", detail: str = ""
) -> str | None:
    """None when `directory` (default: `shm_dir()`) can hold `nbytes` more and keep SHM_HEADROOM_BYTES free; else
    the sentence that says so: '<dir> has X free, the weights need Y; enlarge it ... or use ... torchstore'."""
    directory = directory or shm_dir()
    free = shm_free_bytes(directory)
    if free >= nbytes + SHM_HEADROOM_BYTES:
        return None
    return (
        f"{directory} has {format_bytes(free)} free, {what} need {format_bytes(nbytes)}{detail}; enlarge it "
        "(--shm-size for containers) or use --generator.weight-sync torchstore"
    )


def buffer_space_problem(
    slot_nbytes: int, num_slots: int = DEFAULT_SLOTS, *, directory: str | None = None
) -> str | None:
    """`shm_space_problem` for the 'shm' transport's buffer: `num_slots` slots of `slot_nbytes`, and its control
    block."""
    detail = f" ({num_slots} slot(s) of {format_bytes(slot_nbytes)}, and {format_bytes(SHM_HEADROOM_BYTES)} kept free)"
    return shm_space_problem(num_slots * slot_nbytes + _CONTROL_BYTES, directory=directory, detail=detail)


def control_space_problem(*, directory: str | None = None) -> str | None:
    """`shm_space_problem` for the 'cuda_ipc' transport, whose buffer is GPU memory: its control files only."""
    return shm_space_problem(_CONTROL_BYTES, directory=directory, what="the CUDA IPC transport's control files")


def _allocate(fd: int, nbytes: int, path: str, *, what: str = "the weights") -> None:
    """Give the file its pages now. tmpfs allocates a page at its first touch, so a mapping of a file that
    /dev/shm cannot fill is a SIGBUS at some later write; allocated here, it is ENOSPC at once, with words."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            directory = os.path.dirname(path)
            raise ShmSpaceError(
                f"{directory} has {format_bytes(shm_free_bytes(directory))} free, {what} need "
                f"{format_bytes(nbytes)}; enlarge it (--shm-size for containers) or use --generator.weight-sync "
                "torchstore"
            ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate: size it at least
            raise
        os.ftruncate(fd, nbytes)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _held(path: str) -> bool:
    """Whether a process holds a `flock` on `path` — any process with this file open, in any pid namespace."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


_FILE_NAME = re.compile(r"(\.)?meshrl-wsync-(\d+)-")
_MEMBER_SUFFIX = re.compile(r"\.(ctl(\.slot\d+\.lock)?|buf)$")
_TMP_GRACE_S = 60.0  # a control block being made (hidden name, locked at once) is left alone this long


def remove_stale_files(directory: str | None = None) -> list[str]:
    """Unlink the shared-memory files of runs whose processes are all gone (`meshrl-wsync-<owner pid>-...`: a
    trainer, controller or torchstore volume killed with SIGKILL cannot clean up after itself). A file is kept
    while its owner pid is alive here, or while any process holds its run's control block or buffer (the trainer
    holds both for its lifetime, each attached generator the control block: processes of another pid namespace
    that share this /dev/shm included, whose pids mean nothing here). A recycled pid only means a stale file is
    kept until the next start. Returns the removed paths."""
    directory = directory or shm_dir()
    removed = []
    for name in sorted(os.listdir(directory)):
        m = _FILE_NAME.match(name)
        if m is None or _alive(int(m.group(2))):
            continue
        path = os.path.join(directory, name)
        if m.group(1):  # a control block being made: hidden and locked until renamed into place
            with contextlib.suppress(FileNotFoundError):
                if time.time() - os.stat(path).st_mtime < _TMP_GRACE_S or _held(path):
                    continue
        else:
            base = _MEMBER_SUFFIX.sub("", name)
            if any(_held(os.path.join(directory, n)) for n in dict.fromkeys((name, base + ".ctl", base + ".buf"))):
                continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


# ---------------------------------------------------------------------------------------------------------------
# the control block: versions of the slots, and their locks


def _lock_path(control_path: str, slot: int) -> str:
    return f"{control_path}.slot{slot}.lock"


class VersionControl:
    """`[magic, latest, version of slot 0, ...]` as int64 in a shared file, plus one flock file per slot.
    The version rules live here (pure Python, no device). Whoever has it open holds a shared flock on the control
    block (the mark of a live run, `remove_stale_files`). `locate(path)`: where a receiver opens each file (the
    path, or the owner's descriptor of it if the name is gone: `SharedBufferHandle.locate`)."""

    def __init__(self, path: str, num_slots: int, *, create: bool, locate: Callable[[str], str] | None = None) -> None:
        self.path, self.num_slots = path, int(num_slots)
        nbytes = 8 * (_HDR + self.num_slots)
        locate = locate or (lambda p: p)
        if create:
            # Made under a hidden name, locked, filled, then renamed into place: the control block is never visible
            # unlocked (a sweeper that cannot see this pid would take it for stale).
            where = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
            fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        else:
            where = locate(path)
            fd = os.open(where, os.O_RDWR)  # never O_CREAT: a missing control block is an error, not a new one
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if create:
                _allocate(fd, nbytes, path, what="the weight buffer's control block")
            self._mm = mmap.mmap(fd, nbytes)
            self._arr = np.ndarray((_HDR + self.num_slots,), dtype=np.int64, buffer=self._mm)
            if create:
                self._arr[:] = [_MAGIC, _EMPTY] + [_EMPTY] * self.num_slots
                os.rename(where, path)
            elif int(self._arr[0]) != _MAGIC:
                raise ValueError(f"{path} is not a meshrl weight-sync control block")
            self._lock_fds: list[int] = []
            for i in range(self.num_slots):
                lock = _lock_path(path, i)
                if create:
                    self._lock_fds.append(os.open(lock, os.O_RDWR | os.O_CREAT, 0o600))
                else:  # the writer's lock files or none: a lock file made here would lock nothing
                    self._lock_fds.append(os.open(locate(lock), os.O_RDWR))
        except BaseException:
            for lock_fd in getattr(self, "_lock_fds", []):
                os.close(lock_fd)
            os.close(fd)
            if create:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(where)
            raise
        self.fd = fd

    # -- reads
    @property
    def latest(self) -> int | None:
        v = int(self._arr[1])
        return None if v < 0 else v

    def slot_version(self, slot: int) -> int:
        return int(self._arr[_HDR + slot])

    def find(self, version: int) -> int | None:
        for s in range(self.num_slots):
            if self.slot_version(s) == version:
                return s
        return None

    def slot_for_write(self, version: int) -> int:
        """The slot to overwrite for `version`: never the one holding the latest version (while there are two
        or more), else the one holding the oldest. Versions must rise."""
        if int(version) != version or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        latest = self.latest
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} is not newer than the published version {latest}; versions must rise")
        candidates = [s for s in range(self.num_slots) if self.num_slots == 1 or self.slot_version(s) != latest]
        return min(candidates, key=self.slot_version)  # _EMPTY/_WRITING (< 0) first, then the oldest

    # -- writes (writer holds the slot's exclusive lock)
    def mark_writing(self, slot: int) -> None:
        self._arr[_HDR + slot] = _WRITING

    def mark_written(self, slot: int, version: int) -> None:
        self._arr[_HDR + slot] = int(version)
        if self.latest is None or version > self.latest:
            self._arr[1] = int(version)

    # -- locks (flock: per open file, released by the kernel when the process dies)
    @contextlib.contextmanager
    def locked(self, slot: int, *, exclusive: bool, timeout_s: float) -> Iterator[None]:
        fd = self._lock_fds[slot]
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, mode)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    who = "a reader is still loading" if exclusive else "the writer is still writing"
                    raise TimeoutError(
                        f"weight-sync slot {slot} stayed locked for {timeout_s:.1f}s ({who} version "
                        f"{self.slot_version(slot)}); is the other process stuck?"
                    ) from None
                time.sleep(0.0002)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def paths(self) -> list[str]:
        return [self.path] + [_lock_path(self.path, i) for i in range(self.num_slots)]

    def close(self, *, unlink: bool = False) -> None:
        """Close the descriptors (which lets go of the control block's lock); `unlink`: remove the files too
        (their owner only)."""
        for fd in [*self._lock_fds, *([self.fd] if self.fd is not None else [])]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lock_fds, self.fd = [], None
        if unlink:
            for p in self.paths():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)


# ---------------------------------------------------------------------------------------------------------------
# sender (trainer) and receiver (generator)


@dataclass(frozen=True)
class SharedBufferHandle:
    """Everything a receiver needs, picklable: the layout, the buffer's share handle, the control block path, and
    where the owner holds its files (`held`: (path, fd, st_dev, st_ino) of each file the owner keeps open)."""

    layout: FlatLayout
    num_slots: int
    control_path: str
    device_identity: str
    buffer: tuple  # CUDA: torch.multiprocessing's (rebuild_fn, args) of the flat buffer; CPU: ("shm", path, size)
    owner_pid: int = 0  # the sender's process (trainer rank 0)
    held: tuple = ()

    def locate(self, path: str) -> str:
        """Where to open the owner's file `path`: the path while it names the owner's file; else the owner's own
        descriptor of it (/proc/<owner pid>/fd/<fd>, the same inode), while the owner lives. A file that is gone
        from both is an error that says so (a FileNotFoundError naming the owner)."""
        entry = next((h for h in self.held if h[0] == path), None)
        if entry is None:  # not a file the owner holds open (a handle from before `held`): the path as it is
            return path
        _, fd, dev, ino = entry
        candidates = [path, f"/proc/{self.owner_pid}/fd/{fd}"]
        for candidate in candidates:
            with contextlib.suppress(OSError):
                st = os.stat(candidate)
                if (st.st_dev, st.st_ino) == (dev, ino):
                    return candidate
        raise FileNotFoundError(
            errno.ENOENT,
            f"the shared weight buffer's file {path} is gone, and its owner (trainer rank 0, pid {self.owner_pid}) "
            "no longer holds it open: the trainer process has exited (or runs in a pid namespace this process "
            "cannot see)",
            path,
        )


def _owned_file(path: str, fd: int) -> tuple[str, int, int, int]:
    st = os.fstat(fd)
    return (path, fd, st.st_dev, st.st_ino)


def _remove_owned(owner_pid: int, paths: tuple[str, ...]) -> None:
    if os.getpid() != owner_pid:  # a forked child inherits the finalizer, not the files
        return
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


@dataclass
class PublishStats:
    version: int
    slot: int
    bytes: int
    wait_s: float  # waiting for a reader of the slot to finish
    copy_s: float  # pack + device sync


def _ipc_shareable_empty(nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any]:
    """A buffer other processes can open with its CUDA IPC handle (and the memory pool that holds it, kept with it).
    With expandable segments on, torch shares an allocation through a file-descriptor handle of the segment
    instead: the receiver then needs pidfd_getfd (often refused in containers) and maps the segment's whole
    reservation, and torch's handling of it has changed between releases. So the buffer is made as a plain
    cudaMalloc allocation, the setting off for it and in a pool of its own (the main pool's cached blocks are in
    expandable segments)."""
    if not expandable_segments_on() or not hasattr(torch.cuda, "MemPool"):
        return torch.empty(nbytes, dtype=torch.uint8, device=device), None
    pool = torch.cuda.MemPool()
    index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda": the current one
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        with torch.cuda.use_mem_pool(pool, device=index):
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return buffer, pool


class SharedBufferSender:
    """Trainer side: the flat buffer (`num_slots` slots of `layout.nbytes`, one allocation, so one IPC handle)
    and the control block. Keep it alive as long as any generator uses the handle. Its files go when it is
    closed or collected, or when its process exits normally; a killed owner's go at the controller's shutdown
    or at the next start (`remove_stale_files`)."""

    def __init__(self, layout: FlatLayout, device: str | torch.device, *, num_slots: int = DEFAULT_SLOTS) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be >= 1")
        self.layout, self.num_slots, self.device = layout, int(num_slots), torch.device(device)
        self.owner_pid = os.getpid()
        directory = shm_dir()
        base = os.path.join(directory, f"meshrl-wsync-{self.owner_pid}-{uuid.uuid4().hex[:12]}")
        size = self.num_slots * layout.nbytes
        on_gpu = self.device.type == "cuda"
        # Before anything is made: a /dev/shm without room is a sentence, not a SIGBUS at the first publish.
        if on_gpu:
            problem = control_space_problem(directory=directory)
        else:
            problem = buffer_space_problem(layout.nbytes, self.num_slots, directory=directory)
        if problem:
            raise ShmSpaceError(problem)
        self._buf_fd: int | None = None
        self._shm_path: str | None = None
        self._pool: Any = None  # the CUDA memory pool of the buffer (`_ipc_shareable_empty`), kept while it lives
        self.control = VersionControl(base + ".ctl", self.num_slots, create=True)  # first: it marks the run live
        try:
            if on_gpu:
                self.buffer, self._pool = _ipc_shareable_empty(size, self.device)
                from torch.multiprocessing.reductions import reduce_tensor

                buffer_share: tuple = reduce_tensor(self.buffer)
            else:  # CPU: a shared-memory file both processes map, every page allocated now
                self._shm_path = base + ".buf"
                self._buf_fd = os.open(self._shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                fcntl.flock(self._buf_fd, fcntl.LOCK_SH)
                _allocate(self._buf_fd, size, self._shm_path)
                self.buffer = torch.from_file(self._shm_path, shared=True, size=size, dtype=torch.uint8)
                buffer_share = ("shm", self._shm_path, size)
        except BaseException:
            self.control.close(unlink=True)
            if self._buf_fd is not None:
                os.close(self._buf_fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._shm_path)
            raise
        held = [_owned_file(self.control.path, self.control.fd)]
        held += [_owned_file(p, fd) for p, fd in zip(self.control.paths()[1:], self.control._lock_fds, strict=True)]
        if self._buf_fd is not None:
            held.append(_owned_file(self._shm_path, self._buf_fd))
        self._handle = SharedBufferHandle(
            layout, self.num_slots, self.control.path, device_identity(self.device), buffer_share,
            owner_pid=self.owner_pid, held=tuple(held),
        )  # fmt: skip
        self._remove_files = weakref.finalize(self, _remove_owned, self.owner_pid, tuple(h[0] for h in held))

    @classmethod
    def for_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        device: str | torch.device,
        *,
        dtype: torch.dtype | None = None,
        num_slots: int = DEFAULT_SLOTS,
    ) -> SharedBufferSender:
        return cls(FlatLayout.of(state_dict, dtype), device, num_slots=num_slots)

    def handle(self) -> SharedBufferHandle:
        """Send this to the generator once (it pickles to a few KB)."""
        return self._handle

    def slot(self, index: int) -> torch.Tensor:
        n = self.layout.nbytes
        return self.buffer[index * n : (index + 1) * n]

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int, *, timeout_s: float = 60.0) -> PublishStats:
        """Copy `state_dict` (full tensors, any device; cast to the layout's dtypes) into a free slot and publish
        it as `version`. Returns when readers can see it."""
        return self.publish_with(lambda slot: self.layout.pack(slot, state_dict), version, timeout_s=timeout_s)

    def publish_with(
        self, write: Callable[[torch.Tensor], None], version: int, *, timeout_s: float = 60.0
    ) -> PublishStats:
        """`publish` for a writer that fills the slot itself: `write(slot)` gets the free slot (a 1-D uint8 tensor
        of `layout.nbytes`) and must leave every tensor of the layout there, as `layout.pack` would (trainer ranks
        that gathered their shards into one flat tensor: `meshrl.weight_sync.flat_gather`). Its copies may be
        asynchronous on the device's current stream: the same slot choice, lock, device sync and version marks as
        `publish`."""
        slot = self.control.slot_for_write(version)
        t0 = time.perf_counter()
        with self.control.locked(slot, exclusive=True, timeout_s=timeout_s):
            t1 = time.perf_counter()
            self.control.mark_writing(slot)
            write(self.slot(slot))
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self.control.mark_written(slot, version)
        t2 = time.perf_counter()
        return PublishStats(int(version), slot, self.layout.nbytes, t1 - t0, t2 - t1)

    @property
    def latest(self) -> int | None:
        return self.control.latest

    def close(self) -> None:
        """Remove the files (control block, locks, the CPU buffer's) and close them. Receivers that attached
        keep working; new ones can no longer attach."""
        self._remove_files()
        self.control.close()
        if self._buf_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._buf_fd)
            self._buf_fd = None


def remove_shared_files(handle: SharedBufferHandle) -> None:
    """Unlink the host files behind `handle` (control block, slot locks, a CPU buffer's /dev/shm file). Processes
    that already mapped or opened them keep working (POSIX keeps unlinked files alive while in use); only new
    receivers can no longer open the handle. For the controller at the end of its run, once it has stopped the
    trainer (which may have been SIGKILLed and never removed them itself) — never while the run goes on."""
    paths = [handle.control_path] + [_lock_path(handle.control_path, i) for i in range(handle.num_slots)]
    if handle.buffer[0] == "shm":
        paths.append(handle.buffer[1])
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


class WeightLoader(Protocol):
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> Any: ...


def _on_this_device(args: tuple) -> tuple:
    """`torch.multiprocessing.reductions.rebuild_cuda_tensor`'s arguments with the device index replaced by this
    process's current device: the sender's index means another GPU here (or none, where this process sees one GPU),
    and a handle is opened in the context of the device that will read it (the memory may sit on a peer GPU)."""
    args = list(args)
    args[_REBUILD_DEVICE_ARG] = torch.cuda.current_device()
    return tuple(args)


_REBUILD_DEVICE_ARG = 6
"""Position of `storage_device` in rebuild_cuda_tensor's arguments (tensor_cls, size, stride, offset, storage_cls,
dtype, storage_device, handle, ...), as torch 2.x lays them out; checked in tests/test_shared_buffer.py."""


class SharedBufferReceiver:
    """Generator side: opens the handle once (one IPC open), builds the name -> view maps of every slot once.
    Holds the control block's shared lock while open (the run is live), and finds the owner's files wherever the
    owner still holds them (`SharedBufferHandle.locate`)."""

    def __init__(self, handle: SharedBufferHandle) -> None:
        self.handle, self.layout = handle, handle.layout
        self.control = VersionControl(handle.control_path, handle.num_slots, create=False, locate=handle.locate)
        try:
            kind = handle.buffer[0]
            if kind == "shm":
                _, path, size = handle.buffer
                self.buffer = torch.from_file(handle.locate(path), shared=True, size=size, dtype=torch.uint8)
            else:
                rebuild, args = handle.buffer
                self.buffer = rebuild(*_on_this_device(args))  # cudaIpcOpenMemHandle, once
        except BaseException:
            self.control.close()
            raise
        self.device = self.buffer.device
        n = self.layout.nbytes
        self._views = [self.layout.views(self.buffer[i * n : (i + 1) * n]) for i in range(handle.num_slots)]

    @property
    def latest(self) -> int | None:
        return self.control.latest

    @contextlib.contextmanager
    def read(self, version: int | None = None, *, timeout_s: float = 60.0) -> Iterator[tuple[int, dict]]:
        """`(version, {name: view})` of a complete version (`None`: the latest), held (the writer cannot
        overwrite it) until the block exits. Copy out of the views inside the block; the device is
        synchronised before the slot is released, so asynchronous copies are safe."""
        want = self.control.latest if version is None else int(version)
        if want is None:
            raise WeightVersionUnavailable("no weights were published yet")
        slot = self.control.find(want)
        if slot is None:
            raise WeightVersionUnavailable(self._missing(want))
        with self.control.locked(slot, exclusive=False, timeout_s=timeout_s):
            if self.control.slot_version(slot) != want:  # overwritten between find() and the lock
                raise WeightVersionUnavailable(self._missing(want))
            try:
                yield want, self._views[slot]
            finally:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)

    def load_into(self, engine: WeightLoader, version: int | None = None, *, timeout_s: float = 60.0) -> int:
        """`engine.load_weights(views)` (TransformersEngine, VLLMEngine, ...) for `version`; returns the version
        loaded."""
        with self.read(version, timeout_s=timeout_s) as (v, views):
            engine.load_weights(views)
        return v

    def _missing(self, version: int) -> str:
        held = sorted(v for v in (self.control.slot_version(s) for s in range(self.control.num_slots)) if v >= 0)
        return (
            f"weights version {version} are not in the shared buffer (it holds {held or 'none'}): not published "
            f"yet, or overwritten by {self.control.num_slots} newer versions"
        )

    def close(self) -> None:
        self.control.close()
        self._views = []
        self.buffer = None  # drops the IPC mapping once the last view is gone


__all__ = [
    "ALIGN",
    "DEFAULT_SLOTS",
    "SHM_HEADROOM_BYTES",
    "ShmSpaceError",
    "SharedBufferHandle",
    "SharedBufferReceiver",
    "SharedBufferSender",
    "FlatLayout",
    "PublishStats",
    "TensorSpec",
    "VersionControl",
    "WeightVersionUnavailable",
    "choose_transport",
    "device_identity",
    "buffer_space_problem",
    "control_space_problem",
    "format_bytes",
    "remove_shared_files",
    "remove_stale_files",
    "shm_dir",
    "shm_free_bytes",
    "shm_space_problem",
]
