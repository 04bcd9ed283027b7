"""Device memory handed back to the device between rollouts and taken again at the same addresses.

The engine's KV cache is sized for the rollout (tens of GB on one GPU at reasoning lengths) and is
idle while the trainer updates the model, which then has that much less memory for activations
(and checkpoints more, or runs smaller micro-batches). The decode's CUDA graphs hold the cache's
addresses, so freeing the tensor and allocating a new one would mean capturing every graph again.

CUDA's virtual memory management separates an address range from the physical memory behind it:
:class:`Releasable` reserves the range once (``cuMemAddressReserve``) and maps physical memory into
it (``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``); :meth:`Releasable.release` unmaps and frees
the physical memory (the range and the tensor viewing it stay), :meth:`Releasable.acquire` maps new
physical memory at the same addresses and zeroes it. The contents do not survive a release (a
rollout's keys and values are not needed after it). Between the two the tensor must not be touched:
a kernel reading it would fault (the engine takes the memory again before any use).

The driver is reached through ``ctypes`` (``libcuda``), no extension to build. Where it is missing
(CPU, another accelerator, a driver without the API) :func:`zeros` gives a plain tensor whose
``release`` does nothing (``releasable`` False).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import threading
import weakref
from typing import Callable, Optional, Sequence

import torch

log = logging.getLogger(__name__)

# driver enums (cuda.h)
_ALLOCATION_TYPE_PINNED = 1
_HANDLE_TYPE_NONE = 0
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READWRITE = 3
_GRANULARITY_RECOMMENDED = 1
_ERROR_OUT_OF_MEMORY = 2


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DriverError(RuntimeError):
    """A CUDA driver call of the virtual memory API failed (``code``: its ``CUresult``)."""

    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code = call, code


class Driver:
    """The few driver calls :class:`Releasable` needs, on one device (ordinal ``device``).

    Tests substitute an object with the same methods."""

    _lib = None
    _lock = threading.Lock()

    def __init__(self, device: int):
        self.device = int(device)
        with Driver._lock:
            if Driver._lib is None:
                Driver._lib = ctypes.CDLL("libcuda.so.1")
        self.lib = Driver._lib
        self.prop = _AllocationProp(type=_ALLOCATION_TYPE_PINNED, requestedHandleTypes=_HANDLE_TYPE_NONE,
                                    location=_Location(type=_LOCATION_TYPE_DEVICE, id=self.device))

    def _call(self, name: str, *args) -> None:
        fn = getattr(self.lib, name)
        fn.restype = ctypes.c_int
        code = int(fn(*args))
        if code != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(text))
            raise DriverError(name, code, text.value.decode() if text.value else "unknown error")

    def granularity(self) -> int:
        size = ctypes.c_size_t()
        self._call("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(self.prop),
                   ctypes.c_int(_GRANULARITY_RECOMMENDED))
        return int(size.value)

    def reserve(self, size: int, alignment: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(alignment),
                   ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        return int(ptr.value)

    def free_range(self, ptr: int, size: int) -> None:
        self._call("cuMemAddressFree", ctypes.c_uint64(ptr), ctypes.c_size_t(size))

    def create(self, size: int) -> int:
        handle = ctypes.c_ulonglong()
        self._call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self.prop),
                   ctypes.c_ulonglong(0))
        return int(handle.value)

    def map(self, ptr: int, size: int, handle: int) -> None:
        self._call("cuMemMap", ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                   ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0))
        access = _AccessDesc(location=_Location(type=_LOCATION_TYPE_DEVICE, id=self.device),
                             flags=_ACCESS_READWRITE)
        self._call("cuMemSetAccess", ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(access),
                   ctypes.c_size_t(1))

    def unmap(self, ptr: int, size: int) -> None:
        self._call("cuMemUnmap", ctypes.c_uint64(ptr), ctypes.c_size_t(size))

    def release(self, handle: int) -> None:
        self._call("cuMemRelease", ctypes.c_ulonglong(handle))

    def view(self, ptr: int, size: int, device: torch.device, on_free: Callable[[], None]) -> torch.Tensor:
        """A ``uint8`` tensor over the ``size`` bytes at ``ptr``; ``on_free`` runs once no tensor views them."""
        interface = _Interface(ptr, size)
        weakref.finalize(interface, on_free).atexit = False  # at exit the process's memory goes anyway
        return torch.as_tensor(interface, device=device)


class _Interface:
    """``__cuda_array_interface__`` of ``size`` bytes at ``ptr`` (what ``torch.as_tensor`` views)."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}


