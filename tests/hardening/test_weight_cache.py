"""The on-disk weight cache (pagedkv.models.weight_cache): keyed by content, repaired when
damaged, never left half-written, never written into the working directory."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from tiny_gguf import write_tiny_llama

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from pagedkv.models import load_model, weight_cache  # noqa: E402
from pagedkv.models.llama import file as gguf_file  # noqa: E402
from pagedkv.models.llama.file import read_gguf  # noqa: E402


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(root))
    return root / "models"


def entries(root):
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def twin_files(tmp_path):
    """Two files with the same name, size and modification time and different weights."""
    paths = []
    for i, scale in enumerate((1.0, -1.0)):
        norm = np.full(32, scale, np.float32)
        folder = tmp_path / f"dir{i}"
        folder.mkdir()
        paths.append(write_tiny_llama(folder / "model.gguf", tensors={"output_norm.weight": (norm, "F32")}))
    assert paths[0].stat().st_size == paths[1].stat().st_size
    stamp = paths[0].stat().st_mtime_ns
    for path in paths:
        os.utime(path, ns=(stamp, stamp))
    return paths


def test_same_name_size_and_mtime_do_not_share_weights(tmp_path, cache_dir):
    first, second = twin_files(tmp_path)
    assert read_gguf(first).output_norm[0] == 1.0
    assert read_gguf(second).output_norm[0] == -1.0  # the old (name, size, mtime) key served 1.0
    assert len(entries(cache_dir)) == 2


def test_damaged_entry_is_detected_and_repaired(tmp_path, cache_dir, monkeypatch):
    path = write_tiny_llama(tmp_path / "m.gguf")
    expected = read_gguf(path, use_cache=False).token_embedding.copy()
    read_gguf(path)
    (entry,) = [cache_dir / name for name in entries(cache_dir)]
    index = json.loads((entry / "index.json").read_text())
    slot = [a["name"] for a in index["arrays"]].index("token_embd.weight")
    npy = entry / f"{slot}.npy"
    raw = bytearray(npy.read_bytes())
    raw[-5] ^= 0x40  # one flipped bit in the data, the size unchanged
    npy.write_bytes(bytes(raw))
    np.testing.assert_array_equal(read_gguf(path).token_embedding, expected)  # not the damaged copy
    # The load that found the damage rewrote the entry: the next one reads it without dequantizing.
    monkeypatch.setattr(
        gguf_file, "dequantize", lambda *a: pytest.fail("dequantized despite a repaired cache")
    )
    np.testing.assert_array_equal(read_gguf(path).token_embedding, expected)


def test_damaged_index_is_repaired(tmp_path, cache_dir, monkeypatch):
    path = write_tiny_llama(tmp_path / "m.gguf")
    read_gguf(path)
    (entry,) = [cache_dir / name for name in entries(cache_dir)]
    (entry / "index.json").write_text("{not json")
    read_gguf(path)
    monkeypatch.setattr(
        gguf_file, "dequantize", lambda *a: pytest.fail("dequantized despite a repaired cache")
    )
    read_gguf(path)


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, SystemExit, OSError])
def test_interrupted_store_leaves_nothing_behind(tmp_path, cache_dir, monkeypatch, interruption):
    path = write_tiny_llama(tmp_path / "m.gguf")
    saved = []
    real_save = np.save

    def save_then_interrupt(file, array, **kwargs):
        if len(saved) == 3:
            raise interruption()
        saved.append(file)
        real_save(file, array, **kwargs)

    monkeypatch.setattr(weight_cache.np, "save", save_then_interrupt)
    if interruption is OSError:  # a failed write: the load goes on without the cache
        read_gguf(path)
    else:
        with pytest.raises(interruption):
            read_gguf(path)
    assert len(saved) == 3
    leftovers = [p for p in cache_dir.parent.rglob("*") if p.is_file()]
    assert leftovers == []  # the old code left the temporary folder (up to 516 MB)


def test_abandoned_temporary_folders_are_removed(tmp_path, cache_dir):
    cache_dir.mkdir(parents=True)
    dead = cache_dir / ".tmp-999999999-abc"  # no such pid
    dead.mkdir()
    (dead / "0.npy").write_bytes(b"x" * 100)
    read_gguf(write_tiny_llama(tmp_path / "m.gguf"))
    assert not dead.exists()
    assert len(entries(cache_dir)) == 1


def test_empty_cache_dir_does_not_write_into_the_working_directory(tmp_path, monkeypatch):
    work, home = tmp_path / "work", tmp_path / "xdg"
    work.mkdir()
    path = write_tiny_llama(tmp_path / "m.gguf")
    monkeypatch.chdir(work)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    load_model(path)
    assert list(work.iterdir()) == []  # the old code wrote "m.gguf-<size>-<mtime>-v3" here
    assert len(entries(home / "pagedkv" / "models")) == 1


def test_cache_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    read_gguf(write_tiny_llama(tmp_path / "m.gguf"))
    assert not (tmp_path / "xdg").exists()


def test_cached_load_equals_fresh_load(tmp_path, cache_dir):
    path = write_tiny_llama(tmp_path / "m.gguf")
    fresh = read_gguf(path, use_cache=False)
    read_gguf(path)
    cached = read_gguf(path)
    for a, b in ((fresh.token_embedding, cached.token_embedding), (fresh.output_norm, cached.output_norm)):
        np.testing.assert_array_equal(a, b)
    for la, lb in zip(fresh.layers, cached.layers, strict=True):
        for field in ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"):
            np.testing.assert_array_equal(getattr(la, field), getattr(lb, field))


def test_no_home_directory_loads_without_a_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDKV_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(weight_cache.Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("no home")))
    assert read_gguf(write_tiny_llama(tmp_path / "m.gguf")).config.num_layers == 1
