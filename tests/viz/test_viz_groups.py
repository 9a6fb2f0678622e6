"""Parallel-sampling and beam-search runs: the page's encoding keeps every sequence of a group
and the copy-on-write shared blocks, exactly as the simulator recorded them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pagedkv.viz.encode import decode_run
from pagedkv.viz.record import VizGrid, record_grid

NUM_SLOTS = 1024
MAX_MODEL_LEN = 256


def group_workload(kind: str, group_size: int, seed: int):
    from pagedkv.sim.workloads import make_workload, with_groups

    base = make_workload("synthetic", num_requests=30, seed=seed, max_model_len=MAX_MODEL_LEN)
    return with_groups(base, group_size, kind)


def sequences_of(frame) -> list[list]:
    """[request, sample, num_tokens, blocks] for every sequence of a frame, sorted."""
    return sorted(
        [int(rid), sample, int(seq["num_tokens"]), [int(b) for b in seq["blocks"]]]
        for rid, entry in frame["tables"].items()
        for sample, seq in enumerate(entry.get("sequences") or [entry])
    )


@pytest.fixture(scope="module", params=[("parallel", 4), ("beam", 3)], ids=["parallel4", "beam3"])
def group_runs(request):
    from pagedkv.sim.engine import SimConfig, record_frames

    kind, group_size = request.param
    raw = {}

    def capture(workload, config, *, max_steps):
        raw[(config.allocator, config.block_size, config.seed)] = recording = record_frames(
            workload, config, max_steps=max_steps
        )
        return recording

    data = record_grid(
        lambda seed: group_workload(kind, group_size, seed),
        SimConfig(num_slots=NUM_SLOTS, max_model_len=MAX_MODEL_LEN),
        VizGrid(allocators=("paged", "contiguous-max"), block_sizes=(4, 16), seeds=(0,), max_steps=80),
        recorder=capture,
    )
    return kind, group_size, data, raw


def test_round_trip_keeps_every_sequence_and_shared_block(group_runs):
    kind, group_size, data, raw = group_runs
    assert data["group_kind"] == kind
    saw_group = saw_shared = False
    for run in json.loads(json.dumps(data))["runs"]:  # through JSON, as the page embeds it
        recording = raw[(run["allocator"], run["block_size"], run["seed"])]
        for index, (frame, back) in enumerate(zip(recording["frames"], decode_run(run), strict=True)):
            np.testing.assert_array_equal(back["pool"], np.asarray(frame["pool"]))
            assert sequences_of(back) == sequences_of(frame), f"{run['allocator']} frame {index}"
            # The first sequence stays the request's own table, as record_frames gives it.
            for rid, entry in frame["tables"].items():
                assert back["tables"][int(rid)]["blocks"] == [int(b) for b in entry["blocks"]]
                assert ("sequences" in back["tables"][int(rid)]) == ("sequences" in entry)
                saw_group |= len(entry.get("sequences", ())) > 1
            assert back["shared"] == sorted([int(b), int(r)] for b, r in frame["shared"])
            saw_shared |= bool(frame["shared"])
    assert saw_group, "no request ever ran more than one sequence"
    assert saw_shared, "no block was ever shared"


def test_shared_blocks_are_shared_by_the_tables(group_runs):
    """Each shared block's refcount equals the number of sequences of the frame holding it."""
    _, _, data, _ = group_runs
    for run in data["runs"]:
        if run["allocator"] != "paged":
            continue
        for frame in decode_run(run):
            holders: dict[int, int] = {}
            for _, _, _, blocks in sequences_of(frame):
                for block in set(blocks):
                    holders[block] = holders.get(block, 0) + 1
            assert frame["shared"] == sorted([b, n] for b, n in holders.items() if n > 1)


def test_unchanged_sharing_is_stored_once(group_runs):
    _, _, data, _ = group_runs
    for run in data["runs"]:
        stored = [sh for sh in run["sh"] if sh is not None]
        assert run["sh"][0] is not None
        assert len(stored) < run["n"]  # most steps reuse the previous frame's list
