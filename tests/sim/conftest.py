"""Fixtures of the simulator tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from sim_helpers import find_traces_dir


@pytest.fixture
def traces_dir() -> Path:
    folder = find_traces_dir()
    if folder is None:
        pytest.skip("shared traces not found (set PAGEDKV_TRACES or place ../shared/traces)")
    return folder
