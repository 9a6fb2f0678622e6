"""A TransferSource and a TransferSink in one process (two NIXL agents talking through their
listeners and UCX, as two processes would): hybrid groups, quantized caches, a full hit,
refused calls that start nothing, a layout that does not match, an unreachable peer, lease
renewal, a restarted prefill engine, notifications that are not ours, closing."""

from __future__ import annotations

import time

import numpy as np
import pagedkv
import pytest
from listen_ports import free_port
from pagedkv.attention import QuantizedKvCache
from pagedkv.errors import InvalidArgumentError, TransferError, TransportUnavailableError
from pagedkv.transfer import (
    KvRegions,
    KvTransferParams,
    TransferSink,
    TransferSource,
    destination_block_ids,
    source_block_ids,
)
from pagedkv.transfer.transport import load_nixl


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def regions(num_blocks: int, *, seed: int | None, tensors: int = 3, dtype=np.float32, block_size: int = 16):
    shape = (num_blocks, block_size, 2, 32)
    if seed is None:
        arrays = [np.full(shape, -1, dtype) for _ in range(2 * tensors)]
    else:
        rng = np.random.default_rng(seed)
        arrays = [rng.standard_normal(shape).astype(dtype) for _ in range(2 * tensors)]
    return arrays, KvRegions(arrays, block_size=block_size)


def poll_until(source: TransferSource, done, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    released = []
    while True:
        r = source.poll()
        released += [*r.completed, *r.expired]
        if done(released) or time.monotonic() > deadline:
            return released
        time.sleep(0.002)


@pytest.fixture
def pair():
    """(prefill arrays, source, freed ids, decode arrays, sink)."""
    p_arrays, p_regions = regions(32, seed=1)
    d_arrays, d_regions = regions(32, seed=None)
    freed: list[str] = []
    with TransferSource(
        p_regions, engine_id="prefill", free_request=freed.append, port=free_port()
    ) as source:
        with TransferSink(d_regions, engine_id="decode", handshake_timeout_s=5.0) as sink:
            yield p_arrays, source, freed, d_arrays, sink


def same_rows(a: list[np.ndarray], a_ids, b: list[np.ndarray], b_ids) -> bool:
    return all(np.array_equal(x[list(a_ids)], y[list(b_ids)]) for x, y in zip(a, b, strict=True))


def test_hybrid_groups_move_the_window_only_bit_exactly():
    groups = [pagedkv.FullAttention(), pagedkv.SlidingWindow(window=32)]
    p_kv = pagedkv.KvCacheManager(num_blocks=32, block_size=16, enable_prefix_caching=True, kv_groups=groups)
    d_kv = pagedkv.KvCacheManager(num_blocks=32, block_size=16, enable_prefix_caching=True, kv_groups=groups)
    p_arrays, p_regions = regions(32, seed=2)
    d_arrays, d_regions = regions(32, seed=None)
    tokens = list(range(100))
    p_kv.add_sequence(7, tokens)
    freed: list[str] = []
    with (
        TransferSource(p_regions, engine_id="prefill", free_request=freed.append, port=free_port()) as source,
        TransferSink(d_regions, engine_id="decode") as sink,
    ):
        params = source.offer("h1", source_block_ids(p_kv, 7), 100)
        assert [len(g) for g in params.block_ids] == [7, 3] and params.first_position(1) == 4
        d_kv.add_sequence(1, tokens, num_scheduled=0)
        dst, skip = destination_block_ids(d_kv, 1, params, 0)
        result = sink.wait(sink.start(params.to_dict(), dst, skip=skip))
        assert result.ok and result.blocks_read == 10 and result.num_valid_tokens == 100
        for g in range(2):
            assert same_rows(d_arrays, dst[g], p_arrays, params.block_ids[g])
        # The sliding window's out-of-window positions were not sent and stay untouched.
        untouched = d_kv.block_table(1, group=1)[:4]
        assert all((a[untouched] == -1).all() for a in d_arrays)
        assert poll_until(source, lambda r: r == ["h1"]) == ["h1"] and freed == ["h1"]

        # A failed full-attention block with a sliding-window group: recompute the prompt.
        p_kv.add_sequence(8, list(range(200, 260)))
        params = source.offer("h2", source_block_ids(p_kv, 8), 60)
        p_arrays[4][params.block_ids[0][1]] += 1.0
        d_kv.add_sequence(2, list(range(200, 260)), num_scheduled=0)
        dst, skip = destination_block_ids(d_kv, 2, params, 0)
        result = sink.wait(sink.start(params, dst, skip=skip))
        assert result.failed_block_ids == ((dst[0][1],), ()) and result.num_valid_tokens == 0


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "int4"])
def test_quantized_caches_move_their_bytes_as_they_are(dtype):
    def caches(seed):
        rng = np.random.default_rng(seed)
        out = []
        for role in ("key", "value"):
            c = QuantizedKvCache.empty(
                dtype, role, 16, 16, 2, 32, num_residual_slots=2 if dtype == "int4" else 0
            )
            c.data[...] = rng.integers(0, 256, c.data.shape, dtype=np.uint8)
            out.append(c)
        return out

    p, d = caches(3), caches(4)
    with (
        TransferSource(
            KvRegions(p, block_size=16), engine_id="q", free_request=lambda r: None, port=free_port()
        ) as source,
        TransferSink(KvRegions(d, block_size=16), engine_id="decode") as sink,
    ):
        params = source.offer("q1", [[2, 3, 4, 5, 6]], 70)
        sent = 4 if dtype == "int4" else 5  # int4: the unfilled last block is in a residual slot
        assert params.num_tokens == (64 if dtype == "int4" else 70) and len(params.block_ids[0]) == sent
        result = sink.wait(sink.start(params, [[9, 10, 11, 12, 13][:sent]]))
        assert result.ok and result.blocks_read == sent
        for src, dst in zip(p, d, strict=True):
            assert np.array_equal(dst.data[9 : 9 + sent], src.data[2 : 2 + sent])