class _Range:
    """A reserved address range of ``size`` bytes on ``driver``'s device and the physical memory mapped
    into it (``handle``, None while released). Holds no tensor, so a finalizer may keep it."""

    def __init__(self, driver: Driver, size: int, alignment: int):
        self.driver, self.size, self.handle = driver, int(size), None
        self.ptr = driver.reserve(self.size, alignment)

    def map(self) -> None:
        handle = self.driver.create(self.size)
        try:
            self.driver.map(self.ptr, self.size, handle)
        except BaseException:
            self.driver.release(handle)
            raise
        self.handle = handle

    def unmap(self) -> None:
        if self.handle is not None:
            self.driver.unmap(self.ptr, self.size)
            self.driver.release(self.handle)
            self.handle = None

    def close(self) -> None:
        """Unmap and free the range (once no tensor views it)."""
        try:
            self.unmap()
            if self.ptr:
                self.driver.free_range(self.ptr, self.size)
                self.ptr = 0
        except Exception as err:  # noqa: BLE001 - at exit or after a device error: nothing left to do
            log.debug("KV cache range not freed: %s", err)


class Releasable:
    """A zero-filled tensor of ``shape`` and ``dtype`` on ``device`` whose memory can be handed back.

    :attr:`tensor` keeps its addresses for its whole life; :attr:`mapped` says whether memory is
    behind them now. Built by :func:`zeros`; ``driver`` None gives a plain tensor (not releasable).
    The address range is freed when the last tensor viewing it is."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, driver: Optional[Driver]):
        self.shape, self.dtype, self.device = tuple(int(s) for s in shape), dtype, torch.device(device)
        self.nbytes = int(torch.Size(self.shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        self.driver = driver
        self.releases = 0
        self._range: Optional[_Range] = None
        if driver is None:
            self.size = self.nbytes
            self.tensor = torch.zeros(self.shape, dtype=dtype, device=self.device)
            return
        grain = driver.granularity()
        self.size = -(-max(self.nbytes, 1) // grain) * grain
        self._range = _Range(driver, self.size, grain)
        try:
            self._range.map()
            raw = driver.view(self._range.ptr, self.size, self.device, self._range.close)
        except BaseException:
            self._range.close()
            raise
        self.tensor = raw[:self.nbytes].view(dtype).view(self.shape)
        self.tensor.zero_()

    @property
    def releasable(self) -> bool:
        return self._range is not None

    @property
    def mapped(self) -> bool:
        return self._range is None or self._range.handle is not None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release(self) -> int:
        """Hand the memory back to the device (after the work queued on it ends); the bytes freed (0
        when not releasable or already released)."""
        if self.mapped and self._range is not None:
            self._sync()
            self._range.unmap()
            self.releases += 1
            return self.size
        return 0

    def acquire(self) -> None:
        """Map memory at the same addresses again and zero it (nothing when it is mapped). The
        caching allocator's unused blocks are returned to the device first, so the memory the
        update took is free again; raises ``torch.OutOfMemoryError`` when it still is not."""
        if self.mapped:
            return
        for attempt in (0, 1):
            if attempt:  # tensors the update left to the garbage collector
                gc.collect()
            self._sync()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                self._range.map()
                break
            except DriverError as err:
                if err.code != _ERROR_OUT_OF_MEMORY:
                    raise
                if attempt:
                    raise torch.OutOfMemoryError(
                        f"rollout engine: the KV cache's {self.size / 2**30:.2f} GiB could not be mapped again after "
                        f"it was released for the update ({err}): the memory is still in use. Set "
                        "actor.rollout_engine.release_kv=false to keep the cache allocated") from err
        self.tensor.zero_()


def driver_for(device: torch.device) -> Optional[Driver]:
    """The driver of ``device`` when its memory can be released this way (CUDA with the virtual
    memory API), else None; why not is logged at debug level."""
    if device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip is not None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch.cuda.synchronize(index)  # the primary context is current in this thread
        driver = Driver(index)
        driver.granularity()
        return driver
    except (OSError, AttributeError, DriverError) as err:
        log.debug("KV cache release unavailable: %s", err)
        return None


def zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, release: Optional[bool]) -> Releasable:
    """A zero tensor that can be released where ``release`` asks (None: where the device can;
    True: required, ``ValueError`` where it cannot; False: a plain tensor)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    driver = driver_for(device) if release is not False else None
    if release is True and driver is None:
        raise ValueError(f"actor.rollout_engine.release_kv=true, but the KV cache on {device} cannot be released "
                         "(CUDA's virtual memory API is needed); set it to null (auto) or false")
    if driver is not None:
        try:
            return Releasable(shape, dtype, device, driver)
        except Exception as err:  # noqa: BLE001 - any failure of the driver path: a plain tensor, said once
            if isinstance(err, DriverError) and err.code == _ERROR_OUT_OF_MEMORY:
                raise torch.OutOfMemoryError(f"rollout engine: the KV cache's {shape} could not be mapped: {err}") \
                    from err
            if release is True:
                raise
            log.warning("rollout engine: the KV cache cannot be made releasable (%s: %s); it stays allocated",
                        type(err).__name__, err)
    return Releasable(shape, dtype, device, None)
