"""The hand-written `_core.pyi` matches the compiled module (mypy.stubtest)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def test_stubtest_core() -> None:
    pytest.importorskip("mypy")
    import pagedkv

    package_dir = Path(pagedkv.__file__).parent
    assert (package_dir / "py.typed").exists()
    assert (package_dir / "_core.pyi").exists()
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "pagedkv._core"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