def test_a_full_hit_reads_nothing_and_frees_the_prefill_side(pair):
    p_arrays, source, freed, d_arrays, sink = pair
    params = source.offer("hit", [[1, 2, 3]], 48)
    before = [a.copy() for a in d_arrays]
    result = sink.wait(sink.start(params, [[4, 5, 6]], skip=[[0, 1, 2]]))
    assert (
        result.ok and result.blocks_read == 0 and result.blocks_skipped == 3 and result.num_valid_tokens == 48
    )
    assert all(np.array_equal(a, b) for a, b in zip(d_arrays, before, strict=True))
    assert poll_until(source, lambda r: r == ["hit"]) == ["hit"] and freed == ["hit"]


def test_refused_calls_start_nothing(pair):
    _, source, freed, _, sink = pair
    params = source.offer("r", [[1, 2, 3]], 40)
    wire = params.to_dict()
    bad = [
        (lambda: sink.start(wire, [[4, 5]]), "has 2 ids"),
        (lambda: sink.start(wire, [[4, 5, 99]]), r"\[0, 32\)"),
        (lambda: sink.start(wire, [[4, 4, 5]]), "twice"),
        (lambda: sink.start(wire, [[4, 5, 6]], skip=[[3]]), r"skip\[0\]"),
        (lambda: sink.start({**wire, "remote_port": -1}, [[4, 5, 6]]), "port"),
        (lambda: sink.start(wire, [[4, 5, 6]], request_id=""), "request_id"),
        (lambda: sink.wait("never"), "no read"),
        (lambda: source.offer("r", [[7]], 10), "already offered"),
        (lambda: source.offer("s", [[7, 32]], 20), r"\[0, 32\)"),
        (lambda: source.offer("s", [[7, 8]], 10), "more than the 1"),
        (lambda: source.offer("s", [[7], [7]], 10), "twice"),
        (lambda: source.offer("s", [], 10), "one list"),
        (lambda: source.offer("s", [[7]], -1), "num_tokens"),
    ]
    for call, match in bad:
        with pytest.raises(InvalidArgumentError, match=match):
            call()
    assert sink.num_in_flight == 0 and sink.poll() == [] and len(source.pending) == 1 and freed == []
    # The same request still reads fine afterwards; a second start of it is refused while known.
    rid = sink.start(wire, [[4, 5, 6]])
    with pytest.raises(InvalidArgumentError, match="already being read"):
        sink.start(wire, [[7, 8, 9]])
    assert sink.wait(rid).ok


