"""Fixtures of the offload tests: a real ``redis-server`` on a free port, in a temp dir."""

from __future__ import annotations

import shutil

import pytest
from offload_helpers import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    pytest.importorskip("redis", reason="redis-py is not installed: pip install 'pagedkv[offload]'")
    server = RedisServer(binary, tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()
