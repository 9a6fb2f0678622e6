"""The test command's skip policy (tests/conftest.py): an unexpected skip fails the run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

SKIPPING_TESTS = """
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason=REASON)
def test_skipped():
    pass
"""


def _run(tmp_path: Path, reason: str, env: dict[str, str] | None = None) -> int:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SKIPPING_TESTS.replace("REASON", repr(reason)))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
        capture_output=True,
        check=False,
    ).returncode


@pytest.mark.parametrize(
    ("reason", "env", "exit_code"),
    [
        ("redis-server is not installed", None, 1),  # a missing install step fails the run
        ("no CUDA GPU", None, 0),  # allowed: ALLOWED_SKIPS says why
        ("no CUDA GPU", {"PAGEDKV_NO_SKIPS": "1"}, 1),  # the vLLM stage allows none
        ("redis-server is not installed", {"PAGEDKV_ALLOW_SKIPS": "1"}, 0),  # partial dev install
    ],
)
def test_unexpected_skips_fail_the_run(
    tmp_path: Path, reason: str, env: dict[str, str] | None, exit_code: int
):
    assert _run(tmp_path, reason, env) == exit_code
