"""The delta encoding of frames round-trips exactly and stays compact."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.errors import InvalidArgumentError
from pagedkv.viz.encode import decode_run, encode_run
from viz_frames_fixture import fixture_recording

COUNTERS = dict(
    step=0,
    running=0,
    waiting=0,
    finished=0,
    preemptions=0,
    used_blocks=0,
    token_slots=0,
    reserved_slots=0,
    internal_frag_slots=0,
    waste_pct=0.0,
)


def assert_round_trip(recording):
    decoded = decode_run(encode_run(recording, allocator="paged", block_size=1, seed=0))
    assert len(decoded) == len(recording["frames"])
    for index, (original, back) in enumerate(zip(recording["frames"], decoded, strict=True)):
        np.testing.assert_array_equal(back["pool"], np.asarray(original["pool"]), err_msg=f"frame {index}")
        want = {
            int(rid): {"blocks": list(t["blocks"]), "num_tokens": t["num_tokens"]}
            for rid, t in original["tables"].items()
        }
        assert back["tables"] == want, f"frame {index}"
        for key in ("step", "running", "used_blocks", "internal_frag_slots", "preemptions"):
            assert back[key] == original[key]
        assert back["waste_pct"] == pytest.approx(original["waste_pct"], abs=1e-4)


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_fixture_round_trip(block_size):
    assert_round_trip(fixture_recording(block_size=block_size, num_slots=64, num_steps=40))


@st.composite
def recordings(draw):
    """Arbitrary frame sequences: each pool/table is a mutation of the previous one, so both
    the "+1 token" shortcut and the general paths of the encoder get exercised."""
    num_blocks = draw(st.integers(1, 10))
    pool = [[-1, 0, 0] for _ in range(num_blocks)]
    tables: dict[int, dict] = {}
    frames = []
    for step in range(draw(st.integers(1, 8))):
        pool = [list(cell) for cell in pool]
        for i in range(num_blocks):
            action = draw(st.sampled_from(["keep", "inc", "set"]))
            if action == "inc":
                pool[i] = [pool[i][0], pool[i][1] + 1, pool[i][2] - 1]
            elif action == "set":
                pool[i] = [draw(st.integers(-1, 5)), draw(st.integers(0, 4)), draw(st.integers(0, 4))]
        new_tables = {}
        for rid, entry in tables.items():
            action = draw(st.sampled_from(["inc", "drop", "grow", "shrink", "same", "replace"]))
            blocks, num_tokens = list(entry["blocks"]), entry["num_tokens"]
            if action == "drop":
                continue
            if action == "inc":
                num_tokens += 1
            elif action == "grow":
                blocks.append(draw(st.integers(0, 50)))
                num_tokens += draw(st.integers(0, 3))
            elif action == "shrink":
                blocks = blocks[: draw(st.integers(0, len(blocks)))]
            elif action == "replace":
                blocks = draw(st.lists(st.integers(0, 50), max_size=5))
                num_tokens = draw(st.integers(0, 40))
            new_tables[rid] = {"blocks": blocks, "num_tokens": num_tokens}
        for rid in draw(st.lists(st.integers(0, 9), max_size=3, unique=True)):
            new_tables.setdefault(
                rid,
                {
                    "blocks": draw(st.lists(st.integers(0, 50), max_size=5)),
                    "num_tokens": draw(st.integers(0, 40)),
                },
            )
        tables = new_tables
        frames.append(
            dict(
                COUNTERS,
                step=step,
                waste_pct=draw(st.floats(0, 100)),
                pool=pool,
                tables={str(r): t for r, t in tables.items()},
            )
        )
    return {"config": {}, "num_blocks": num_blocks, "block_size": 1, "frames": frames}


@settings(max_examples=150, deadline=None)
@given(recordings())
def test_random_round_trip(recording):
    assert_round_trip(recording)


def test_decode_step_shortcut_is_compact():
    """A decode step that only adds one token per request costs one index per request, not a
    whole pool: the encoded run is far smaller than the frames it replaces."""
    recording = fixture_recording(block_size=16, num_slots=1024, num_steps=60, max_running=8)
    encoded = encode_run(recording, allocator="paged", block_size=16, seed=0)
    raw = len(json.dumps(recording["frames"]))
    packed = len(json.dumps(encoded))
    assert packed * 10 < raw, (packed, raw)


def test_bad_recordings_are_rejected():
    recording = fixture_recording(block_size=4, num_slots=32, num_steps=3)
    recording["frames"][1]["pool"] = recording["frames"][1]["pool"][:-1]
    with pytest.raises(InvalidArgumentError, match="frame 1: pool has shape"):
        encode_run(recording)
    with pytest.raises(InvalidArgumentError, match="no frames"):
        encode_run({"num_blocks": 4, "block_size": 1, "frames": []})
    with pytest.raises(InvalidArgumentError, match="must be > 0"):
        encode_run({"num_blocks": 0, "block_size": 1, "frames": [{}]})
