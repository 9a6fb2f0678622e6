"""Compile-checks the kernel sources with NVRTC, no GPU needed.

Loads libnvrtc through ctypes from the ``nvidia-cuda-nvrtc`` wheel (or the system), compiles a
source with every requested template instance for a real architecture (sm_90 by default) and
returns the compiler log, which with ``--ptxas-options=-v`` lists registers and spills per kernel.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.errors import NvrtcCompileError, NvrtcUnavailable
from pagedkv.kernels import KERNEL_DIR

DEFAULT_ARCH = "sm_90"


def _candidate_paths() -> list[str]:
    paths: list[str] = []
    explicit = os.environ.get("PAGEDKV_NVRTC")
    if explicit:
        paths.append(explicit)
    for base in sys.path:
        # nvidia-cuda-nvrtc wheels: cu13 layout (nvidia/cu13/lib) and cu12 layout (nvidia/cuda_nvrtc/lib).
        for pattern in ("nvidia/cu*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"):
            paths.extend(sorted(glob.glob(os.path.join(base, pattern)), reverse=True))
    paths.extend(["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"])
    return [p for p in paths if "builtins" not in os.path.basename(p) and "alt" not in os.path.basename(p)]


_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """The NVRTC library, loaded once; raises NvrtcUnavailable if none is installed."""
    global _lib
    if _lib is not None:
        return _lib
    for path in _candidate_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        c = ctypes
        lib.nvrtcVersion.argtypes = [c.POINTER(c.c_int), c.POINTER(c.c_int)]
        lib.nvrtcCreateProgram.argtypes = [
            c.POINTER(c.c_void_p),
            c.c_char_p,
            c.c_char_p,
            c.c_int,
            c.POINTER(c.c_char_p),
            c.POINTER(c.c_char_p),
        ]
        lib.nvrtcAddNameExpression.argtypes = [c.c_void_p, c.c_char_p]
        lib.nvrtcCompileProgram.argtypes = [c.c_void_p, c.c_int, c.POINTER(c.c_char_p)]
        lib.nvrtcGetProgramLogSize.argtypes = [c.c_void_p, c.POINTER(c.c_size_t)]
        lib.nvrtcGetProgramLog.argtypes = [c.c_void_p, c.c_char_p]
        lib.nvrtcGetCUBINSize.argtypes = [c.c_void_p, c.POINTER(c.c_size_t)]
        lib.nvrtcGetCUBIN.argtypes = [c.c_void_p, c.c_char_p]
        lib.nvrtcGetLoweredName.argtypes = [c.c_void_p, c.c_char_p, c.POINTER(c.c_char_p)]
        lib.nvrtcDestroyProgram.argtypes = [c.POINTER(c.c_void_p)]
        lib.nvrtcGetErrorString.restype = c.c_char_p
        _lib = lib
        return lib
    raise NvrtcUnavailable("libnvrtc not found: pip install nvidia-cuda-nvrtc (or set PAGEDKV_NVRTC)")


def version() -> tuple[int, int]:
    lib = load()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


@dataclass
class KernelResources:
    """ptxas's report for one kernel."""

    registers: int
    spill_stores_bytes: int
    spill_loads_bytes: int
    stack_frame_bytes: int
    shared_bytes: int


@dataclass
class CompileResult:
    log: str
    cubin_bytes: int
    cubin: bytes = b""  # the compiled image (sm_XX SASS), loadable with cuModuleLoadData
    lowered_names: dict[str, str] = field(default_factory=dict)  # name expression -> mangled symbol
    resources: dict[str, KernelResources] = field(default_factory=dict)  # mangled symbol -> report

    def warnings(self) -> list[str]:
        """Log lines that report a warning or an error (the rest is ptxas's resource report)."""
        return [line for line in self.log.splitlines() if re.search(r"warning|error", line, re.IGNORECASE)]


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        raise NvrtcCompileError(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")


def parse_resources(log: str) -> dict[str, KernelResources]:
    """Per-kernel registers/spills from a ``ptxas -v`` style log."""
    out: dict[str, KernelResources] = {}
    current = None
    frame = stores = loads = 0
    for line in log.splitlines():
        # ptxas names the kernel its next lines describe in either of two forms.
        m = re.search(r"Function properties for (\S+)|Compiling entry function '(\S+)'", line)
        if m:
            current = m.group(1) or m.group(2)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            frame, stores, loads = (int(x) for x in m.groups())
            continue
        m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
        if m and current:
            out[current] = KernelResources(int(m.group(1)), stores, loads, frame, int(m.group(2) or 0))
            frame = stores = loads = 0
    return out


def compile_options(arch: str = DEFAULT_ARCH, extra_options: Sequence[str] = ()) -> list[str]:
    """NVRTC options of every pagedkv compile (the ptxas report is part of the log)."""
    return [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        f"-I{Path(KERNEL_DIR)}",
        "--ptxas-options=-v",
        *extra_options,
    ]


def compile_source(
    source: str,
    name_expressions: Sequence[str],
    arch: str = DEFAULT_ARCH,
    extra_options: Sequence[str] = (),
    source_dir: Path = KERNEL_DIR,
) -> CompileResult:
    """Compiles ``source`` (a file in ``source_dir``, by default the kernel directory) with the given
    template instances to a CUBIN for ``arch`` and returns the log; raises NvrtcCompileError on any
    error. The kernel directory is always on the include path."""
    lib = load()
    text = (Path(source_dir) / source).read_text()
    source_include = [f"-I{Path(source_dir)}"] if Path(source_dir) != Path(KERNEL_DIR) else []
    options = compile_options(arch, [*source_include, *extra_options])
    prog = ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), source.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        for name in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, name.encode()), f"nvrtcAddNameExpression({name})")
        argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc != 0:
            raise NvrtcCompileError(
                f"NVRTC failed for {source} ({lib.nvrtcGetErrorString(rc).decode()}):\n{log}"
            )
        cubin = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)), "nvrtcGetCUBINSize")
        image = ctypes.create_string_buffer(cubin.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
        result = CompileResult(
            log=log, cubin_bytes=cubin.value, cubin=image.raw, resources=parse_resources(log)
        )
        for name in name_expressions:
            lowered = ctypes.c_char_p()
            _check(
                lib,
                lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)),
                f"nvrtcGetLoweredName({name})",
            )
            result.lowered_names[name] = (lowered.value or b"").decode()
        return result
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
