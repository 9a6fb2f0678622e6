"""The page is one self-contained HTML file: no external resource, data embedded safely."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest

from viz_frames_fixture import fixture_data
from pagedkv.errors import InvalidArgumentError
from pagedkv.viz.page import render_page, write_page

URL_ATTRIBUTES = {"src", "href", "action", "formaction", "poster", "data", "srcset", "background"}


class ResourceScan(HTMLParser):
    def __init__(self):
        super().__init__()
        self.external: list[tuple[str, str, str]] = []
        self.scripts: list[dict] = []
        self.ids: list[str] = []
        self._in_json = False
        self.json_text = ""

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.append(attrs["id"])
        if tag == "script":
            self.scripts.append(attrs)
            self._in_json = attrs.get("type") == "application/json"
        if tag == "link":
            self.external.append((tag, "link", str(attrs)))
        for name, value in attrs.items():
            if name in URL_ATTRIBUTES and value and not value.startswith("#"):
                self.external.append((tag, name, value))

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_json = False

    def handle_data(self, data):
        if self._in_json:
            self.json_text += data


@pytest.fixture(scope="module")
def page():
    return render_page(fixture_data())


def test_page_is_self_contained(page):
    scan = ResourceScan()
    scan.feed(page)
    assert scan.external == []
    assert all("src" not in attrs for attrs in scan.scripts)
    # No fetch of anything at run time either, and no remote URL anywhere in code or styles.
    assert not re.search(r"https?://", page)
    assert not re.search(r"\b(fetch|XMLHttpRequest|import\s*\(|@import|WebSocket)\b", page)
    assert len(scan.ids) == len(set(scan.ids)), "duplicate element ids"


def test_embedded_data_parses_back(page):
    scan = ResourceScan()
    scan.feed(page)
    data = json.loads(scan.json_text)
    assert data["format_version"] == 1
    assert data["runs"] == json.loads(json.dumps(fixture_data()["runs"]))


def test_hostile_strings_cannot_break_out_of_the_script():
    data = fixture_data(block_sizes=(4,), allocators=("paged",), seeds=(0,))
    data["workload"]["name"] = "</script><script>alert(1)</script>{{VIZ_JS}}&"
    page = render_page(data, title="<b>t</b>")
    assert page.count("</script>") == 2  # the JSON block's and the code block's own
    assert "<b>t</b>" not in page
    scan = ResourceScan()
    scan.feed(page)
    assert json.loads(scan.json_text)["workload"]["name"] == data["workload"]["name"]


def test_controls_and_counters_are_labelled(page):
    for control in ("sel-allocator", "sel-block-size", "sel-seed", "sel-speed", "rng-step"):
        assert re.search(rf'<label for="{control}"', page), control
        assert re.search(rf'id="{control}"[^>]*aria-label="[^"]+"', page), control
    for button in ("btn-reset", "btn-back", "btn-play", "btn-step"):
        assert re.search(rf'id="{button}"[^>]*aria-label="[^"]+"', page), button
    for counter in ("c-step", "c-running", "c-finished", "c-blocks", "c-waste", "c-preemptions"):
        assert f'id="{counter}"' in page
    assert 'name="viewport"' in page and "@media (max-width:" in page
    assert 'class="legend"' in page


def test_write_page_and_errors(tmp_path):
    out = write_page(fixture_data(block_sizes=(2,), seeds=(0,)), tmp_path / "sub" / "v.html")
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    with pytest.raises(InvalidArgumentError, match="at least one recorded run"):
        render_page({"runs": []})
    with pytest.raises(InvalidArgumentError, match="lacks"):
        render_page({"runs": [{"allocator": "paged"}]})
