"""The README's Python quick start runs as written (its code blocks, in order)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def section_blocks(heading: str) -> list[str]:
    if not README.exists():
        return []
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## )", text, flags=re.M | re.S)
    if match is None:
        return []
    return re.findall(r"```python\n(.*?)```", match.group(1), flags=re.S)


def quick_start_blocks() -> list[str]:
    return section_blocks("Python quick start")


def test_python_quick_start_runs(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = quick_start_blocks()
    if not blocks:
        pytest.skip("README has no Python quick start section")
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert capsys.readouterr().out


def test_attention_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = section_blocks("Attention kernels")
    if not blocks:
        pytest.skip("README has no attention example")
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert "(2, 8, 64)" in capsys.readouterr().out
