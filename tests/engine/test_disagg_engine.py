"""Disaggregated serving in one process (docs/transfer.md, The engine): a PrefillEngine and a
DecodeEngine on one model, their K/V moved over NIXL between two agents. Every request's tokens
equal a single instance's; the blocks the decode side holds already are skipped and counted; a
corrupted block, a lease run out and blocks reused after it, malformed or foreign params: no
leaked block, no wrong token, typed errors. The two-process runs are in test_disagg_processes.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("xxhash")
pytest.importorskip("nixl")

from pagedkv.disagg import DecodeEngine, PrefillEngine  # noqa: E402
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedkv.errors import InvalidArgumentError, TransferError  # noqa: E402

GREEDY = SamplingParams(max_tokens=4)


def single(model, prompt, config=None, params=GREEDY):
    engine = LLMEngine(model, config or EngineConfig(num_blocks=64))
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return engine.output(rid).outputs[0].token_ids


def run(engine, rid):
    while engine.has_unfinished():
        engine.step()
    return engine.output(rid)


def prefill(engine, prompt, params=GREEDY):
    rid = engine.add_request(prompt, params)
    run(engine, rid)
    return engine.take_offered(rid)


def drain(engine, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while engine.num_pending_transfers and time.monotonic() < deadline:
        engine.poll_transfers()
        time.sleep(0.002)
    return engine.num_pending_transfers


@pytest.fixture
def pair(smollm):
    p = PrefillEngine(smollm, EngineConfig(num_blocks=64, kv_role="prefill"))
    d = DecodeEngine(smollm, EngineConfig(num_blocks=64, kv_role="decode"))
    yield p, d
    d.close()
    p.close()


def test_tokens_equal_one_instance_and_held_blocks_are_skipped(smollm, pair):
    p, d = pair
    base = list(range(100, 160))  # 60 tokens: 3 full blocks and a partial one
    prompts = [base, base + list(range(300, 340)), list(range(500, 530))]
    for i, prompt in enumerate(prompts):
        params = prefill(p, prompt)
        assert params["remote_num_tokens"] == len(prompt)
        rid = d.add_request(prompt, GREEDY, kv_transfer_params=params)
        assert run(d, rid).outputs[0].token_ids == single(smollm, prompt), i
    records = [d.transfers[r] for r in range(3)]
    # The second prompt's first 3 blocks are the first prompt's: held by the decode side, skipped.
    assert [(r.blocks_read, r.blocks_skipped, r.cached_tokens) for r in records] == [
        (4, 0, 0),
        (4, 3, 48),
        (2, 0, 0),
    ]
    assert [r.tokens_received for r in records] == [59, 99 - 48, 29]  # the last token is computed here
    assert d.blocks_sent == 10 and d.blocks_skipped == 3 and not d.transfer_errors
    assert drain(p) == 0 and p.leaked_blocks == 0
    assert d.kv.num_blocks - d.kv.num_free_blocks == 0


def test_a_corrupted_block_is_recomputed_never_attended(smollm, pair):
    p, d = pair
    prompt = list(range(100, 170))
    params = prefill(p, prompt)
    block = params["remote_block_ids"][0][1]
    for cache in p.store.k_caches[:1]:
        cache[block] += 1.0  # after the checksum: the transport "corrupts" it
    rid = d.add_request(prompt, GREEDY, kv_transfer_params=params)
    assert run(d, rid).outputs[0].token_ids == single(smollm, prompt)
    record = d.transfers[rid]
    assert record.blocks_failed == 1 and record.tokens_received == 16  # block 0 only
    assert record.error is not None and record.error.startswith("TransferError")
    assert isinstance(d.transfer_errors[0], TransferError)
    assert drain(p) == 0 and p.leaked_blocks == 0


def test_a_lease_run_out_frees_the_blocks_and_a_late_read_recomputes(smollm):
    p = PrefillEngine(smollm, EngineConfig(num_blocks=8, kv_role="prefill"), lease_s=0.2)
    d = DecodeEngine(smollm, EngineConfig(num_blocks=64, kv_role="decode"))
    try:
        prompt = list(range(100, 160))
        params = prefill(p, prompt)
        time.sleep(0.3)
        p.poll_transfers()
        assert p.num_pending_transfers == 0 and p.leaked_blocks == 0  # freed by the lease
        # Another prompt takes the whole pool: every block the params name is written over.
        other = list(range(1000, 1120))
        prefill(p, other)
        rid = d.add_request(prompt, GREEDY, kv_transfer_params=params)
        assert run(d, rid).outputs[0].token_ids == single(smollm, prompt)
        record = d.transfers[rid]
        assert record.blocks_read == 0 and record.blocks_failed == 4 and record.tokens_received == 0
        assert isinstance(d.transfer_errors[0], TransferError)
        drain(p)
        assert p.source.pending.late_notifications >= 1  # the late "done": counted, nothing freed twice
        assert p.num_pending_transfers == 0 and p.leaked_blocks == 0
    finally:
        d.close()
        p.close()


def test_params_the_decode_side_cannot_use_are_refused_and_queue_nothing(smollm, pair):
    p, d = pair
    prompt = list(range(100, 140))
    params = prefill(p, prompt)
    with pytest.raises(InvalidArgumentError):
        d.add_request(prompt[:10], GREEDY, kv_transfer_params=params)  # fewer tokens than sent
    with pytest.raises(InvalidArgumentError):
        d.add_request(prompt, GREEDY, kv_transfer_params={**params, "remote_block_ids": "x"})
    with pytest.raises(InvalidArgumentError):
        d.add_request(prompt, GREEDY, kv_transfer_params={**params, "remote_block_size": 32})
    assert not d.has_unfinished() and not d.requests
    other = DecodeEngine(smollm, EngineConfig(num_blocks=8, kv_role="decode", kv_peer="10.0.0.1:5555"))
    try:
        with pytest.raises(InvalidArgumentError, match="kv_peer"):
            other.add_request(prompt, GREEDY, kv_transfer_params=params)
    finally:
        other.close()
    rid = d.add_request(prompt, GREEDY, kv_transfer_params=params)
    assert run(d, rid).outputs[0].token_ids == single(smollm, prompt)
    assert drain(p) == 0 and p.leaked_blocks == 0


@pytest.mark.parametrize(
    "options",
    [
        {"kv_role": "both"},
        {"kv_role": "decode", "kv_peer": "localhost"},
        {"kv_role": "decode", "kv_peer": "a:70000"},
        {"kv_role": "decode", "kv_peer": ":1"},
        {"kv_role": "decode", "kv_peer": 5},
        {"kv_peer": "a:1"},
    ],
)
def test_bad_roles_and_peers_are_typed_errors(options):
    with pytest.raises(InvalidArgumentError):
        EngineConfig(**options)


@pytest.mark.parametrize("chunk", [64, 16], ids=["one-pass-prefill", "chunked-prefill"])
def test_hybrid_groups_tokens_equal_one_instance(tiny_hybrid, chunk):
    """A window of 8 over blocks of 4: prefilled in one pass the prefill side still holds the
    window groups' history and sends it; prefilled in chunks it has released it and sends the
    window only, and the decode side recomputes rather than index positions it never received."""
    config = dict(num_blocks=64, block_size=4, max_num_batched_tokens=chunk)
    p = PrefillEngine(tiny_hybrid, EngineConfig(kv_role="prefill", **config))
    d = DecodeEngine(tiny_hybrid, EngineConfig(kv_role="decode", **config))
    try:
        base = [int(t) for t in np.random.default_rng(1).integers(1, 60, 30)]
        sent = []
        for prompt in (base, base + [7, 8, 9, 10, 11, 12, 13]):
            params = prefill(p, prompt)
            sent.append([len(g) for g in params["remote_block_ids"]])
            rid = d.add_request(prompt, GREEDY, kv_transfer_params=params)
            expected = single(tiny_hybrid, prompt, EngineConfig(**config))
            assert run(d, rid).outputs[0].token_ids == expected
        # A later request sharing a shorter prefix hits the decode side's cache: the window
        # groups' blocks it attends over must hold real K/V, never positions nobody sent.
        shorter = base[:12] + [50, 51, 52, 53, 54]
        rid = d.add_request(shorter, GREEDY)
        assert run(d, rid).num_cached_tokens > 0
        assert d.output(rid).outputs[0].token_ids == single(tiny_hybrid, shorter, EngineConfig(**config))
        assert drain(p) == 0 and p.leaked_blocks == 0
        assert not d.transfer_errors
        records = [d.transfers[0], d.transfers[1]]
        assert records[1].blocks_skipped == 7  # the first prompt's full blocks, held already
        if chunk == 64:
            # One pass: the window groups' whole history is still held, and sent.
            assert sent[0] == [8, 8, 8] and records[0].tokens_received == 29
        else:
            # In chunks: the window groups released what fell out of the window; the decode
            # side recomputes the first prompt rather than index positions it never received.
            assert sent[0] == [8, 3, 3] and records[0].tokens_received == 0
    finally:
        d.close()
        p.close()
