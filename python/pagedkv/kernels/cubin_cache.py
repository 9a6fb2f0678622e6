"""A persistent on-disk cache of NVRTC-compiled kernels (cubins), so a new process compiles nothing.

Why not CuPy's cache: ``RawModule(code=..., name_expressions=...)`` skips CuPy's on-disk cache
(CuPy fixed this only on its main branch), so every process recompiled every instance, 0.2-1.7 s
each. Here each instance is compiled once by NVRTC (``nvrtc.compile_source``) to a cubin for the
device's architecture and stored under a key covering everything that changes the binary: the
source, every kernel header, the NVRTC options, the architecture, the NVRTC version and the name
expressions. The cubin is loaded with ``cupy.RawModule(path=...)`` and the kernel found by its
mangled name, stored next to it with ptxas's resource report (registers, spills, shared memory),
which the split planner's occupancy estimate reads without a device query.

Files are published atomically (write to a temporary file, then rename), the metadata last, so a
reader never sees half an entry and concurrent writers of one key each publish a whole one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedkv.kernels import KERNEL_DIR, build_cache_dir, nvrtc

compilations = 0  # NVRTC compiles this process ran (a warm cache keeps it at 0)


def cache_dir() -> Path:
    """$PAGEDKV_CACHE_DIR/cubin, else the user cache dir (the emulation builds' sibling)."""
    return build_cache_dir("cubin")


@dataclass(frozen=True)
class CachedCubin:
    path: Path  # the cubin file
    lowered_names: dict[str, str]  # name expression -> mangled kernel symbol
    resources: dict[str, nvrtc.KernelResources]  # mangled symbol -> ptxas report


def cache_key(source: str, name_expressions: Sequence[str], arch: str) -> str:
    digest = hashlib.sha256()
    digest.update((KERNEL_DIR / source).read_bytes())
    for header in sorted(KERNEL_DIR.glob("*.h")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    # The include path is where the headers are, hashed above: keep the key independent of it.
    options = [o if not o.startswith("-I") else "-I<kernels>" for o in nvrtc.compile_options(arch)]
    major, minor = nvrtc.version()
    for part in (source, arch, f"nvrtc {major}.{minor}", *options, "\0", *name_expressions):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:32]


def _publish(target: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read(meta_path: Path, cubin_path: Path, name_expressions: Sequence[str]) -> CachedCubin | None:
    try:
        meta = json.loads(meta_path.read_text())
        lowered = {str(k): str(v) for k, v in meta["lowered_names"].items()}
        resources = {str(k): nvrtc.KernelResources(**v) for k, v in meta["resources"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged: compile again and overwrite
    if not cubin_path.is_file() or cubin_path.stat().st_size != meta.get("cubin_bytes"):
        return None
    if any(name not in lowered for name in name_expressions):
        return None
    return CachedCubin(cubin_path, lowered, resources)


def cached_cubin(source: str, name_expressions: Sequence[str], arch: str = nvrtc.DEFAULT_ARCH) -> CachedCubin:
    """The cubin of these instances of ``source`` for ``arch``: from disk, or compiled and stored.
    Raises nvrtc.NvrtcUnavailable without libnvrtc, nvrtc.NvrtcCompileError on a compile error."""
    global compilations
    key = cache_key(source, name_expressions, arch)
    directory = cache_dir()
    cubin_path, meta_path = directory / f"{key}.cubin", directory / f"{key}.json"
    hit = _read(meta_path, cubin_path, name_expressions)
    if hit is not None:
        return hit
    result = nvrtc.compile_source(source, name_expressions, arch)
    compilations += 1
    directory.mkdir(parents=True, exist_ok=True)
    _publish(cubin_path, result.cubin)
    meta = {
        "source": source,
        "arch": arch,
        "cubin_bytes": len(result.cubin),
        "lowered_names": result.lowered_names,
        "resources": {k: vars(v) for k, v in result.resources.items()},
    }
    _publish(meta_path, json.dumps(meta, indent=1).encode())
    return CachedCubin(cubin_path, dict(result.lowered_names), dict(result.resources))