def test_a_layout_that_does_not_match_is_a_failed_result_and_the_prefill_side_frees():
    _, p_regions = regions(16, seed=5, dtype=np.float32)
    _, d_regions = regions(16, seed=None, dtype=np.float16)
    freed: list[str] = []
    with (
        TransferSource(p_regions, engine_id="prefill", free_request=freed.append, port=free_port()) as source,
        TransferSink(d_regions, engine_id="decode") as sink,
    ):
        params = source.offer("x", [[1, 2]], 32)
        result = sink.wait(sink.start(params, [[3, 4]]))
        assert not result.ok and "region 0 differs" in str(result.error)
        assert result.failed_block_ids == ((3, 4),) and sink.get_block_ids_with_load_errors() == {3, 4}
        assert poll_until(source, lambda r: r == ["x"]) == ["x"]  # the abandon notice


def test_an_unreachable_peer_fails_within_the_handshake_timeout():
    _, d_regions = regions(8, seed=None)
    with TransferSink(d_regions, engine_id="decode", handshake_timeout_s=0.3) as sink:
        params = KvTransferParams(
            "gone", "0", "r", "127.0.0.1", free_port(), 32, 16, ((1, 2),), ((0, 0),), 1, 64, 5.0
        )
        started = time.monotonic()
        result = sink.wait(sink.start(params, [[3, 4]]))
        assert not result.ok and isinstance(result.error, TransferError) and "no answer" in str(result.error)
        assert result.num_valid_tokens == 0 and time.monotonic() - started < 5.0
        assert not sink.renew(params)
        with pytest.raises(TransferError):
            sink.connect(params)


def test_renewals_extend_the_lease_and_expiry_frees():
    clock = Clock()
    _, p_regions = regions(8, seed=6)
    _, d_regions = regions(8, seed=None)
    freed: list[str] = []
    with (
        TransferSource(
            p_regions,
            engine_id="prefill",
            free_request=freed.append,
            port=free_port(),
            lease_s=10.0,
            clock=clock,
        ) as source,
        TransferSink(d_regions, engine_id="decode") as sink,
    ):
        params = source.offer("slow", [[1]], 16)
        clock.now = 8.0
        assert sink.renew(params)
        deadline = time.monotonic() + 10
        while source.pending.renewed == 0 and time.monotonic() < deadline:
            source.poll()
        assert source.pending.deadline("slow") == 18.0
        clock.now = 17.9
        assert source.poll().expired == ()
        clock.now = 18.0
        assert source.poll().expired == ("slow",) and freed == ["slow"]


def test_a_restarted_prefill_engine_is_handshaken_anew(pair):
    p_arrays, source, freed, d_arrays, sink = pair
    assert sink.wait(sink.start(source.offer("a", [[1]], 16), [[2]])).ok
    port = free_port()
    again, again_regions = regions(32, seed=9)
    with TransferSource(
        again_regions, engine_id="prefill", free_request=freed.append, port=port
    ) as restarted:
        params = restarted.offer("b", [[5]], 16)
        assert params.instance != source.instance
        assert sink.wait(sink.start(params, [[3]])).ok
        assert same_rows(d_arrays, [3], again, [5])


