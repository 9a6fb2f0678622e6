"""ThreadSanitizer over the real kernels in the emulation harness (standalone C++ driver)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from pagedkv.kernels import KERNEL_DIR

HERE = Path(__file__).resolve().parent


def _tsan_works(tmp: Path) -> bool:
    probe = tmp / "probe.cpp"
    probe.write_text("int main() { return 0; }\n")
    r = subprocess.run(
        ["g++", "-fsanitize=thread", str(probe), "-o", str(tmp / "probe")], capture_output=True
    )
    return r.returncode == 0 and subprocess.run([str(tmp / "probe")], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_kernels_are_race_free_under_tsan(tmp_path):
    if not _tsan_works(tmp_path):
        pytest.skip("g++ -fsanitize=thread unavailable here (libtsan missing)")
    exe = tmp_path / "tsan_driver"
    build = subprocess.run(
        [
            "g++",
            "-std=c++20",
            "-O1",
            "-g",
            "-fsanitize=thread",
            "-pthread",
            "-Wno-unknown-pragmas",
            f"-I{KERNEL_DIR}",
            str(HERE / "tsan_driver.cpp"),
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1")
    run = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=600)
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-6000:]
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "tsan driver ok" in run.stdout
