"""Device memory whose virtual address outlives its physical pages: CUDA's virtual memory management (VMM) driver
API, through `ctypes` on `libcuda.so.1` (no cuda-python needed), as vLLM's CuMemAllocator does it.

    buf = RemappableBuffer(nbytes, device_index)   # reserves the addresses (no memory yet)
    buf.map()                                      # physical memory behind them
    kv = buf.tensor((2, 4, 8), torch.bfloat16)     # a torch tensor over them (zero-copy)
    buf.unmap()                                    # physical memory back to the device; addresses kept
    buf.map()                                      # new memory (contents undefined), same addresses
    buf.close()

Whatever baked the addresses in (CUDA graphs) stays valid across unmap / map, as long as nothing reads them while
unmapped. `vmm_supported(device)` says whether this works here (None) or why not (a sentence).

Struct layouts, from cuda.h (CUDA 13.0's, sizes and offsets checked with a C compiler on x86-64; the ABI of these
structs is stable across CUDA 11-13, and allocFlags, which grew fields over time, stays 8 bytes, all zero here):

    CUmemLocation       {int type; int id;}                                               8 bytes
    CUmemAllocationProp {int type; int requestedHandleTypes; CUmemLocation location;      32 bytes
                         void *win32HandleMetaData;                                       (offset 16)
                         struct {unsigned char compressionType, gpuDirectRDMACapable;     (offset 24)
                                 unsigned short usage; unsigned char reserved[4];} allocFlags;}
    CUmemAccessDesc     {CUmemLocation location; int flags;}                              12 bytes

(the enums are C `int`s); CUdeviceptr and CUmemGenericAllocationHandle are `unsigned long long`.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from typing import Any

import torch

# cuda.h values
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_NONE = 0
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CUDA_ERROR_OUT_OF_MEMORY = 2


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


assert ctypes.sizeof(CUmemAllocationProp) == 32 and CUmemAllocationProp.allocFlags.offset == 24
assert ctypes.sizeof(CUmemAccessDesc) == 12


class CudaDriverError(RuntimeError):
    """A CUDA driver call returned an error; `code` is its CUresult."""

    def __init__(self, func: str, code: int, name: str) -> None:
        super().__init__(f"{func} failed: CUresult {code} ({name})")
        self.func, self.code = func, code


_u64, _size, _ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
# name -> (argtypes, symbols to try: cuda.h maps some names to a _v2 symbol)
_SIGNATURES: dict[str, tuple[list[Any], tuple[str, ...]]] = {
    "cuInit": ([ctypes.c_uint], ("cuInit",)),
    "cuGetErrorName": ([ctypes.c_int, _ptr(ctypes.c_char_p)], ("cuGetErrorName",)),
    "cuDeviceGet": ([_ptr(ctypes.c_int), ctypes.c_int], ("cuDeviceGet",)),
    "cuDeviceGetAttribute": ([_ptr(ctypes.c_int), ctypes.c_int, ctypes.c_int], ("cuDeviceGetAttribute",)),
    "cuDevicePrimaryCtxRetain": ([_ptr(ctypes.c_void_p), ctypes.c_int], ("cuDevicePrimaryCtxRetain",)),
    "cuDevicePrimaryCtxRelease": ([ctypes.c_int], ("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease")),
    "cuCtxPushCurrent": ([ctypes.c_void_p], ("cuCtxPushCurrent_v2", "cuCtxPushCurrent")),
    "cuCtxPopCurrent": ([_ptr(ctypes.c_void_p)], ("cuCtxPopCurrent_v2", "cuCtxPopCurrent")),
    "cuMemGetAllocationGranularity": (
        [_ptr(_size), _ptr(CUmemAllocationProp), ctypes.c_int],
        ("cuMemGetAllocationGranularity",),
    ),
    "cuMemAddressReserve": ([_ptr(_u64), _size, _size, _u64, ctypes.c_ulonglong], ("cuMemAddressReserve",)),
    "cuMemAddressFree": ([_u64, _size], ("cuMemAddressFree",)),
    "cuMemCreate": ([_ptr(_u64), _size, _ptr(CUmemAllocationProp), ctypes.c_ulonglong], ("cuMemCreate",)),
    "cuMemRelease": ([_u64], ("cuMemRelease",)),
    "cuMemMap": ([_u64, _size, _size, _u64, ctypes.c_ulonglong], ("cuMemMap",)),
    "cuMemUnmap": ([_u64, _size], ("cuMemUnmap",)),
    "cuMemSetAccess": ([_u64, _size, _ptr(CUmemAccessDesc), _size], ("cuMemSetAccess",)),
}


class Driver:
    """The few driver calls used here, each checking its CUresult (raising `CudaDriverError` with the function's
    name and the code). Outputs are returned, not passed by pointer."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns: dict[str, Any] = {}
        for name, (argtypes, symbols) in _SIGNATURES.items():
            fn = next((getattr(lib, s) for s in symbols if hasattr(lib, s)), None)
            if fn is None:
                raise OSError(f"libcuda has no {name}")
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self._fns[name] = fn
        self.call("cuInit", 0)

    def call(self, name: str, *args: Any) -> None:
        code = self._fns[name](*args)
        if code != 0:
            text = ctypes.c_char_p()
            ok = self._fns["cuGetErrorName"](code, ctypes.byref(text)) == 0 and text.value
            raise CudaDriverError(name, code, text.value.decode() if ok else "unknown error")

    # -- one method per call, outputs returned
    def device(self, ordinal: int) -> int:
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        return dev.value

    def attribute(self, attr: int, dev: int) -> int:
        out = ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(out), attr, dev)
        return out.value

    def retain_primary_context(self, dev: int) -> int:
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        return int(ctx.value or 0)

    def release_primary_context(self, dev: int) -> None:
        self.call("cuDevicePrimaryCtxRelease", dev)

    def push_context(self, ctx: int) -> None:
        self.call("cuCtxPushCurrent", ctypes.c_void_p(ctx))

    def pop_context(self) -> None:
        out = ctypes.c_void_p()
        self.call("cuCtxPopCurrent", ctypes.byref(out))

    def granularity(self, prop: CUmemAllocationProp) -> int:
        out = ctypes.c_size_t()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(out), ctypes.byref(prop), 0)
        return out.value

    def reserve(self, size: int, alignment: int) -> int:
        ptr = ctypes.c_uint64()
        self.call("cuMemAddressReserve", ctypes.byref(ptr), size, alignment, 0, 0)
        return ptr.value

    def free_address(self, ptr: int, size: int) -> None:
        self.call("cuMemAddressFree", ptr, size)

    def create(self, size: int, prop: CUmemAllocationProp) -> int:
        handle = ctypes.c_uint64()
        self.call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
        return handle.value

    def release(self, handle: int) -> None:
        self.call("cuMemRelease", handle)

    def map(self, ptr: int, size: int, handle: int) -> None:
        self.call("cuMemMap", ptr, size, 0, handle, 0)

    def unmap(self, ptr: int, size: int) -> None:
        self.call("cuMemUnmap", ptr, size)

    def set_access(self, ptr: int, size: int, desc: CUmemAccessDesc) -> None:
        self.call("cuMemSetAccess", ptr, size, ctypes.byref(desc), 1)


