"""The installed package (CI runs the tests against the wheel) ships what it needs at run time:
the kernel sources the cuda and emulated backends compile, the visualizer's assets, the typing
files, and a working command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pagedkv
from pagedkv.kernels import KERNEL_DIR, instances

PACKAGE_DIR = Path(pagedkv.__file__).parent


def test_kernel_sources_ship() -> None:
    needed = {instances.ATTENTION_SOURCE, instances.CACHE_OPS_SOURCE, "cuda_emu.h", "kv_types.h"}
    assert needed <= {path.name for path in KERNEL_DIR.iterdir()}
    for name in needed:
        assert (KERNEL_DIR / name).stat().st_size > 0


def test_viz_assets_and_typing_files_ship() -> None:
    for relative in ("viz/template.html", "viz/viz.css", "viz/viz.js", "py.typed", "_core.pyi"):
        assert (PACKAGE_DIR / relative).is_file(), relative


def test_version_everywhere() -> None:
    from pagedkv import _core

    assert pagedkv.__version__ == _core.__version__
    result = subprocess.run(
        [sys.executable, "-m", "pagedkv", "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert result.stdout.strip() == f"pagedkv {pagedkv.__version__}"


def test_stub_exports_match_the_module() -> None:
    """_core.pyi's __all__ lists every public name of the extension (stubtest without
    --ignore-missing-stub checks this too, when mypy is installed)."""
    from pagedkv import _core

    stub = (PACKAGE_DIR / "_core.pyi").read_text()
    public = {name for name in dir(_core) if not name.startswith("_")} | {"__version__"}
    for name in public:
        assert f'"{name}"' in stub.split("__all__", 1)[1].split("]", 1)[0], name
