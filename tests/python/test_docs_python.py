"""The guides under docs/ run as written: every ```python block of a page, in order, in one
namespace, so a guide cannot drift from the library. (Blocks that need a GPU or another
framework are fenced as ```text.) A page joins by adding its name to PAGES."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"

# Pages whose python blocks form one runnable program.
PAGES = ["embedding.md", "quantized_kv.md"]


def python_blocks(page: str) -> list[str]:
    """The page's python blocks, each padded with blank lines so that a traceback's line numbers
    are the page's."""
    text = (DOCS / page).read_text(encoding="utf-8")
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.M | re.S):
        first_line = text.count("\n", 0, match.start(1))
        blocks.append("\n" * first_line + match.group(1))
    return blocks


@pytest.mark.parametrize("page", PAGES)
def test_page_runs(page: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = DOCS / page
    if not path.exists():
        pytest.skip(f"{path} is not in this checkout (installed package only)")
    blocks = python_blocks(page)
    assert blocks, f"{page} has no python blocks"
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for block in blocks:
        exec(compile(block, str(path), "exec"), namespace)  # noqa: S102 - our own docs
    capsys.readouterr()


def test_embedding_guide_exercises_every_path() -> None:
    """The guide's own asserts already fail the run above if a path is skipped; this checks the
    guide still contains the steps the page promises, in the per-step loop's order."""
    text = (DOCS / "embedding.md").read_text(encoding="utf-8")
    code = "\n".join(python_blocks("embedding.md"))
    order = ["append_tokens_batch", "take_copy_ops", "slot_mapping(seq_ids, 1)", "paged_attention"]
    decode = code[code.index("def decode(") :]
    positions = [decode.index(name) for name in order]
    assert positions == sorted(positions), order
    for name in ("OutOfBlocksError", "swap_out", "swap_in", "free_batch", "fork", "from_dlpack"):
        assert name in code, name
    assert "paged_prefill_attention" in text
