"""The pieces of a transfer that need no transport: cache regions and their handshake page,
block checksums, the decode side's read plan, and block ids read off a real KvCacheManager
(full attention and sliding windows)."""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest
from pagedkv.attention import QuantizedKvCache
from pagedkv.errors import InvalidArgumentError, TransferError
from pagedkv.transfer import (
    KvRegions,
    KvTransferParams,
    ReadPlan,
    RemoteLayout,
    destination_block_ids,
    source_block_ids,
)
from pagedkv.transfer.checksum import block_checksum, block_checksums


def caches(num_blocks=8, layers=2, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    shape = (num_blocks, 4, 2, 8)
    k = [rng.standard_normal(shape).astype(dtype) for _ in range(layers)]
    v = [rng.standard_normal(shape).astype(dtype) for _ in range(layers)]
    return k, v


def params(block_ids, num_tokens, block_size=4, checksums=None):
    if checksums is None:
        checksums = [[0] * len(g) for g in block_ids]
    return KvTransferParams("p", "i", "r", "h", 1, num_tokens, block_size, block_ids, checksums, 1, 1, 1.0)


def test_regions_validate_their_arrays():
    k, v = caches()
    regions = KvRegions.from_caches(k, v, block_size=4)
    assert regions.num_blocks == 8 and len(regions.specs) == 4 and regions.block_nbytes == 4 * 4 * 2 * 8 * 4
    assert regions.descriptors().shape == (32, 3)
    d = regions.descriptors()
    assert (
        int(d[9, 0]) == k[1].ctypes.data + 4 * 2 * 8 * 4 and int(d[9, 1]) == 4 * 2 * 8 * 4
    )  # region 1, block 1
    bad = [
        ([k[0], k[1][:4]], "same"),
        ([k[0][:, :2]], "C-contiguous|tokens"),
        ([np.zeros((0, 4, 2, 8), np.float32)], "non-zero"),
        ([np.zeros(8, np.float32)], "C-contiguous"),
        ([np.zeros((8, 2, 2, 8), np.float32)], "tokens"),
        ([np.zeros((8, 4), object)], "numeric"),
        ([[1, 2]], "NumPy"),
        ([], "between"),
    ]
    for arrays, match in bad:
        with pytest.raises(InvalidArgumentError, match=match):
            KvRegions(arrays, block_size=4)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        KvRegions(k, block_size=0)


def test_quantized_caches_are_their_bytes_and_int4_sends_sealed_blocks_only():
    q8 = QuantizedKvCache.empty("int8", "key", 8, 4, 2, 8)
    r8 = KvRegions([q8], block_size=4)
    assert r8.arrays[0] is q8.data and not r8.sealed_blocks_only
    q4 = QuantizedKvCache.empty("int4", "value", 8, 4, 2, 8, num_residual_slots=2)
    assert KvRegions([q4], block_size=4).sealed_blocks_only
    with pytest.raises(InvalidArgumentError, match="tokens"):
        KvRegions([q8], block_size=8)


def test_checksums_follow_every_byte_of_a_block():
    k, v = caches()
    arrays = [*k, *v]
    sums = block_checksums(arrays, range(8))
    assert len(set(sums)) == 8 and sums[3] == block_checksum(arrays, 3)
    v[1][3, 2, 1, 7] = np.nextafter(v[1][3, 2, 1, 7], np.inf)  # one ulp in the last region
    assert block_checksum(arrays, 3) != sums[3] and block_checksums(arrays, [2, 4]) == [sums[2], sums[4]]


def test_the_handshake_page_round_trips_and_must_match():
    k, v = caches()
    regions = KvRegions.from_caches(k, v, block_size=4)
    page = regions.layout_page("p", "i")
    layout = RemoteLayout.from_page(page)
    assert layout.num_blocks == 8 and layout.addresses[2] == v[0].ctypes.data
    assert np.array_equal(layout.descriptors(), regions.descriptors())
    layout.check_matches(
        KvRegions.from_caches(*caches(num_blocks=3), block_size=4), "p", "i"
    )  # fewer blocks: fine
    mismatches = [
        (KvRegions.from_caches(*caches(dtype=np.float16), block_size=4), "p", "i", "region 0 differs"),
        (KvRegions.from_caches(*caches(layers=1), block_size=4), "p", "i", "regions"),
        (KvRegions([np.zeros((8, 8, 2, 8), np.float32)] * 4, block_size=8), "p", "i", "tokens"),
        (regions, "p", "other", "not p#other"),
    ]
    for local, engine, instance, match in mismatches:
        with pytest.raises(TransferError, match=match):
            layout.check_matches(local, engine, instance)
    for garbage in (b"", b"\xff", b"[]", b'{"version":1}', page.replace(b'"version":1', b'"version":2'),
                    page.replace(b'"num_blocks":8', b'"num_blocks":-8'),
                    page.replace(b'"num_blocks":8', b'"num_blocks":true')):  # fmt: skip
        with pytest.raises(TransferError):
            RemoteLayout.from_page(garbage)


def test_a_read_plan_pairs_positions_and_refuses_bad_destinations():
    p = params([[10, 11, 12, 13], [20, 21]], num_tokens=15, checksums=[[1, 2, 3, 4], [5, 6]])
    plan = ReadPlan.build(p, [[0, 1, 2, 3], np.array([4, 5])], [[0], []], local_num_blocks=8)
    assert plan.src.tolist() == [11, 12, 13, 20, 21] and plan.dst.tolist() == [1, 2, 3, 4, 5]
    assert plan.position.tolist() == [1, 2, 3, 2, 3] and plan.group.tolist() == [0, 0, 0, 1, 1]
    assert plan.checksums.tolist() == [2, 3, 4, 5, 6] and plan.num_skipped == 1 and plan.num_reads == 5
    local, remote = plan.descriptor_indices(num_regions=2, local_blocks=8, remote_blocks=30)
    assert local.tolist() == [1, 2, 3, 4, 5, 9, 10, 11, 12, 13]
    assert remote.tolist() == [11, 12, 13, 20, 21, 41, 42, 43, 50, 51]
    failed = np.array([False, True, False, False, False])
    assert plan.failed_by_group(failed) == ((2,), ())
    assert plan.num_valid_tokens(np.zeros(5, bool)) == 15
    assert plan.num_valid_tokens(failed) == 0  # group 1 starts at position 2: no earlier window
    full = ReadPlan.build(params([[10, 11, 12, 13]], 15), [[0, 1, 2, 3]], None, 8)
    assert full.num_valid_tokens(np.array([False, False, True, True])) == 8
    bad = [
        ([[0, 1, 2, 3]], None, "groups"),
        ([[0, 1, 2], [4, 5]], None, "has 3 ids"),
        ([[0, 1, 2, 8], [4, 5]], None, r"\[0, 8\)"),
        ([[0, 1, 2, -1], [4, 5]], None, "skip a position"),
        ([[0, 1, 2, -1], [4, 5]], [[4], []], r"skip\[0\]"),
        ([[0, 1, 2, 3], [3, 5]], None, "twice"),
        ([[0, 1, 2, 3], [4.0, 5.0]], None, "ints"),
        ([[0, 1, 2, 3], [4, 5]], [[0]], "skip is None"),
        ("0123", None, "one list"),
    ]
    for dst, skip, match in bad:
        with pytest.raises(InvalidArgumentError, match=match):
            ReadPlan.build(p, dst, skip, 8)
    assert ReadPlan.build(p, [[0, 1, 2, -1], [4, 5]], [[3], []], 8).num_skipped == 1  # skipped -1: fine


def test_block_ids_off_a_manager_full_attention_and_sliding_window():
    groups = [pagedkv.FullAttention(), pagedkv.SlidingWindow(window=32)]
    prefill = pagedkv.KvCacheManager(
        num_blocks=64, block_size=16, enable_prefix_caching=True, kv_groups=groups
    )
    tokens = list(range(100))  # 7 blocks, the last holding 4 tokens
    prefill.add_sequence(1, tokens)
    ids = source_block_ids(prefill, 1)
    assert ids[0] == prefill.block_table(1, group=0).tolist()
    assert ids[1] == prefill.block_table(1, group=1)[4:].tolist()  # tokens 68.. only
    prefill.append_tokens(1, [7] * 30)  # the window moves on: released blocks are -1
    table = prefill.block_table(1, group=1)
    assert (table[:4] == -1).all() and (table[4:] >= 0).all()
    assert source_block_ids(prefill, 1, 100)[1] == table[4:7].tolist()
    assert source_block_ids(prefill, 1, 80)[1] == table[4:5].tolist()  # position 3, released: left out
    with pytest.raises(InvalidArgumentError, match="holds 130"):
        source_block_ids(prefill, 1, 131)

    wire = KvTransferParams(
        "p", "i", "r", "h", 1, 100, 16, tuple(map(tuple, ids)), tuple((0,) * len(g) for g in ids), 1, 1, 1.0
    )
    decode = pagedkv.KvCacheManager(
        num_blocks=64, block_size=16, enable_prefix_caching=True, kv_groups=groups
    )
    decode.add_sequence(1, tokens[:48])  # a local prefix: 3 full blocks cached once freed
    decode.free(1)
    cached = decode.add_sequence(2, tokens, num_scheduled=0)
    assert cached == 48
    dst, skip = destination_block_ids(decode, 2, wire, cached)
    assert dst[0] == decode.block_table(2, group=0).tolist() and skip[0] == [0, 1, 2]
    assert dst[1] == decode.block_table(2, group=1)[4:].tolist() and skip[1] == []
    with pytest.raises(InvalidArgumentError, match="KV groups"):
        destination_block_ids(pagedkv.KvCacheManager(num_blocks=8, block_size=16), 0, wire, 0)
