"""``KvTransferParams``' wire form: a round trip keeps everything, and a malformed dict (any key
missing, mistyped or out of range; anything at all, under Hypothesis) is an
``InvalidArgumentError`` naming what is wrong, never another exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pagedkv.errors import InvalidArgumentError
from pagedkv.transfer import KvTransferParams
from pagedkv.transfer.messages import decode_notification, encode_notification
from pagedkv.transfer.params import MAX_BLOCKS_PER_REQUEST


def good() -> dict:
    return KvTransferParams(
        engine_id="prefill-0",
        instance="00ff",
        request_id="req-1",
        host="10.0.0.2",
        port=5600,
        num_tokens=70,
        block_size=16,
        block_ids=((3, 4, 5, 9, 10), (9_000, 9_001)),
        checksums=((1, 2, 3, 4, 2**64 - 1), (0, 7)),
        layout_addr=0x7F00_0000_0000,
        layout_nbytes=512,
        lease_s=30,
    ).to_dict()


def test_round_trip_through_json_keeps_everything():
    wire = good()
    assert wire["remote_block_ids"] == [[3, 4, 5, 9, 10], [9000, 9001]]
    assert wire["do_remote_prefill"] is True and wire["remote_num_tokens"] == 70
    params = KvTransferParams.from_dict(json.loads(json.dumps(wire)))
    assert params.to_dict() == wire
    assert params.num_logical_blocks == 5 and params.first_position(0) == 0 and params.first_position(1) == 3
    assert params.num_blocks == 7 and params.agent_name == "prefill-0#00ff"
    assert KvTransferParams.from_dict({**wire, "router_hint": "x"}) == params  # unknown keys ignored


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("remote_engine_id", "", "engine_id"),
        ("remote_engine_id", 7, "engine_id"),
        ("remote_request_id", "x" * 300, "request_id"),
        ("remote_port", 0, "port"),
        ("remote_port", True, "port"),
        ("remote_port", "5600", "port"),
        ("remote_num_tokens", -1, "num_tokens"),
        ("remote_block_size", 0, "block_size"),
        ("remote_block_ids", [[1, -2], []], "block_ids"),
        ("remote_block_ids", [[1.5], []], "block_ids"),
        ("remote_block_ids", "[[1]]", "block_ids"),
        ("remote_block_ids", [], "block_ids"),
        ("remote_block_ids", [[3, 4, 5, 9, 10], [3, 11]], "twice"),
        ("remote_num_tokens", 64, "5 blocks, more than the 4"),
        ("remote_block_checksums", [[1, 2, 3, 4, 5], [1]], "one checksum per block"),
        ("remote_block_checksums", [[1, 2, 3, 4, 2**64], [1, 2]], "checksums"),
        ("remote_layout_addr", 0, "layout_addr"),
        ("remote_layout_nbytes", 1 << 30, "layout_nbytes"),
        ("remote_lease_s", 0, "lease_s"),
        ("remote_lease_s", float("nan"), "lease_s"),
        ("transfer_version", 2, "transfer_version"),
    ],
)
def test_each_malformed_field_is_named(key, value, match):
    with pytest.raises(InvalidArgumentError, match=match):
        KvTransferParams.from_dict({**good(), key: value})


def test_missing_keys_and_non_dicts():
    wire = good()
    del wire["remote_host"]
    with pytest.raises(InvalidArgumentError, match="remote_host"):
        KvTransferParams.from_dict(wire)
    with pytest.raises(InvalidArgumentError, match="dict"):
        KvTransferParams.from_dict([("remote_host", "x")])  # type: ignore[arg-type]


def test_too_many_blocks_are_refused_before_anything_is_built():
    n = MAX_BLOCKS_PER_REQUEST + 1
    wire = {**good(), "remote_num_tokens": n * 16, "remote_block_ids": [list(range(n))]}
    wire["remote_block_checksums"] = [[0] * n]
    with pytest.raises(InvalidArgumentError, match="more than"):
        KvTransferParams.from_dict(wire)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@given(st.dictionaries(st.sampled_from(sorted(good())), json_values, max_size=16), st.booleans())
def test_any_dict_parses_or_is_an_invalid_argument(overrides, start_from_good):
    wire = {**good(), **overrides} if start_from_good else overrides
    try:
        params = KvTransferParams.from_dict(wire)
    except InvalidArgumentError:
        return
    assert KvTransferParams.from_dict(params.to_dict()) == params


def test_notifications_round_trip_and_garbage_is_none():
    message = encode_notification("done", ["a", "b"])
    note = decode_notification(message)
    assert note is not None and note.kind == "done" and note.request_ids == ("a", "b")
    garbage = [
        b"",
        b"\xff\xfe",
        b"[]",
        b'{"v":1,"k":"free","r":["a"]}',
        b'{"v":9,"k":"done","r":["a"]}',
        b'{"v":1,"k":"done","r":[]}',
        b'{"v":1,"k":"done","r":[""]}',
        b'{"v":1,"k":"done","r":[3]}',
        b"x" * (2 << 20),
    ]
    for message in garbage:
        assert decode_notification(message) is None


@given(st.binary(max_size=64))
def test_any_bytes_decode_to_a_notification_or_none(message):
    note = decode_notification(message)
    assert note is None or note.kind in ("done", "abandon", "renew")
