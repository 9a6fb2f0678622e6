"""Interactive HTML visualizer of the block pool, block tables and waste, step by step.

``record_grid`` replays a workload through the simulator for every allocator x block size x
seed on the same pool; ``render_page`` / ``write_page`` turn the recordings into one
self-contained HTML file; ``serve_page`` serves it on 127.0.0.1. ``pagedkv viz`` does all three.
"""

from pagedkv.viz.encode import decode_run, encode_run
from pagedkv.viz.page import render_page, write_page
from pagedkv.viz.record import VizGrid, record_grid
from pagedkv.viz.serve import PageServer, serve_page

__all__ = [
    "VizGrid",
    "record_grid",
    "encode_run",
    "decode_run",
    "render_page",
    "write_page",
    "PageServer",
    "serve_page",
]