_driver_lock = threading.Lock()
_driver_cache: list[Driver | str] = []


def driver() -> Driver:
    """libcuda's VMM calls (loaded and cuInit'ed once); OSError when libcuda cannot be used."""
    with _driver_lock:
        if not _driver_cache:
            try:
                _driver_cache.append(Driver(ctypes.CDLL("libcuda.so.1")))
            except (OSError, CudaDriverError) as e:
                _driver_cache.append(f"{type(e).__name__}: {e}")
        got = _driver_cache[0]
    if isinstance(got, str):
        raise OSError(f"libcuda.so.1 is not usable: {got}")
    return got


_mapped_lock = threading.Lock()
_mapped: dict[int, int] = {}


def mapped_bytes(device_index: int) -> int:
    """Bytes that this process's `RemappableBuffer`s hold mapped on the device now (memory torch's allocator does
    not see: `torch.cuda.memory_reserved` leaves it out, `torch.cuda.mem_get_info` counts it as used)."""
    with _mapped_lock:
        return _mapped.get(int(device_index), 0)


def _count_mapped(device_index: int, delta: int) -> None:
    with _mapped_lock:
        _mapped[device_index] = _mapped.get(device_index, 0) + delta


class _State:
    """What `RemappableBuffer` frees (kept apart from it, for its finalizer)."""

    def __init__(self, drv: Driver, device_index: int, dev: int, ctx: int) -> None:
        self.drv, self.device_index, self.dev, self.ctx = drv, device_index, dev, ctx
        self.address = self.nbytes = 0
        self.handle: int | None = None
        self.closed = False

    @contextlib.contextmanager
    def current(self):
        """The device's primary context (torch's) current on this thread, whatever thread or device this is."""
        self.drv.push_context(self.ctx)
        try:
            yield
        finally:
            self.drv.pop_context()

    def unmap(self) -> None:
        if self.handle is None:
            return
        with self.current():
            self.drv.unmap(self.address, self.nbytes)
            handle, self.handle = self.handle, None
            _count_mapped(self.device_index, -self.nbytes)
            self.drv.release(handle)  # the physical memory goes back to the device here

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.unmap()
            if self.address:
                with self.current():
                    self.drv.free_address(self.address, self.nbytes)
                self.address = 0
        finally:
            self.drv.release_primary_context(self.dev)


