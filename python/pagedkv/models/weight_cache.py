"""An on-disk cache of dequantized fp32 weights, so that a GGUF file is dequantized once.

Dequantizing SmolLM2-135M's Q4_1 tensors takes tens of seconds of NumPy on a busy CPU; the cache
stores each fp32 array as ``.npy`` under ``$PAGEDKV_CACHE_DIR`` (default
``~/.cache/pagedkv/models``), in a folder named after the file's name, size and modification time,
and memory-maps it back. ``PAGEDKV_CACHE_DIR=off`` disables it. A cache that cannot be written is
skipped silently (the load still succeeds).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["cache_dir_for", "load_cached", "store_cached"]

_FORMAT = 3


def cache_dir_for(path: Path) -> Path | None:
    root = os.environ.get("PAGEDKV_CACHE_DIR", str(Path.home() / ".cache" / "pagedkv" / "models"))
    if root == "off":
        return None
    st = path.stat()
    return Path(root) / f"{path.name}-{st.st_size}-{st.st_mtime_ns}-v{_FORMAT}"


def load_cached(
    folder: Path | None,
) -> tuple[dict[str, Any], dict[str, str], dict[str, np.ndarray]] | None:
    """(metadata, tensor types, fp32 arrays) from a complete cache folder, else None."""
    if folder is None or not (folder / "index.json").is_file():
        return None
    try:
        index = json.loads((folder / "index.json").read_text())
        arrays = {
            name: np.asarray(np.load(folder / f"{i}.npy", mmap_mode="r"))
            for i, name in enumerate(index["arrays"])
        }
        return index["metadata"], index["tensor_types"], arrays
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_cached(
    folder: Path | None, metadata: dict[str, Any], tensor_types: dict[str, str], arrays: dict[str, np.ndarray]
) -> None:
    if folder is None:
        return
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent))
        names = list(arrays)
        for i, name in enumerate(names):
            np.save(tmp / f"{i}.npy", arrays[name])
        index = {"arrays": names, "metadata": _plain(metadata), "tensor_types": tensor_types}
        (tmp / "index.json").write_text(json.dumps(index))
        os.replace(tmp, folder)  # atomic: a reader sees a complete folder or none
    except (OSError, TypeError, ValueError):
        if "tmp" in locals():
            shutil.rmtree(tmp, ignore_errors=True)


def _plain(value: Any) -> Any:
    """Metadata as JSON values (NumPy scalars and arrays to Python numbers and lists)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
