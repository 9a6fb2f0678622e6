"""A stand-in for CuPy that fails on every device-to-host sync, for proving a launch path has none.

Its arrays hold NumPy data on the host, but every way of reading their contents from the host
(``get``, ``__array__``, ``item``, ``tolist``, ``bool``/``int``/``float``) and every wait on the
stream raises ``SyncError``: exactly the operations that make CuPy block until the GPU catches up.
Slicing, reshaping, ``fill``, reductions and allocation stay "on the device" (they return fake
arrays) and are counted. ``FakeCudaRunner`` is the real ``CudaRunner`` on this module whose
kernels run through the CPU emulation harness, so results are checked as well.
"""

from __future__ import annotations

import ctypes
import sys
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
from pagedkv.attention.runners import CudaRunner
from pagedkv.kernels import emulation
from pagedkv.kernels.instances import Instance

MODULE_NAME = "cupy_fake"  # starts with "cupy": pagedkv treats its arrays as device arrays


class SyncError(AssertionError):
    """The code under test read device memory from the host (a device-to-host sync)."""


class Counters:
    allocations = 0
    uploads = 0
    event_waits = 0
    launches = 0

    @classmethod
    def reset(cls) -> None:
        cls.allocations = cls.uploads = cls.event_waits = cls.launches = 0


def _sync(what: str) -> Any:
    raise SyncError(f"device-to-host sync: {what}")


class _Pointer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class FakeArray:
    """A device array whose contents the host may not read."""

    __module__ = MODULE_NAME

    def __init__(self, data: np.ndarray) -> None:
        self._a = data

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    data = property(lambda self: _Pointer(int(self._a.ctypes.data)))

    @property
    def flags(self) -> Any:
        return types.SimpleNamespace(
            c_contiguous=self._a.flags.c_contiguous, f_contiguous=self._a.flags.f_contiguous
        )

    def __getitem__(self, key: Any) -> FakeArray:
        return FakeArray(self._a[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[key] = value._a if isinstance(value, FakeArray) else value

    def reshape(self, *shape: Any) -> FakeArray:
        return FakeArray(self._a.reshape(*shape))

    def fill(self, value: Any) -> None:
        self._a.fill(value)

    def astype(self, dtype: Any) -> FakeArray:
        Counters.allocations += 1
        return FakeArray(self._a.astype(dtype))

    def max(self) -> FakeArray:
        return FakeArray(np.asarray(self._a.max()))

    def min(self) -> FakeArray:
        return FakeArray(np.asarray(self._a.min()))

    def any(self) -> FakeArray:
        return FakeArray(np.asarray(self._a.any()))

    def get(self) -> Any:
        return _sync("get()")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return _sync("__array__")

    def item(self) -> Any:
        return _sync("item()")

    def tolist(self) -> Any:
        return _sync("tolist()")

    def __bool__(self) -> bool:
        return bool(_sync("bool()"))

    def __int__(self) -> int:
        return int(_sync("int()"))

    def __float__(self) -> float:
        return float(_sync("float()"))

    def __index__(self) -> int:
        return int(_sync("index"))


def _alloc(data: np.ndarray) -> FakeArray:
    Counters.allocations += 1
    return FakeArray(data)


def _host(x: Any) -> Any:
    return x._a if isinstance(x, FakeArray) else x


class _Stream:
    ptr = 0

    def synchronize(self) -> None:
        _sync("stream.synchronize()")


class _Event:
    def __init__(self, disable_timing: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        # Waiting for an event is a host wait, not a read of device memory: allowed, but counted.
        Counters.event_waits += 1


def _memcpy_async(dst: int, src: int, num_bytes: int, kind: int, stream: int) -> None:
    Counters.uploads += 1
    ctypes.memmove(dst, src, num_bytes)


class FakeDriverError(RuntimeError):
    """Stands in for cupy.cuda.driver.CUDADriverError."""


class FakeRawModule:
    """Records how a module was made; get_function returns a named stand-in (never runs)."""

    made: list[dict[str, Any]] = []

    def __init__(self, **kwargs: Any) -> None:
        FakeRawModule.made.append(kwargs)
        self.kwargs = kwargs

    def get_function(self, name: str) -> Any:
        if "path" in self.kwargs and open(self.kwargs["path"], "rb").read(4) != b"\x7fELF":
            raise FakeDriverError("CUDA_ERROR_INVALID_IMAGE")
        return types.SimpleNamespace(symbol=name, kwargs=self.kwargs)


def make_module() -> types.ModuleType:
    """The fake ``cupy`` module, registered in sys.modules under MODULE_NAME."""
    m = types.ModuleType(MODULE_NAME)
    m.ndarray = FakeArray  # type: ignore[attr-defined]
    m.empty = lambda shape, dtype=np.float32: _alloc(np.empty(shape, dtype))  # type: ignore[attr-defined]
    m.zeros = lambda shape, dtype=np.float32: _alloc(np.zeros(shape, dtype))  # type: ignore[attr-defined]
    m.full = lambda shape, fill, dtype=None: _alloc(np.full(shape, fill, dtype))  # type: ignore[attr-defined]
    m.arange = lambda *a, **k: _alloc(np.arange(*a, **k))  # type: ignore[attr-defined]
    m.stack = lambda xs: _alloc(np.stack([_host(x) for x in xs]))  # type: ignore[attr-defined]
    m.argwhere = lambda x: _alloc(np.argwhere(_host(x)))  # type: ignore[attr-defined]

    def asarray(x: Any) -> FakeArray:
        if isinstance(x, FakeArray):
            return x
        Counters.uploads += 1
        return _alloc(np.array(x))

    m.asarray = asarray  # type: ignore[attr-defined]
    runtime = types.SimpleNamespace(
        memcpyAsync=_memcpy_async, memcpyHostToDevice=1, memcpyDefault=4, memcpyDeviceToDevice=3
    )
    m.RawModule = FakeRawModule  # type: ignore[attr-defined]
    m.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        runtime=runtime,
        driver=types.SimpleNamespace(CUDADriverError=FakeDriverError),
        Device=lambda *a: types.SimpleNamespace(
            attributes={"MultiProcessorCount": 132}, compute_capability="90"
        ),
        get_current_stream=_Stream,
        Event=_Event,
        alloc_pinned_memory=lambda n: bytearray(n),
    )
    sys.modules[MODULE_NAME] = m
    return m


class FakeCudaRunner(CudaRunner):
    """The cuda backend's runner on the fake module; kernels run in the CPU emulation."""

    def __init__(self) -> None:
        super().__init__(make_module())

    def function(self, instance: Instance) -> Any:
        kernel = emulation.get_kernel(instance.source, instance.name)

        def launch(grid: tuple[int, int, int], block: tuple[int, int, int], args: Sequence[Any]) -> None:
            Counters.launches += 1
            kernel.launch(grid, block, [_host(a) for a in args])

        return launch


def to_device(*arrays: np.ndarray) -> list[FakeArray]:
    return [FakeArray(np.ascontiguousarray(a).copy()) for a in arrays]


def to_host(x: FakeArray) -> np.ndarray:
    """What a test (not the code under test) may do: look at the result."""
    return x._a
