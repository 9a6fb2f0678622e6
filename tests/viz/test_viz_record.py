"""Recording the grid with the real simulator: every run is there, on the same memory, and the
page's encoding reproduces the simulator's frames exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.engine import SimConfig, record_frames
from pagedkv.sim.workloads import make_workload
from pagedkv.viz.encode import decode_run
from pagedkv.viz.record import VizGrid, record_grid

NUM_SLOTS = 512
MAX_MODEL_LEN = 128


def workload(seed):
    return make_workload("synthetic", num_requests=30, seed=seed, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def grid_data():
    raw = {}

    def capture(w, config, *, max_steps):
        raw[(config.allocator, config.block_size, config.seed)] = record_frames(
            w, config, max_steps=max_steps
        )
        return raw[(config.allocator, config.block_size, config.seed)]

    grid = VizGrid(
        allocators=("paged", "contiguous-max", "contiguous-oracle"),
        block_sizes=(1, 4, 16),
        seeds=(0, 3),
        max_steps=60,
    )
    data = record_grid(
        workload, SimConfig(num_slots=NUM_SLOTS, max_model_len=MAX_MODEL_LEN), grid, recorder=capture
    )
    return grid, data, raw


def test_every_run_recorded_on_the_same_pool(grid_data):
    grid, data, raw = grid_data
    labels = {(r["allocator"], r["block_size"], r["seed"]) for r in data["runs"]}
    assert labels == {(a, b, s) for a in grid.allocators for b in grid.block_sizes for s in grid.seeds}
    assert data["num_slots"] == NUM_SLOTS
    for run in data["runs"]:
        assert run["num_blocks"] * run["block_size"] == NUM_SLOTS
        assert 1 <= run["n"] <= grid.max_steps


def test_encoding_reproduces_the_simulator(grid_data):
    _, data, raw = grid_data
    for run in data["runs"]:
        recording = raw[(run["allocator"], run["block_size"], run["seed"])]
        for frame, back in zip(recording["frames"], decode_run(run), strict=True):
            np.testing.assert_array_equal(back["pool"], np.asarray(frame["pool"]))
            assert back["tables"] == {
                int(rid): {"blocks": [int(b) for b in t["blocks"]], "num_tokens": int(t["num_tokens"])}
                for rid, t in frame["tables"].items()
            }
            assert back["running"] == frame["running"] and back["used_blocks"] == frame["used_blocks"]


def test_frames_agree_with_themselves(grid_data):
    """The pictures the page draws are consistent with the counters it shows."""
    _, data, raw = grid_data
    for (allocator, block_size, _), recording in raw.items():
        for frame in recording["frames"]:
            pool = np.asarray(frame["pool"])
            owned = pool[:, 0] >= 0
            assert frame["running"] == len(frame["tables"])
            assert int(pool[:, 1].sum()) == frame["token_slots"]
            assert int(pool[:, 2].sum()) == frame["reserved_slots"] + frame["internal_frag_slots"]
            assert np.all(pool[:, 1] + pool[:, 2] <= block_size)
            assert np.all(pool[~owned, 1:] == 0)
            assert set(pool[owned, 0].tolist()) <= {int(r) for r in frame["tables"]}
            if allocator == "paged":
                assert frame["used_blocks"] == int(owned.sum())
                for rid, table in frame["tables"].items():
                    blocks = [int(b) for b in table["blocks"]]
                    assert len(blocks) == math.ceil(table["num_tokens"] / block_size)
                    assert np.all(pool[blocks, 0] == int(rid))
                    assert int(pool[blocks, 1].sum()) == table["num_tokens"]


def test_paging_keeps_more_requests_resident(grid_data):
    """Same memory, contiguous-max reserves max_model_len per request: it holds fewer at once."""
    _, _, raw = grid_data
    for seed in (0, 3):
        paged = max(f["running"] for f in raw[("paged", 16, seed)]["frames"])
        contiguous = max(f["running"] for f in raw[("contiguous-max", 16, seed)]["frames"])
        assert contiguous <= NUM_SLOTS // MAX_MODEL_LEN < paged


def test_grid_validation():
    with pytest.raises(InvalidArgumentError, match="unknown allocator"):
        VizGrid(allocators=("paged", "buddy"))
    with pytest.raises(InvalidArgumentError, match="block sizes"):
        VizGrid(block_sizes=(0, 4))
    with pytest.raises(InvalidArgumentError, match="duplicates"):
        VizGrid(seeds=(1, 1))
    with pytest.raises(InvalidArgumentError, match="empty"):
        VizGrid(seeds=())
    with pytest.raises(InvalidArgumentError, match="max_steps"):
        VizGrid(max_steps=0)
    assert VizGrid().num_runs == 4 * 6 * 3
