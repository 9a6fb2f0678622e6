"""Serve one visualizer page on the loopback interface (``pagedkv viz --serve``).

Only the page itself is served (at ``/`` and ``/index.html``), from memory: no directory
listing, nothing else on disk is reachable, and the socket binds to 127.0.0.1 only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pagedkv.errors import InvalidArgumentError

LOOPBACK_HOST = "127.0.0.1"


def _handler_for(page: bytes) -> type[BaseHTTPRequestHandler]:
    class PageHandler(BaseHTTPRequestHandler):
        server_version = "pagedkv-viz"

        def _send(self, with_body: bool) -> None:
            if self.path.split("?", 1)[0] not in ("/", "/index.html"):
                self.send_error(HTTPStatus.NOT_FOUND, "only / is served")
                return
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if with_body:
                self.wfile.write(page)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._send(with_body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._send(with_body=False)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # keep the terminal for the URL line

    return PageHandler


class PageServer:
    """A loopback HTTP server for one page; use as a context manager or call ``stop()``.

    ``port=0`` picks a free port; ``url`` tells which.
    """

    def __init__(self, page_path: str | Path, *, port: int = 0) -> None:
        path = Path(page_path)
        if not path.is_file():
            raise InvalidArgumentError(f"{path}: no such page to serve")
        if not 0 <= port <= 65535:
            raise InvalidArgumentError(f"port must be in [0, 65535], got {port}")
        self._httpd = ThreadingHTTPServer((LOOPBACK_HOST, port), _handler_for(path.read_bytes()))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        port = self._httpd.server_address[1]
        return f"http://{LOOPBACK_HOST}:{port}/"

    def start(self) -> PageServer:
        """Serve in a background thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> PageServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_page(
    page_path: str | Path,
    *,
    port: int = 0,
    duration_s: float | None = None,
    announce: Callable[[str], None] = print,
) -> None:
    """Serve ``page_path`` until Ctrl-C, or for ``duration_s`` seconds when given.

    Prints (through ``announce``) the URL to open.
    """
    if duration_s is not None and duration_s < 0:
        raise InvalidArgumentError(f"duration_s must be >= 0, got {duration_s}")
    with PageServer(page_path, port=port) as server:
        limit = "" if duration_s is None else f" for {duration_s:g} s"
        announce(f"Serving {page_path} at {server.url}{limit} (Ctrl-C stops)")
        deadline = None if duration_s is None else time.monotonic() + duration_s
        try:
            while deadline is None or time.monotonic() < deadline:
                remaining = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                time.sleep(max(0.0, remaining))
        except KeyboardInterrupt:
            announce("stopped")
