"""The two kernel runners: CuPy on a GPU (``cuda``) and the CPU emulation (``emulated``).

CuPy is imported only when the cuda backend is first used, so ``import pagedkv`` never needs it.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedkv.attention import split_planning
from pagedkv.errors import CudaUnavailableError
from pagedkv.kernels import KERNEL_DIR, cubin_cache, emulation, instances, nvrtc
from pagedkv.kernels.instances import Instance

NVRTC_OPTIONS = ("-std=c++17", f"-I{KERNEL_DIR}")


class EmulatedRunner:
    """Runs kernels on the CPU through cuda_emu.h; outputs are NaN-poisoned before each launch."""

    xp: Any = np
    poison: bool = True
    # A toy machine of two one-CTA SMs: small emulated batches still take the split path.
    num_sms: int = 2

    def ctas_per_sm(self, instance: Instance) -> int:
        return 1

    def launch(
        self,
        instance: Instance,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
        reachable: Sequence[Any] = (),
    ) -> None:
        emulation.get_kernel(instance.source, instance.name).launch(grid, block, args, reachable)

    def memcpy(self, dst_address: int, src_address: int, num_bytes: int) -> None:
        ctypes.memmove(dst_address, src_address, num_bytes)

    def address(self, array: Any) -> int:
        return int(array.ctypes.data)

    def staging_empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A host buffer that upload_async may copy from."""
        return np.empty(shape, dtype=dtype)

    def upload_async(self, dst: Any, src: np.ndarray) -> Any:
        """Copies a host array into a device array of the same size (here: both on the host);
        returns what upload_done waits on."""
        np.copyto(dst.reshape(src.shape), src)
        return None

    def upload_done(self, token: Any) -> None:
        """Returns once the upload that returned ``token`` has read its host buffer (at once here)."""


