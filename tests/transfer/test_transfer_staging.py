"""Staged reads: the staging arena (a state machine against a model: ranges never overlap, free
ranges coalesce, everything tiles the arena), pack/unpack as exact inverses streaming the
bytes the checksums cover, and staged transfers between a source and a sink: bit-exact, a
corrupted block never reaching the caches, every fallback to row-by-row reads."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from listen_ports import free_port
from pagedkv.attention import QuantizedKvCache
from pagedkv.errors import InvalidArgumentError
from pagedkv.transfer import KvRegions, TransferSink, TransferSource
from pagedkv.transfer.checksum import block_checksums
from pagedkv.transfer.staging import StagingArena, pack_blocks, unpack_blocks


class ArenaMachine(RuleBasedStateMachine):
    ranges = Bundle("ranges")

    def __init__(self) -> None:
        super().__init__()
        self.arena = StagingArena(64 * 40)
        self.used: dict[int, int] = {}

    @rule(target=ranges, nbytes=st.integers(1, 64 * 12))
    def allocate(self, nbytes):
        offset = self.arena.allocate(nbytes)
        need = -(-nbytes // 64) * 64
        if offset is None:
            # First fit fails only if no free range is big enough.
            free = self.arena._free_sizes
            assert not free or max(free) < need
            return None
        assert offset % 64 == 0 and offset + need <= self.arena.nbytes
        for start, size in self.used.items():
            assert offset + need <= start or start + size <= offset, "overlap"
        self.used[offset] = need
        return offset

    @rule(offset=consumes(ranges))
    def release(self, offset):
        if offset is not None:
            self.arena.release(offset)
            del self.used[offset]

    @invariant()
    def tiles(self):
        self.arena.check()
        assert self.arena.bytes_in_use == sum(self.used.values())


TestArenaMachine = ArenaMachine.TestCase


def test_arena_refusals():
    for bad in (0, 63, True, "4096"):
        with pytest.raises(InvalidArgumentError):
            StagingArena(bad)  # type: ignore[arg-type]
    arena = StagingArena(1000)
    assert arena.nbytes == 960 and arena.allocate(961) is None and arena.allocate(960) == 0


def test_pack_and_unpack_are_inverse_and_stream_the_checksummed_bytes():
    rng = np.random.default_rng(0)
    arrays = (
        rng.standard_normal((10, 4, 2, 8)).astype(np.float32),
        rng.standard_normal((10, 4, 2, 8)).astype(np.float16),
        QuantizedKvCache.empty("int8", "key", 10, 4, 2, 8).data,
    )
    arrays[2][...] = rng.integers(0, 256, arrays[2].shape, dtype=np.uint8)
    ids = np.array([7, 2, 9])
    width = sum(a[0].nbytes for a in arrays)
    staged = np.zeros((3, width), np.uint8)
    pack_blocks(arrays, ids, staged)
    import xxhash

    assert [xxhash.xxh3_64_intdigest(r.data) for r in staged] == block_checksums(arrays, ids)
    copies = tuple(np.zeros_like(a) for a in arrays)
    unpack_blocks(staged, copies, np.array([0, 1, 2]))
    for a, c in zip(arrays, copies, strict=True):
        assert np.array_equal(c[:3].view(np.uint8), a[ids].view(np.uint8)) and not c[3:].any()


def regions(seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((32, 16, 2, 32)).astype(np.float32) for _ in range(6)]
    return arrays, KvRegions(arrays, block_size=16)


BLOCK_NBYTES = 6 * 16 * 2 * 32 * 4


def poll_until(source, want, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    freed = []
    while time.monotonic() < deadline and freed != want:
        r = source.poll()
        freed += [*r.completed, *r.expired]
    return freed


@pytest.mark.parametrize(("source_staging", "sink_staging"), [(64, 64), (64, 0), (0, 64), (2, 64), (64, 2)])
def test_staged_reads_and_every_fallback_move_the_same_bytes(source_staging, sink_staging):
    """Arena sizes in blocks: both staged; a sink without an arena; a source without one; a
    source arena too small for the request; a sink arena too small: all read the same bytes."""
    p_arrays, p_regions = regions(1)
    d_arrays, d_regions = regions(2)
    freed: list[str] = []
    with (
        TransferSource(
            p_regions,
            engine_id="p",
            free_request=freed.append,
            port=free_port(),
            staging_bytes=source_staging * BLOCK_NBYTES,
        ) as source,
        TransferSink(d_regions, engine_id="d", staging_bytes=sink_staging * BLOCK_NBYTES) as sink,
    ):
        params = source.offer("s", [[3, 9, 4, 20, 21], [30, 31]], 80)
        assert bool(params.staged_addr) == (source_staging >= 7)
        assert params.staged_nbytes == (7 * BLOCK_NBYTES if source_staging >= 7 else 0)
        held = [a[[0, 1]].copy() for a in d_arrays]
        dst = [[0, 1, 5, 6, 7], [10, 11]]
        result = sink.wait(sink.start(params, dst, skip=[[0, 1], []]))
        assert result.ok and result.blocks_read == 5 and result.blocks_skipped == 2
        assert (result.copy_s > 0) == (source_staging >= 7 and sink_staging >= 5)
        for d, p in zip(d_arrays, p_arrays, strict=True):
            assert np.array_equal(d[[5, 6, 7, 10, 11]], p[[4, 20, 21, 30, 31]])
        assert all(np.array_equal(a[[0, 1]], h) for a, h in zip(d_arrays, held, strict=True))
        assert poll_until(source, ["s"]) == ["s"] and freed == ["s"]
        # The ranges went back with the request: the next one stages again.
        assert source._arena is None or source._arena.bytes_in_use == 0
        assert sink._arena is None or sink._arena.bytes_in_use == 0


def test_a_corrupted_staged_block_never_reaches_the_caches():
    p_arrays, p_regions = regions(3)
    d_arrays, d_regions = regions(4)
    with (
        TransferSource(
            p_regions,
            engine_id="p",
            free_request=lambda r: None,
            port=free_port(),
            staging_bytes=8 * BLOCK_NBYTES,
        ) as source,
        TransferSink(d_regions, engine_id="d", staging_bytes=8 * BLOCK_NBYTES) as sink,
    ):
        params = source.offer("c", [[1, 2, 3]], 48)
        source._arena.array[BLOCK_NBYTES + 5] ^= 1  # the staged copy of block 2, after the checksum
        before = [a[6].copy() for a in d_arrays]
        result = sink.wait(sink.start(params, [[5, 6, 7]]))
        assert result.failed_block_ids == ((6,),) and result.num_valid_tokens == 16
        assert all(np.array_equal(a[6], b) for a, b in zip(d_arrays, before, strict=True))  # untouched
        for d, p in zip(d_arrays, p_arrays, strict=True):
            assert np.array_equal(d[[5, 7]], p[[1, 3]])