def test_notifications_that_are_not_ours_are_counted_not_obeyed(pair):
    _, source, freed, _, sink = pair
    params = source.offer("keep", [[1]], 16)
    sink.connect(params)
    for garbage in (b"free everything", b'{"v":1,"k":"done","r":[7]}'):
        sink._agent.send_notif(params.agent_name, garbage)
    deadline = time.monotonic() + 10
    while source.bad_notifications < 2 and time.monotonic() < deadline:
        source.poll()
    assert source.bad_notifications == 2 and len(source.pending) == 1 and freed == []


def test_closing_the_source_frees_what_is_pending():
    _, p_regions = regions(8, seed=7)
    freed: list[str] = []
    source = TransferSource(p_regions, engine_id="prefill", free_request=freed.append, port=free_port())
    source.offer("a", [[1]], 16)
    source.offer("b", [[2]], 16)
    source.close()
    source.close()
    assert freed == ["a", "b"] and len(source.pending) == 0


def test_a_busy_port_and_a_missing_transport_are_typed_errors(monkeypatch):
    _, p_regions = regions(8, seed=8)
    port = free_port()
    with TransferSource(p_regions, engine_id="one", free_request=lambda r: None, port=port):
        with pytest.raises(TransferError, match=f"port {port}"):
            TransferSource(p_regions, engine_id="two", free_request=lambda r: None, port=port)
    monkeypatch.setitem(__import__("sys").modules, "nixl", None)
    with pytest.raises(TransportUnavailableError, match=r"pagedkv\[transfer\]"):
        load_nixl()
    with pytest.raises(InvalidArgumentError, match="port"):
        TransferSource(p_regions, engine_id="x", free_request=lambda r: None, port=0)


def test_a_read_past_its_timeout_is_given_up_and_reported():
    """65,536 rows of 1 KiB read without merging on a backend thread (``num_threads=1``: the
    post returns at once) against a 1 ms timeout: the read is given up (the prefill side told
    at once: ``abandon``), never cancelled (cancelling, then destroying the agent, aborted the
    process inside UCX), and reported when it ends, every block failed. Run repeatedly: the
    agents of each run are destroyed at its end."""
    num_blocks = 16384
    shape = (num_blocks, 16, 1, 16)
    p_regions = KvRegions([np.ones(shape, np.float32) for _ in range(4)], block_size=16)
    d_regions = KvRegions([np.zeros(shape, np.float32) for _ in range(4)], block_size=16)
    for _ in range(8):
        freed: list[str] = []
        with (
            TransferSource(p_regions, engine_id="p", free_request=freed.append, port=free_port()) as source,
            TransferSink(d_regions, engine_id="d", num_threads=1, timeout_s=0.001) as sink,
        ):
            params = source.offer("slow", [list(range(num_blocks))], num_blocks * 16)
            sink.connect(params)
            result = sink.wait(sink.start(params, [list(range(num_blocks))[::-1]]), timeout_s=60)
            assert not result.ok and "ran past 0.001 s" in str(result.error)
            assert result.blocks_read == 0 and len(result.failed_block_ids[0]) == num_blocks
            assert sink.num_in_flight == 0
            assert poll_until(source, lambda r: r == ["slow"]) == ["slow"] and freed == ["slow"]


def test_agents_run_without_nixls_spinning_progress_thread(monkeypatch):
    """NIXL's own progress thread polls without pause (most of a core per idle agent,
    benches/results/2026-12-06-transfer.md); pagedkv's agents turn it off and are driven by
    ``transport.Progress`` instead."""
    from pagedkv.transfer.transport import new_agent

    api = load_nixl()
    seen: dict = {}
    real = api.nixl_agent_config

    def spy(**kwargs):
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(api, "nixl_agent_config", spy)
    new_agent("spy", port=0)
    assert seen["enable_prog_thread"] is False and seen["enable_listen_thread"] is True
