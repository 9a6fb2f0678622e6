"""The page is one self-contained HTML file: no external resource, data embedded safely."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest
from pagedkv.errors import InvalidArgumentError
from pagedkv.viz.page import read_page_data, render_page, write_page
from viz_frames_fixture import fixture_data

URL_ATTRIBUTES = {"src", "href", "action", "formaction", "poster", "data", "srcset", "background"}


class ResourceScan(HTMLParser):
    def __init__(self):
        super().__init__()
        self.external: list[tuple[str, str, str]] = []
        self.scripts: list[dict] = []
        self.ids: list[str] = []
        self._in_data = False
        self.data_text = ""
        self.data_attrs: dict = {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.append(attrs["id"])
        if tag == "script":
            self.scripts.append(attrs)
            self._in_data = attrs.get("id") == "viz-data"
            if self._in_data:
                self.data_attrs = attrs
        if tag == "link":
            self.external.append((tag, "link", str(attrs)))
        for name, value in attrs.items():
            if name in URL_ATTRIBUTES and value and not value.startswith("#"):
                self.external.append((tag, name, value))

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_data = False

    def handle_data(self, data):
        if self._in_data:
            self.data_text += data


@pytest.fixture(scope="module", params=[True, False], ids=["gzip", "json"])
def page(request):
    return render_page(fixture_data(), compress=request.param)


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
    assert scan.data_attrs["type"] == "application/x-pagedkv-runs"  # data, never executed
    data = read_page_data(page)
    assert data["format_version"] == 1
    assert data["runs"] == json.loads(json.dumps(fixture_data()["runs"]))
    if scan.data_attrs["data-encoding"] == "json":
        assert json.loads(scan.data_text) == data


def test_compression_is_worth_it():
    data = fixture_data(num_steps=60)
    packed, plain = render_page(data), render_page(data, compress=False)
    assert render_page(data) == packed  # deterministic bytes
    assert len(packed) < len(plain)
    assert read_page_data(packed) == read_page_data(plain)


@pytest.mark.parametrize("compress", [True, False])
def test_hostile_strings_cannot_break_out_of_the_script(compress):
    data = fixture_data(block_sizes=(4,), allocators=("paged",), seeds=(0,))
    data["workload"]["name"] = "</script><script>alert(1)</script>{{VIZ_JS}}&"
    page = render_page(data, title="<b>t</b>{{VIZ_DATA}}", compress=compress)
    assert page.count("</script>") == 2  # the data block's and the code block's own
    assert "<b>t</b>" not in page
    assert "<title>&lt;b&gt;t&lt;/b&gt;{{VIZ_DATA}}</title>" in page  # escaped, not expanded
    assert read_page_data(page)["workload"]["name"] == data["workload"]["name"]


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
    with pytest.raises(InvalidArgumentError, match="not a pagedkv visualizer page"):
        read_page_data("<html></html>")
