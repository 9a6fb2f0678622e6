"""The README's Python quick start and attention example run as written (their code blocks, in
order) and do what their comments say. A renamed or removed section fails: these are the first
code a user copies."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def section_blocks(heading: str) -> list[str]:
    """The ```python blocks of the README's ``## heading`` section (its ### subsections included)."""
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match is not None, f"README.md has no '## {heading}' section (renamed? update this test)"
    blocks = re.findall(r"```python\n(.*?)```", match.group(1), flags=re.S)
    assert blocks, f"README.md's '## {heading}' section has no python code block"
    return blocks


def run_blocks(blocks: list[str]) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
    return namespace


def test_section_lookup_fails_on_a_missing_heading() -> None:
    with pytest.raises(AssertionError, match="no '## Python quick starts' section"):
        section_blocks("Python quick starts")


def test_python_quick_start_runs(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = section_blocks("Python quick start")
    assert len(blocks) >= 2  # the quick start and "More of the Python API"
    quick = run_blocks(blocks[:1])
    first = capsys.readouterr().out
    # 1,000 tokens + 1 appended to each of 4 sequences sharing a partial last block: 3 copies.
    kv = quick["kv"]
    assert kv.num_sequences == 4 and all(kv.num_tokens(s) == 1001 for s in range(4))
    assert re.match(r"\[\[\s*\d+\s+\d+\]\n \[\s*\d+\s+\d+\]\n \[\s*\d+\s+\d+\]\]", first), first
    more = run_blocks(blocks[1:])
    printed = capsys.readouterr().out.splitlines()
    assert more["kv"].num_sequences == 1  # the swap example's manager, its sequence back on device
    assert more["to_host"].shape == more["to_device"].shape == (7, 2)  # 100 tokens: 7 blocks
    tables, seq_lens = more["tables"], more["seq_lens"]
    assert tables.shape[0] == 2 and seq_lens.tolist() == [301, 301]
    assert more["slots"].shape == (2,)
    # prefix_hit_tokens (288) and an event; then the two refusals' messages.
    assert printed[0].startswith("288 [BlockStored(") and len(printed) == 3, printed


def test_attention_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    namespace = run_blocks(section_blocks("Attention kernels"))
    assert "(2, 8, 64)" in capsys.readouterr().out
    assert namespace["out"].shape == (2, 8, 64) and np.isfinite(namespace["out"]).all()
    assert namespace["out2"].shape == (25, 8, 64) and np.isfinite(namespace["out2"]).all()
