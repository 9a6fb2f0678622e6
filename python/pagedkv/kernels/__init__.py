"""CUDA kernel sources (``*.cu``), their CPU emulation header and the loaders that build them.

The ``.cu`` files are compiled for the GPU by NVRTC (through CuPy's ``RawModule``) and for the CPU
by g++ with ``cuda_emu.h`` (``backend="emulated"``); ``instances`` lists every template instance.
"""

import os
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
"""Directory holding the kernel sources and headers (shipped in the wheel)."""


def source_path(name: str) -> Path:
    """Path of a shipped kernel source or header, e.g. ``source_path("paged_attention.cu")``."""
    path = KERNEL_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"pagedkv kernel source {name!r} is missing from {KERNEL_DIR}")
    return path


def build_cache_dir(kind: str) -> Path:
    """Where compiled kernels of one kind (``"emulated"`` libraries, ``"cubin"`` images) are
    cached: ``$PAGEDKV_CACHE_DIR/<kind>``, else ``<user cache dir>/pagedkv/<kind>``."""
    explicit = os.environ.get("PAGEDKV_CACHE_DIR")
    if explicit:
        return Path(explicit) / kind
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedkv" / kind
