"""The persistent cubin cache: a second process (or a second lookup) compiles nothing, and every
input that changes the binary changes the key. Needs libnvrtc (pip nvidia-cuda-nvrtc), no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pagedkv.kernels import cubin_cache, instances, nvrtc

try:
    nvrtc.load()
    NVRTC = True
except nvrtc.NvrtcUnavailable:
    NVRTC = False

pytestmark = pytest.mark.skipif(not NVRTC, reason="libnvrtc not installed (pip install nvidia-cuda-nvrtc)")

INSTANCE = instances.merge("float16", 64)  # the smallest kernel: a fast compile

LOOKUP = f"""
import json
from pagedkv.kernels import cubin_cache
entry = cubin_cache.cached_cubin({INSTANCE.source!r}, [{INSTANCE.name!r}], "sm_90")
print(json.dumps({{"compilations": cubin_cache.compilations, "path": str(entry.path),
                   "symbol": entry.lowered_names[{INSTANCE.name!r}]}}))
"""


def _lookup_in_new_process(cache: str) -> dict:
    env = {**os.environ, "PAGEDKV_CACHE_DIR": cache}
    run = subprocess.run([sys.executable, "-c", LOOKUP], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing(tmp_path):
    first = _lookup_in_new_process(str(tmp_path))
    second = _lookup_in_new_process(str(tmp_path))
    assert first["compilations"] == 1 and second["compilations"] == 0
    assert first["path"] == second["path"] and first["symbol"] == second["symbol"]
    data = open(first["path"], "rb").read()
    assert data[:4] == b"\x7fELF"  # a cubin is an ELF image


def test_key_covers_arch_names_and_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    key = cubin_cache.cache_key(INSTANCE.source, [INSTANCE.name], "sm_90")
    assert key == cubin_cache.cache_key(INSTANCE.source, [INSTANCE.name], "sm_90")
    assert key != cubin_cache.cache_key(INSTANCE.source, [INSTANCE.name], "sm_80")
    other = instances.merge("float16", 128)
    assert key != cubin_cache.cache_key(other.source, [other.name], "sm_90")
    assert key != cubin_cache.cache_key(instances.CACHE_OPS_SOURCE, [INSTANCE.name], "sm_90")


def test_damaged_entry_is_recompiled(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    before = cubin_cache.compilations
    entry = cubin_cache.cached_cubin(INSTANCE.source, [INSTANCE.name])
    assert cubin_cache.compilations == before + 1
    symbol = entry.lowered_names[INSTANCE.name]
    assert entry.resources[symbol].registers > 0  # ptxas's report travels with the cubin
    assert cubin_cache.cached_cubin(INSTANCE.source, [INSTANCE.name]).path == entry.path
    assert cubin_cache.compilations == before + 1
    entry.path.write_bytes(b"truncated")  # size no longer matches the metadata
    cubin_cache.cached_cubin(INSTANCE.source, [INSTANCE.name])
    assert cubin_cache.compilations == before + 2
    meta = entry.path.with_suffix(".json")
    meta.write_text("{not json")
    cubin_cache.cached_cubin(INSTANCE.source, [INSTANCE.name])
    assert cubin_cache.compilations == before + 3
    assert json.loads(meta.read_text())["arch"] == "sm_90"


def test_cuda_runner_loads_kernels_from_the_cache(tmp_path, monkeypatch):
    """The real CudaRunner (on the CuPy stand-in): a second runner finds the cubin on disk, and a
    cubin the driver refuses falls back to CuPy's own compile."""
    from pagedkv.attention.runners import CudaRunner

    from . import fake_cupy

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    fake_cupy.FakeRawModule.made.clear()
    before = cubin_cache.compilations
    fn = CudaRunner(fake_cupy.make_module()).function(INSTANCE)
    assert cubin_cache.compilations == before + 1
    assert fn.kwargs["path"].endswith(".cubin") and fn.symbol.startswith("_Z")
    again = CudaRunner(fake_cupy.make_module())
    assert again.function(INSTANCE).kwargs["path"] == fn.kwargs["path"]
    assert cubin_cache.compilations == before + 1 and again.fallback_reason == ""
    # A refused image (here: not an ELF file of the recorded size... size kept, content broken).
    path = fn.kwargs["path"]
    size = len(open(path, "rb").read())
    open(path, "wb").write(b"\0" * size)
    third = CudaRunner(fake_cupy.make_module())
    fallback = third.function(INSTANCE)
    assert "refused" in third.fallback_reason
    assert fallback.kwargs["name_expressions"] == [INSTANCE.name] and "code" in fallback.kwargs
