"""KV transfer between two processes of one machine (multiprocessing spawn): a prefill process
with a KvCacheManager and a TransferSource, a decode side in this process (or in a third one, to
be killed). SmolLM2's K/V shapes move bit for bit; blocks the decode side holds are skipped;
the prefill process killed mid-transfer, the decode process killed mid-transfer, a lease run
out and a corrupted block each end with the blocks reported failed, no prefill block leaked and
typed errors (docs/transfer.md, Failure handling)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pagedkv
import pytest
from pagedkv.errors import TransferError
from pagedkv.transfer import KvRegions, KvTransferParams, TransferSink, destination_block_ids
from transfer_procs import (
    SMOLLM2,
    blocks_hold,
    call,
    decode_reader,
    make_caches,
    slow_destination,
    start_prefill,
    wait_status,
)

CTX = multiprocessing.get_context("spawn")
NUM_BLOCKS = 48
# Big enough that a read takes a while: 256 MiB in 65,536 rows of 4 KiB (4 regions of 16,384
# blocks) read one descriptor per row (``slow_destination``: nothing merges), several times the
# 10 ms after which a process is killed; should a read ever finish first, the tests fail saying
# so (never pass vacuously).
BIG = {"layers": 2, "kv_heads": 1, "head_dim": 64, "block_size": 16}
BIG_BLOCKS = 16384
KILL_AFTER_S = 0.01


# SmolLM2's block: 60 rows of 12 KiB.
SMOLLM2_BLOCK_NBYTES = (
    2 * SMOLLM2["layers"] * SMOLLM2["block_size"] * SMOLLM2["kv_heads"] * SMOLLM2["head_dim"] * 4
)


@pytest.fixture(params=[0, 16], ids=["rows", "staged"])
def staging_blocks(request):
    """Arena sizes (in blocks) of both sides: 0 reads row by row, 16 stages."""
    return request.param


@pytest.fixture
def prefill(staging_blocks):
    proc, conn, port = start_prefill(
        CTX,
        num_blocks=NUM_BLOCKS,
        shape=SMOLLM2,
        lease_s=30.0,
        staging_bytes=staging_blocks * SMOLLM2_BLOCK_NBYTES,
    )
    yield conn
    if proc.is_alive():
        call(conn, "stop")
    proc.join(30)
    assert proc.exitcode == 0


def decode_side(num_blocks: int = NUM_BLOCKS, shape: dict[str, int] = SMOLLM2, **options):
    k, v = make_caches(num_blocks, **shape, fill=-7.0)
    regions = KvRegions.from_caches(k, v, block_size=shape["block_size"])
    kv = pagedkv.KvCacheManager(
        num_blocks=num_blocks, block_size=shape["block_size"], enable_prefix_caching=True
    )
    return kv, list(regions.arrays), TransferSink(regions, engine_id="decode", **options)


def test_smollm2_blocks_move_bit_exactly_and_held_blocks_are_skipped(prefill, staging_blocks):
    kv, arrays, sink = decode_side(staging_bytes=staging_blocks * SMOLLM2_BLOCK_NBYTES)
    with sink:
        # Request 1: 5 blocks (the last one holds 3 tokens), nothing held on the decode side.
        tokens = list(range(1, 68))
        params = KvTransferParams.from_dict(call(prefill, "offer", "r1", tokens))
        assert params.num_tokens == 67 and len(params.block_ids[0]) == 5
        cached = kv.add_sequence(1, tokens, num_scheduled=0)
        dst, skip = destination_block_ids(kv, 1, params, cached)
        result = sink.wait(sink.start(params, dst, skip=skip))
        assert result.ok and result.blocks_read == 5 and result.blocks_skipped == 0
        assert result.num_valid_tokens == 67 and result.failed_block_ids == ((),)
        assert bool(params.staged_addr) == bool(staging_blocks) == (result.copy_s > 0)
        assert all(blocks_hold(arrays, tokens, dst[0], 0))
        kv.advance_computed([1], 67)

        # Request 2 shares request 1's first 4 blocks: the decode side holds them (its prefix
        # cache) and reads only the 3 it lacks; the held ones are never written.
        tokens2 = tokens[:64] + list(range(500, 540))
        params2 = KvTransferParams.from_dict(call(prefill, "offer", "r2", tokens2))
        cached2 = kv.add_sequence(2, tokens2, num_scheduled=0)
        assert cached2 == 64
        dst2, skip2 = destination_block_ids(kv, 2, params2, cached2)
        assert skip2 == [[0, 1, 2, 3]] and dst2[0][:4] == dst[0][:4]
        held_before = [a[dst2[0][:4]].copy() for a in arrays]
        result2 = sink.wait(sink.start(params2, dst2, skip=skip2))
        assert result2.ok and result2.blocks_read == 3 and result2.blocks_skipped == 4
        assert all(np.array_equal(a[dst2[0][:4]], h) for a, h in zip(arrays, held_before, strict=True))
        assert all(blocks_hold(arrays, tokens2, dst2[0], 0))
        assert (
            sink.blocks_read == 8
            and sink.blocks_skipped == 4
            and sink.get_block_ids_with_load_errors() == set()
        )
        kv.advance_computed([2], len(tokens2) - cached2)
        kv.check_invariants()

    # The prefill side freed both requests on the notifications: no block left in use.
    status = wait_status(prefill, lambda s: s["pending"] == 0, 10)
    assert status["pending"] == 0 and status["completed"] == 2 and status["freed"] == ["r1", "r2"]
    assert status["free_blocks"] == NUM_BLOCKS and status["late"] == 0


def test_a_corrupted_block_is_reported_and_the_rest_arrive(prefill, staging_blocks):
    kv, arrays, sink = decode_side(staging_bytes=staging_blocks * SMOLLM2_BLOCK_NBYTES)
    with sink:
        tokens = list(range(100, 180))  # 5 full blocks
        params = KvTransferParams.from_dict(call(prefill, "offer", "c1", tokens))
        call(prefill, "corrupt", "c1", 2, 41)  # a byte of block position 2, region 41 (a V layer)
        kv.add_sequence(1, tokens, num_scheduled=0)
        dst, skip = destination_block_ids(kv, 1, params, 0)
        result = sink.wait(sink.start(params, dst, skip=skip))
        assert not result.ok and isinstance(result.error, TransferError)
        assert result.failed_block_ids == ((dst[0][2],),) and result.blocks_read == 4
        assert result.num_valid_tokens == 2 * 16  # the tokens before the failed block
        assert sink.get_block_ids_with_load_errors() == {dst[0][2]}
        assert blocks_hold(arrays, tokens, dst[0], 0) == [True, True, False, True, True]
        with pytest.raises(TransferError, match="checksums"):
            result.raise_for_error()
    status = wait_status(prefill, lambda s: s["pending"] == 0, 10)
    assert status["completed"] == 1 and status["free_blocks"] == NUM_BLOCKS


def test_a_lease_runs_out_then_a_late_read_gets_no_garbage():
    proc, conn, _ = start_prefill(CTX, num_blocks=16, shape=SMOLLM2, lease_s=0.5, prefix_caching=False)
    try:
        tokens = list(range(7, 7 + 80))
        params = KvTransferParams.from_dict(call(conn, "offer", "late", tokens))
        # Nobody reads: the lease frees the blocks (a decode side that never comes leaks nothing).
        status = wait_status(conn, lambda s: s["expired"] == 1, 10)
        assert status["pending"] == 0 and status["freed"] == ["late"] and status["free_blocks"] == 16
        # The prefill side reuses every free block for another request, then the late read comes.
        assert call(conn, "reuse") == 16
        kv, arrays, sink = decode_side(16)
        with sink:
            dst = [list(range(len(params.block_ids[0])))]
            result = sink.wait(sink.start(params, dst))
            assert not result.ok and result.blocks_read == 0 and result.num_valid_tokens == 0
            assert set(result.failed_block_ids[0]) == set(dst[0]) == sink.get_block_ids_with_load_errors()
        # Its done notification finds nothing pending: counted, nothing freed twice.
        status = wait_status(conn, lambda s: s["late"] == 1, 10)
        assert status["late"] == 1 and status["freed"] == ["late"] and status["completed"] == 0
    finally:
        if proc.is_alive():
            call(conn, "stop")
        proc.join(30)


def test_the_prefill_process_killed_mid_transfer():
    proc, conn, _ = start_prefill(CTX, num_blocks=BIG_BLOCKS, shape=BIG, lease_s=30.0)
    tokens = list(range(BIG_BLOCKS * BIG["block_size"]))
    params = call(conn, "offer", "big", tokens, False)
    kv, arrays, sink = decode_side(BIG_BLOCKS, BIG, timeout_s=20.0)
    with sink:
        sink.connect(params)
        killer = threading.Timer(KILL_AFTER_S, os.kill, (proc.pid, signal.SIGKILL))
        killer.start()
        dst = slow_destination(params)
        started = time.monotonic()
        rid = sink.start(params, dst)  # copies in this thread: the kill lands in the middle
        result = sink.wait(rid, timeout_s=60.0)
        killer.join()
        proc.join(30)
        assert not result.ok, f"the read finished in {time.monotonic() - started:.3f} s, before the kill"
        assert isinstance(result.error, TransferError)
        assert result.blocks_read == 0 and result.num_valid_tokens == 0
        assert sorted(result.failed_block_ids[0]) == list(range(BIG_BLOCKS))
        assert sink.get_block_ids_with_load_errors() == set(range(BIG_BLOCKS))
        assert sink.num_in_flight == 0
        # The engine restarts (same engine id, a new incarnation): the same sink reads from it.
        proc2, conn2, _ = start_prefill(CTX, num_blocks=8, shape=BIG)
        try:
            small = list(range(5, 5 + 40))
            params2 = KvTransferParams.from_dict(call(conn2, "offer", "again", small))
            assert params2.engine_id == "prefill" and params2.instance != params["remote_instance"]
            kv.add_sequence(1, small, num_scheduled=0)
            dst2, skip2 = destination_block_ids(kv, 1, params2, 0)
            again = sink.wait(sink.start(params2, dst2, skip=skip2))
            assert again.ok and all(blocks_hold(arrays, small, dst2[0], 0))
        finally:
            call(conn2, "stop")
            proc2.join(30)


def test_the_decode_process_killed_mid_transfer_leaks_nothing():
    proc, conn, _ = start_prefill(CTX, num_blocks=BIG_BLOCKS, shape=BIG, lease_s=2.0)
    try:
        tokens = list(range(BIG_BLOCKS * BIG["block_size"]))
        params = call(conn, "offer", "big", tokens, False)
        parent, child = CTX.Pipe()
        reader = CTX.Process(target=decode_reader, args=(child, params, BIG_BLOCKS, BIG), daemon=True)
        reader.start()
        assert parent.poll(120) and parent.recv() == "reading"
        time.sleep(KILL_AFTER_S)
        os.kill(reader.pid, signal.SIGKILL)
        reader.join(30)
        assert not parent.poll(0), "the read finished before the kill"
        # No notification ever comes: the lease frees the request's blocks.
        status = wait_status(conn, lambda s: s["pending"] == 0, 30)
        assert status["pending"] == 0 and status["expired"] == 1 and status["completed"] == 0
        assert status["free_blocks"] == BIG_BLOCKS
        # The prefill instance still serves: another decode side reads another request.
        small = list(range(3, 3 + 40))
        params2 = KvTransferParams.from_dict(call(conn, "offer", "after", small))
        kv, arrays, sink = decode_side(BIG_BLOCKS, BIG)
        with sink:
            kv.add_sequence(1, small, num_scheduled=0)
            dst, skip = destination_block_ids(kv, 1, params2, 0)
            result = sink.wait(sink.start(params2, dst, skip=skip))
            assert result.ok and all(blocks_hold(arrays, small, dst[0], 0))
        status = wait_status(conn, lambda s: s["completed"] == 1, 10)
        assert status["pending"] == 0 and status["free_blocks"] == BIG_BLOCKS
    finally:
        if proc.is_alive():
            call(conn, "stop")
        proc.join(30)
