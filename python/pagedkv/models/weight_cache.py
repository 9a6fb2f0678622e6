"""An on-disk cache of dequantized fp32 weights, so that a GGUF file is dequantized once.

Dequantizing SmolLM2-135M's Q4_1 tensors takes tens of seconds of NumPy on a busy CPU; the cache
stores each fp32 array as ``.npy`` and memory-maps it back on later loads.

- **Keyed by content**: the entry's folder is named after the SHA-256 of the whole GGUF file
  (0.2 s for the 100 MB SmolLM2 file, against minutes of dequantizing), so two different files
  with the same name, size and modification time can never serve each other's weights. A hash
  of the header and tensor index alone would not do: two files may differ only in tensor data.
- **Checked on every load**: ``index.json`` records each array's name, shape and CRC-32; an
  entry whose index, shapes or bytes do not match is rebuilt (replaced) by the load that found
  it, instead of being skipped on every load after.
- **Never half-written**: an entry is written in a temporary folder and renamed into place; the
  temporary folder is removed on any interruption (``KeyboardInterrupt`` included), and folders
  left by a killed process (its pid no longer alive) are removed by the next store.
- **Where**: ``$PAGEDKV_CACHE_DIR/models`` when that variable is set and not empty, else
  ``$XDG_CACHE_HOME/pagedkv/models`` (default ``~/.cache/pagedkv/models``), the layout of the
  kernel caches. ``PAGEDKV_CACHE_DIR=off`` disables it; an empty value means unset (never the
  working directory). A cache that cannot be written is skipped (the load still succeeds).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np

__all__ = ["cache_entry_for", "cache_root", "content_key", "load_cached", "store_cached"]

_FORMAT = 4
_TMP_PREFIX = ".tmp-"


def cache_root() -> Path | None:
    """The folder that holds the model weight caches; None when disabled."""
    explicit = os.environ.get("PAGEDKV_CACHE_DIR", "")
    if explicit == "off":
        return None
    if explicit:
        return Path(explicit).absolute() / "models"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).absolute() / "pagedkv" / "models"


def content_key(path: Path) -> str:
    """SHA-256 of the file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:  # hashlib.file_digest is Python 3.11+
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_entry_for(path: Path) -> Path | None:
    """The cache folder of this file's content (None when the cache is disabled)."""
    try:
        root = cache_root()
        return None if root is None else root / f"{content_key(path)}-v{_FORMAT}"
    except (OSError, RuntimeError):  # no home directory, an unreadable file: load without a cache
        return None


def _checksum(array: np.ndarray) -> int:
    """CRC-32 of the array's bytes: 0.3 s for SmolLM2's 515 MB of fp32 against 1.5 s for SHA-256.
    It guards against corruption (a flipped or truncated file); a writer who can change the cache
    folder can change its index too, so a cryptographic hash stored beside it would add nothing."""
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)


def load_cached(folder: Path | None, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    """The fp32 arrays of a complete, intact entry holding exactly ``shapes``; None otherwise."""
    if folder is None or not (folder / "index.json").is_file():
        return None
    try:
        index = json.loads((folder / "index.json").read_text())
        if index.get("format") != _FORMAT or [a["name"] for a in index["arrays"]] != list(shapes):
            return None
        arrays: dict[str, np.ndarray] = {}
        for i, entry in enumerate(index["arrays"]):
            array = np.load(folder / f"{i}.npy", mmap_mode="r", allow_pickle=False)
            if array.dtype != np.float32 or array.shape != shapes[entry["name"]]:
                return None
            if _checksum(array) != entry["crc32"]:
                return None
            arrays[entry["name"]] = np.asarray(array)
        return arrays
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def store_cached(folder: Path | None, arrays: dict[str, np.ndarray]) -> None:
    """Write (or replace) the entry; any failure leaves no temporary folder behind."""
    if folder is None:
        return
    tmp: Path | None = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(folder.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=folder.parent))
        index = []
        for i, (name, array) in enumerate(arrays.items()):
            np.save(tmp / f"{i}.npy", array, allow_pickle=False)
            index.append({"name": name, "shape": list(array.shape), "crc32": _checksum(array)})
        (tmp / "index.json").write_text(json.dumps({"format": _FORMAT, "arrays": index}))
        if folder.exists():  # a damaged entry: move it aside (atomic), then delete it
            stale = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=folder.parent))
            os.replace(folder, stale / "entry")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, folder)  # atomic: a reader sees a complete folder or none
        tmp = None
    except (OSError, TypeError, ValueError):
        pass  # the cache is an optimization: the load goes on without it
    finally:  # also on KeyboardInterrupt / SystemExit: never leave a half-written folder
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_abandoned(root: Path) -> None:
    """Temporary folders of processes that died while writing (killed, not interrupted)."""
    for child in root.glob(f"{_TMP_PREFIX}*"):
        pid = child.name[len(_TMP_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(child, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
