"""The documentation: every relative link in README.md and docs/ resolves (file and heading), the
code cites only pages inside the repository, and the mkdocs site with its generated API reference
builds without a warning (when the `docs` extra is installed; scripts/test.sh installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

pytestmark = pytest.mark.skipif(not DOCS.is_dir(), reason="needs a checkout (docs/ is not installed)")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)


def pages() -> list[Path]:
    return [REPO / "README.md", REPO / "benches" / "README.md", *sorted(DOCS.rglob("*.md"))]


def slug(heading: str) -> str:
    """The anchor GitHub and mkdocs' toc give a heading: lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in pages():
        text = FENCE.sub("", page.read_text(encoding="utf-8"))
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_docs_index_lists_every_page() -> None:
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    listed = {Path(t.partition("#")[0]).name for t in LINK.findall(index)}
    missing = [p.name for p in DOCS.glob("*.md") if p.name != "index.md" and p.name not in listed]
    assert not missing, f"docs/index.md does not list {missing}"


def test_code_cites_only_documents_inside_the_repository() -> None:
    """Code, tests and docs cite docs/ pages by section, never a design document outside the
    repository or an issue number; the docs never send a reader to a folder outside it."""
    offenders = []
    roots = ["python", "rust", "tests", "benches", "docs", "scripts", "README.md"]
    for root in roots:
        base = REPO / root
        files = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file()]
        for path in files:
            if path.suffix not in {".py", ".pyi", ".rs", ".md", ".sh", ".cu", ".h", ".toml"}:
                continue
            if path == Path(__file__).resolve() or "target" in path.parts:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            patterns = [(r"DESIGN\.md", 0), (r"\bissue \d+", re.I)]
            if path.suffix == ".md":  # (code may look for a trace folder there; docs must not send readers)
                patterns.append((r"\.\./shared/", 0))
            for pattern, flags in patterns:
                for match in re.finditer(pattern, text, flags=flags):
                    line = text.count("\n", 0, match.start()) + 1
                    offenders.append(f"{path.relative_to(REPO)}:{line}: {match.group(0)}")
    assert not offenders, "\n".join(offenders)


def test_design_doc_has_the_sections_the_code_cites() -> None:
    """Every "docs/design.md, <Section>" in the code names a heading of docs/design.md."""
    headings = {slug(h) for h in headings_of(DOCS / "design.md")}
    titles = headings_of(DOCS / "design.md")
    cited, missing = 0, []
    for path in [*REPO.joinpath("rust").rglob("*.rs"), *REPO.joinpath("python").rglob("*.py")]:
        if "target" in path.parts:
            continue
        # Comment markers and line breaks removed, so a citation wrapped over two lines reads whole.
        text = re.sub(r"\s*\n\s*(?:///?!?|#)?\s*", " ", path.read_text(encoding="utf-8"))
        for match in re.finditer(r"docs/design\.md, ([^.;:)]{1,60})", text):
            cited += 1
            after = match.group(1)
            if not any(after.startswith(title) and slug(title) in headings for title in titles):
                missing.append(f"{path.relative_to(REPO)}: {after!r}")
    assert cited and not missing, "docs/design.md lacks sections cited by the code:\n" + "\n".join(missing)


def headings_of(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)]


@pytest.mark.skipif(shutil.which("mkdocs") is None, reason="mkdocs not installed (pip install '.[docs]')")
def test_site_and_api_reference_build(tmp_path: Path) -> None:
    pytest.importorskip("mkdocstrings_handlers.python")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    manager = (tmp_path / "api" / "manager" / "index.html").read_text(encoding="utf-8")
    for name in ("add_sequence", "append_tokens_batch", "slot_mapping", "take_copy_ops", "swap_out"):
        assert f'id="pagedkv._core.KvCacheManager.{name}"' in manager, name
    attention = (tmp_path / "api" / "attention" / "index.html").read_text(encoding="utf-8")
    assert 'id="pagedkv.attention.paged_attention"' in attention
