"""CUDA kernel sources (``*.cu``), their CPU emulation header and the loaders that build them.

The ``.cu`` files are compiled for the GPU by NVRTC (through CuPy's ``RawModule``) and for the CPU
by g++ with ``cuda_emu.h`` (``backend="emulated"``); ``instances`` lists every template instance.
"""

from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
"""Directory holding the kernel sources and headers (shipped in the wheel)."""


def source_path(name: str) -> Path:
    """Path of a shipped kernel source or header, e.g. ``source_path("paged_attention.cu")``."""
    path = KERNEL_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"pagedkv kernel source {name!r} is missing from {KERNEL_DIR}")
    return path
