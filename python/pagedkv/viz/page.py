"""Assemble the visualizer: one self-contained HTML file (styles, script and data inline).

The page must work from a ``file://`` URL on a machine without network access, so nothing is
fetched: ``template.html``, ``viz.css`` and ``viz.js`` (package data) are pasted into the file
together with the encoded runs as an inline JSON block.
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from pagedkv.errors import InvalidArgumentError, InvariantViolation

#: Bump when the embedded data layout changes (viz.js checks nothing, the tests do).
DATA_FORMAT_VERSION = 1

_PLACEHOLDERS = ("{{TITLE}}", "{{VIZ_CSS}}", "{{VIZ_JS}}", "{{VIZ_ENCODING}}", "{{VIZ_DATA}}")
_PLACEHOLDER_RE = re.compile(r"\{\{(TITLE|VIZ_CSS|VIZ_JS|VIZ_ENCODING|VIZ_DATA)\}\}")


def _asset(name: str) -> str:
    return resources.files("pagedkv.viz").joinpath(name).read_text(encoding="utf-8")


def _json_for_script(data: Any) -> str:
    """JSON that cannot end the surrounding ``<script>`` element early.

    ``<``, ``>`` and ``&`` only occur inside JSON strings, where their ``\\u`` escapes mean
    the same character to ``JSON.parse``.
    """
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(
    data: dict[str, Any],
    *,
    title: str = "pagedkv: KV-cache pool visualizer",
    compress: bool = True,
) -> str:
    """The complete HTML document for ``data`` (the dict built by ``pagedkv.viz.record``).

    ``data`` needs ``runs``: a non-empty list of :func:`pagedkv.viz.encode.encode_run`
    results, each labelled with ``allocator``, ``block_size`` and ``seed``. With ``compress``
    the data is embedded gzip-compressed in base64 (about a sixth of the size; the browser
    inflates it with its built-in ``DecompressionStream``), otherwise as plain JSON.
    """
    runs = data.get("runs")
    if not runs:
        raise InvalidArgumentError("the visualizer needs at least one recorded run")
    for run in runs:
        missing = [k for k in ("allocator", "block_size", "seed", "n", "c", "p") if k not in run]
        if missing:
            raise InvalidArgumentError(f"encoded run lacks {missing}")
    template = _asset("template.html")
    for placeholder in _PLACEHOLDERS[1:]:
        if template.count(placeholder) != 1:
            raise InvariantViolation(f"template.html must hold {placeholder} exactly once")
    payload = dict(data, format_version=DATA_FORMAT_VERSION)
    css = _asset("viz.css")
    script = _asset("viz.js")
    # The script is pasted verbatim into <script>; a closing tag inside it would cut it short.
    if "</script" in script.lower() or "</style" in css.lower():
        raise InvariantViolation("viz.js / viz.css must not contain a closing </script> or </style> tag")
    if compress:
        raw = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode("utf-8")
        # mtime=0: the same runs give byte-identical pages.
        body = base64.b64encode(gzip.compress(raw, compresslevel=9, mtime=0)).decode("ascii")
        encoding = "gzip+base64"
    else:
        body = _json_for_script(payload)
        encoding = "json"
    # One pass over the template: inserted text (a title, the data) is never scanned again.
    values = {
        "TITLE": html.escape(title),
        "VIZ_CSS": css,
        "VIZ_JS": script,
        "VIZ_ENCODING": encoding,
        "VIZ_DATA": body,
    }
    return _PLACEHOLDER_RE.sub(lambda match: values[match.group(1)], template)


def write_page(data: dict[str, Any], path: str | Path, **kwargs: Any) -> Path:
    """Render ``data`` and write it to ``path`` (UTF-8); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_page(data, **kwargs), encoding="utf-8")
    return out


_DATA_RE = re.compile(
    r'<script type="application/x-pagedkv-runs" id="viz-data" data-encoding="([a-z0-9+]+)">(.*?)</script>',
    re.S,
)


def read_page_data(page: str) -> dict[str, Any]:
    """The data dict embedded in a page written by :func:`render_page` (either encoding)."""
    match = _DATA_RE.search(page)
    if match is None:
        raise InvalidArgumentError("not a pagedkv visualizer page: no embedded runs found")
    encoding, body = match.groups()
    if encoding == "gzip+base64":
        return json.loads(gzip.decompress(base64.b64decode(body)))
    if encoding == "json":
        return json.loads(body)
    raise InvalidArgumentError(f"unknown data encoding {encoding!r}")