def _finalize(state: _State) -> None:
    with contextlib.suppress(Exception):  # garbage collection: nothing to raise to
        state.close()


class _ArrayView:
    """`__cuda_array_interface__` (v2) of a buffer's bytes, for `torch.as_tensor`. Tensors made from it keep it
    (hence the buffer) alive."""

    def __init__(self, buffer: RemappableBuffer, nbytes: int) -> None:
        self.buffer = buffer
        self.__cuda_array_interface__ = {
            "shape": (int(nbytes),),
            "typestr": "|u1",
            "data": (int(buffer.address), False),
            "strides": None,
            "version": 2,
        }


class RemappableBuffer:
    """`nbytes` (rounded up to the allocation granularity, usually 2 MiB) of virtual addresses on CUDA device
    `device_index`, reserved for the buffer's lifetime; physical memory behind them only between `map()` and
    `unmap()`. Not thread-safe: one owner calls it."""

    def __init__(self, nbytes: int, device_index: int) -> None:
        if nbytes < 1:
            raise ValueError(f"RemappableBuffer of {nbytes} bytes")
        drv = driver()
        dev = drv.device(int(device_index))
        state = _State(drv, int(device_index), dev, drv.retain_primary_context(dev))
        self._state = state
        self._finalizer = weakref.finalize(self, _finalize, state)
        self._finalizer.atexit = False  # at interpreter exit the driver frees it all with the process
        try:
            self._prop = CUmemAllocationProp()
            self._prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
            self._prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE
            self._prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
            self._prop.location.id = int(device_index)
            self._access = CUmemAccessDesc()
            self._access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
            self._access.location.id = int(device_index)
            self._access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            with state.current():
                self.granularity = drv.granularity(self._prop)
                size = -(-int(nbytes) // self.granularity) * self.granularity
                state.address = drv.reserve(size, self.granularity)
                state.nbytes = size
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> int:
        return self._state.address

    @property
    def nbytes(self) -> int:
        return self._state.nbytes

    @property
    def device_index(self) -> int:
        return self._state.device_index

    @property
    def mapped(self) -> bool:
        return self._state.handle is not None

    def map(self) -> None:
        """Physical memory (new, contents undefined) behind the whole range, readable and writable from the
        device. No-op when mapped. Raises `CudaDriverError` (code 2: out of memory) and stays unmapped on failure."""
        st = self._state
        if st.closed:
            raise RuntimeError("RemappableBuffer is closed")
        if st.handle is not None:
            return
        drv = st.drv
        with st.current():
            handle = drv.create(st.nbytes, self._prop)
            try:
                drv.map(st.address, st.nbytes, handle)
                try:
                    drv.set_access(st.address, st.nbytes, self._access)
                except BaseException:
                    drv.unmap(st.address, st.nbytes)
                    raise
            except BaseException:
                drv.release(handle)
                raise
            st.handle = handle
            _count_mapped(st.device_index, st.nbytes)

    def unmap(self) -> None:
        """Give the physical memory back to the device (after waiting for the device's queued work, which may read
        it); the addresses stay reserved. No-op when unmapped."""
        if self._state.handle is None:
            return
        torch.cuda.synchronize(self.device_index)
        self._state.unmap()

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """A contiguous tensor of `shape` / `dtype` at `offset` bytes into the range (zero-copy; call while
        mapped). It stays valid across unmap / map but must not be read or written while unmapped."""
        if not self.mapped:
            raise RuntimeError("RemappableBuffer.tensor: map() first")
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        size = torch.empty(0, dtype=dtype).element_size()
        nbytes = numel * size
        if offset < 0 or offset % size or offset + nbytes > self.nbytes:
            raise ValueError(
                f"a {tuple(shape)} {dtype} tensor at offset {offset} needs bytes [{offset}, {offset + nbytes}) "
                f"(offset a multiple of {size}); the buffer has {self.nbytes}"
            )
        device = torch.device("cuda", self.device_index)
        raw = torch.as_tensor(_ArrayView(self, self.nbytes), device=device)
        if raw.data_ptr() != self.address or raw.device != device or raw.dtype != torch.uint8:
            raise RuntimeError(
                f"torch.as_tensor did not wrap the buffer in place (data_ptr {raw.data_ptr():#x}, device "
                f"{raw.device}, {raw.dtype}; the buffer is at {self.address:#x} on {device})"
            )
        out = raw[offset : offset + nbytes].view(dtype).view(shape)
        assert out.data_ptr() == self.address + offset and out.is_contiguous()
        return out

    def close(self) -> None:
        """Unmap, free the addresses. Tensors over the buffer must be gone (or never used again)."""
        self._finalizer()


_supported: dict[int, str | None] = {}


def vmm_supported(device: torch.device | str) -> str | None:
    """None when `RemappableBuffer` works on `device`, else why not: not a CUDA device, libcuda not loadable, the
    device without VMM support, or a probe (map / wrap as a tensor / unmap of one granule) failing. Checked once
    per device."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if getattr(torch.version, "hip", None):
        return "ROCm build of torch (the CUDA driver's VMM calls are not bound here)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _supported:
        _supported[index] = _probe(index)
    return _supported[index]


def _probe(index: int) -> str | None:
    torch.cuda.init()
    torch.zeros(1, device=torch.device("cuda", index))  # torch's primary context on the device exists
    try:
        drv = driver()
        dev = drv.device(index)
        if not drv.attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev):
            return f"cuda:{index} does not support virtual memory management (cuDeviceGetAttribute)"
    except (OSError, CudaDriverError) as e:
        return str(e)
    buf = None
    try:
        buf = RemappableBuffer(1, index)
        buf.map()
        t = buf.tensor((buf.nbytes,), torch.uint8)  # checks the zero-copy wrap; touches no memory
        del t
        buf.unmap()
        buf.map()  # and once more: the address is reusable
        buf.unmap()
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it, and say why
        return f"VMM probe failed: {type(e).__name__}: {e}"
    finally:
        if buf is not None:
            with contextlib.suppress(Exception):
                buf.close()
    return None


__all__ = ["CudaDriverError", "RemappableBuffer", "mapped_bytes", "vmm_supported"]