class CudaRunner:
    """Runs kernels on the current CUDA device through CuPy RawModules (one per instance, cached)."""

    poison: bool = False
    xp: Any
    num_sms: int

    def __init__(self, cupy_module: Any = None) -> None:
        """cupy_module: CuPy itself (imported here when None); tests pass a stand-in."""
        if cupy_module is None:
            try:
                cupy_module = importlib.import_module("cupy")  # optional: imported on first use
            except ImportError as exc:
                raise CudaUnavailableError(
                    "backend='cuda' needs CuPy and a CUDA GPU: pip install cupy-cuda13x "
                    "(or, in a pagedkv checkout, pip install '.[cuda]')"
                ) from exc
        cupy = cupy_module
        self.xp = cupy
        self._cupy = cupy
        try:
            self.num_sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        except Exception as exc:  # CUDARuntimeError without a device
            raise CudaUnavailableError(f"backend='cuda' found no usable CUDA device: {exc}") from exc
        self._functions: dict[Instance, Any] = {}
        self._occupancy: dict[Instance, int] = {}
        self.fallback_reason = ""  # why kernels come from CuPy's compile, if they do
        self._lock = threading.Lock()

    def arch(self) -> str:
        """The current device's architecture as NVRTC names it, e.g. sm_90."""
        return f"sm_{self._cupy.cuda.Device().compute_capability}"

    def function(self, instance: Instance) -> Any:
        with self._lock:
            fn = self._functions.get(instance)
            if fn is None:
                fn = self._load_function(instance)
                self._functions[instance] = fn
        return fn

    def _load_function(self, instance: Instance) -> Any:
        """The kernel from pagedkv's persistent cubin cache (no compile in a later process); CuPy's
        own compile where libnvrtc (pip nvidia-cuda-nvrtc) is missing or the driver refuses the
        cubin (a toolkit newer than the driver)."""
        try:
            entry = cubin_cache.cached_cubin(instance.source, [instance.name], self.arch())
            module = self._cupy.RawModule(path=str(entry.path))
            return module.get_function(entry.lowered_names[instance.name])
        except nvrtc.NvrtcUnavailable:
            self.fallback_reason = "libnvrtc not found: CuPy compiles the kernels (no persistent cache)"
        except self._cupy.cuda.driver.CUDADriverError as exc:
            self.fallback_reason = f"the driver refused the cached cubin ({exc}): CuPy compiles instead"
        # CuPy caches compiled modules by source text only: name the headers' hashes in the text
        # so an edited header cannot reuse a stale binary.
        headers = "".join(
            f"// {h.name} sha256 {hashlib.sha256(h.read_bytes()).hexdigest()}\n"
            for h in sorted(KERNEL_DIR.glob("*.h"))
        )
        code = headers + (KERNEL_DIR / instance.source).read_text()
        module = self._cupy.RawModule(code=code, options=NVRTC_OPTIONS, name_expressions=[instance.name])
        return module.get_function(instance.name)

    def launch(
        self,
        instance: Instance,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
        reachable: Sequence[Any] = (),
    ) -> None:
        self.function(instance)(grid, block, tuple(args))

    def ctas_per_sm(self, instance: Instance) -> int:
        """Resident CTAs per SM of a kernel: the driver's occupancy API, else the occupancy rules
        on the function's registers and shared memory, else 2. Cached per instance."""
        cached = self._occupancy.get(instance)
        if cached is not None:
            return cached
        fn = self.function(instance)
        threads = instances.threads_per_cta(instance)
        value = 2
        try:
            value = int(self._cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, threads, 0))
        except AttributeError:  # a CuPy without the occupancy binding: its attributes instead
            regs, smem = getattr(fn, "num_regs", None), getattr(fn, "shared_size_bytes", None)
            if regs is not None and smem is not None:
                value = split_planning.ctas_per_sm_from_resources(int(regs), int(smem), threads)
        self._occupancy[instance] = max(1, value)
        return self._occupancy[instance]

    def memcpy(self, dst_address: int, src_address: int, num_bytes: int) -> None:
        runtime = self._cupy.cuda.runtime
        stream = self._cupy.cuda.get_current_stream()
        runtime.memcpyAsync(dst_address, src_address, num_bytes, runtime.memcpyDefault, stream.ptr)

    def address(self, array: Any) -> int:
        if isinstance(array, np.ndarray):
            return int(array.ctypes.data)
        return int(array.data.ptr)

    def staging_empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A host array in page-locked memory, so upload_async is a true asynchronous DMA."""
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = max(1, count * np.dtype(dtype).itemsize)
        memory = self._cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)

    def upload_async(self, dst: Any, src: np.ndarray) -> Any:
        """Host-to-device copy on the current stream; never waits for the device."""
        runtime = self._cupy.cuda.runtime
        stream = self._cupy.cuda.get_current_stream()
        runtime.memcpyAsync(
            int(dst.data.ptr), int(src.ctypes.data), int(src.nbytes), runtime.memcpyHostToDevice, stream.ptr
        )
        done = self._cupy.cuda.Event(disable_timing=True)
        done.record(stream)
        return done

    def upload_done(self, token: Any) -> None:
        """Waits until the upload that returned ``token`` has run (and, stream order, whatever was
        queued before it), so its host buffer may be refilled."""
        if token is not None:
            token.synchronize()

    def is_pinned(self, array: np.ndarray) -> bool:
        """Whether a host array lives in page-locked memory CUDA can DMA from."""
        runtime = self._cupy.cuda.runtime
        try:
            attrs = runtime.pointerGetAttributes(int(array.ctypes.data))
        except Exception:  # unregistered pageable memory raises on some CUDA versions
            return False
        return int(getattr(attrs, "type", 0)) == int(getattr(runtime, "memoryTypeHost", 1))


_emulated: EmulatedRunner | None = None
_cuda: CudaRunner | None = None
_runner_lock = threading.Lock()


def get_runner(backend: str) -> EmulatedRunner | CudaRunner:
    global _emulated, _cuda
    with _runner_lock:
        if backend == "emulated":
            if _emulated is None:
                _emulated = EmulatedRunner()
            return _emulated
        if _cuda is None:
            _cuda = CudaRunner()
        return _cuda
