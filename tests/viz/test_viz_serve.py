"""--serve binds to loopback only, serves exactly the page, and stops."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest
from pagedkv.errors import InvalidArgumentError
from pagedkv.viz.serve import PageServer, serve_page

HANG_GUARD_S = 60  # every wait below ends when its answer comes; this only bounds a hang


def test_serves_the_page_on_loopback(tmp_path):
    page = tmp_path / "v.html"
    page.write_text("<!DOCTYPE html><title>x</title>", encoding="utf-8")
    (tmp_path / "secret.txt").write_text("no", encoding="utf-8")
    with PageServer(page) as server:
        assert server.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(server.url, timeout=HANG_GUARD_S) as response:
            assert response.read() == page.read_bytes()
            assert response.headers["Content-Type"].startswith("text/html")
        for path in ("secret.txt", "../secret.txt", "v.html"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(server.url + path, timeout=HANG_GUARD_S)
            assert err.value.code == 404
        url = server.url
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_serve_page_prints_url_and_stops_after_duration(tmp_path):
    page = tmp_path / "v.html"
    page.write_text("<!DOCTYPE html>", encoding="utf-8")
    lines: list[str] = []
    done = threading.Event()

    def run():
        serve_page(page, duration_s=0.3, announce=lines.append)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(HANG_GUARD_S), "serve_page did not stop after duration_s"
    assert "http://127.0.0.1:" in lines[0]


def test_bad_arguments(tmp_path):
    with pytest.raises(InvalidArgumentError, match="no such page"):
        PageServer(tmp_path / "missing.html")
    page = tmp_path / "v.html"
    page.write_text("x", encoding="utf-8")
    with pytest.raises(InvalidArgumentError, match="port"):
        PageServer(page, port=70000)
    with pytest.raises(InvalidArgumentError, match="duration_s"):
        serve_page(page, duration_s=-1)
