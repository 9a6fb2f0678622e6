"""`pagedkv.sim.cluster`: replicas behind a router fed only by their KV events."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pagedkv
import pytest
from pagedkv import cli
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import cluster, router_index

BIG = cluster.ClusterConfig(num_slots=1 << 26)  # 131,072 blocks of 512: never evicts here


@pytest.mark.parametrize(
    ("trace", "least_ideal"), [("mooncake-conversation", 0.25), ("mooncake-synthetic", 0.3)]
)
def test_one_replica_without_eviction_hits_the_traces_ideal_rate(trace: str, least_ideal: float) -> None:
    # The bundled copies (or a checkout's shared/traces): runs from an installed wheel too.
    requests = cluster.load_requests(trace)[:2000]
    row = cluster.simulate_cluster(requests, 1, "round-robin", BIG)
    ideal = cluster.ideal_hit_rate(requests, BIG.block_size)
    assert ideal > least_ideal
    assert row["token_hit_rate"] == pytest.approx(ideal, abs=1e-12)
    assert row["prefill_tokens"] + row["prefill_tokens_saved"] == sum(r.input_tokens for r in requests)


@pytest.mark.parametrize("workload", ["system-prompt", "multi-turn"])
@pytest.mark.parametrize("block_size", [512, 128])
def test_fidelity_on_generated_workloads(workload: str, block_size: int) -> None:
    requests = cluster.load_requests(workload, seed=3)[:1500]
    config = cluster.ClusterConfig(num_slots=1 << 26, block_size=block_size)
    row = cluster.simulate_cluster(requests, 1, "least-loaded", config)
    assert row["token_hit_rate"] == pytest.approx(cluster.ideal_hit_rate(requests, block_size), abs=1e-12)


@pytest.mark.parametrize("policy", cluster.POLICIES)
def test_router_index_predicts_every_hit_under_eviction(policy: str) -> None:
    # Small pools: the replicas evict constantly, and the router learns it from BlockRemoved.
    requests = cluster.load_requests("multi-turn", seed=1)[:2000]
    config = cluster.ClusterConfig(num_slots=64 * 512)
    row = cluster.simulate_cluster(requests, 4, policy, config)
    assert row["rejected_requests"] == 0
    assert row["router_predicted_hit_tokens"] == row["prefill_tokens_saved"] > 0


def test_cache_aware_routing_beats_round_robin_on_shared_prefixes() -> None:
    requests = cluster.load_requests("multi-turn", seed=2)[:2500]
    config = cluster.ClusterConfig(num_slots=256 * 512)
    rows = {p: cluster.simulate_cluster(requests, 8, p, config) for p in cluster.POLICIES}
    saved = {p: rows[p]["prefill_tokens_saved"] for p in rows}
    assert saved["longest-prefix"] > 2 * saved["round-robin"]
    assert saved["cost"] > 2 * saved["round-robin"]
    assert rows["cost"]["mean_ttft_s"] < rows["round-robin"]["mean_ttft_s"]


def test_event_index_applies_stores_removals_and_clears() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=3, block_size=2, enable_prefix_caching=True, enable_kv_events=True)
    index = router_index.EventIndex(2)
    prompt = [1, 2, 3, 4, 5]
    keys = router_index.request_keys(np.asarray(prompt, dtype=np.uint32), 2)
    kv.add_sequence(1, prompt)
    assert index.apply_events(kv.take_events()) == []
    assert index.match(keys) == 2
    kv.free(1)
    kv.add_sequence(2, [9, 9, 9, 9, 9, 9])  # evicts both cached blocks
    # The removed keys are what a shared tier receives (`pagedkv.sim.shared_tier`).
    assert sorted(index.apply_events(kv.take_events())) == sorted(keys)
    assert index.match(keys) == 0
    kv.free(2)
    assert kv.reset_prefix_cache()
    assert index.apply_events(kv.take_events()) == []  # a clear is not an eviction
    assert len(index) == 0


def _twin_managers() -> tuple[pagedkv.KvCacheManager, pagedkv.KvCacheManager]:
    def make() -> pagedkv.KvCacheManager:
        return pagedkv.KvCacheManager(
            num_blocks=12, block_size=4, enable_prefix_caching=True, enable_kv_events=True
        )

    return make(), make()


def test_event_digests_are_the_event_stream_with_tokens_digested() -> None:
    # Two identical managers under the same random operations: one drained as event objects,
    # one as digests. The digest form must be exactly the object form, token ids digested.
    rng = np.random.default_rng(5)
    full, digested = _twin_managers()
    live: list[int] = []
    kinds: set[str] = set()
    for step in range(400):
        if live and (len(live) > 3 or rng.random() < 0.4):
            seq = live.pop(int(rng.integers(len(live))))
            for kv in (full, digested):
                kv.free(seq)
        elif not live and rng.random() < 0.3:
            for kv in (full, digested):
                assert kv.reset_prefix_cache()
        else:
            prompt = rng.integers(0, 3, size=int(rng.integers(1, 14))).astype(np.uint32)
            key = "salt" if rng.random() < 0.2 else None
            try:
                full.add_sequence(step, prompt, extra_key=key)
            except pagedkv.OutOfBlocksError:
                with pytest.raises(pagedkv.OutOfBlocksError):
                    digested.add_sequence(step, prompt, extra_key=key)
                continue
            digested.add_sequence(step, prompt, extra_key=key)
            live.append(step)
        expected = router_index.event_digests(full.take_events())
        assert digested.take_event_digests() == expected
        kinds.update(kind for kind, *_ in expected)
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def test_event_digests_match_the_request_side_digests() -> None:
    tokens = np.arange(10, dtype=np.uint32)
    digests = pagedkv._core.token_block_digests(tokens, 4)
    assert digests.dtype == np.uint64 and len(digests) == 2
    assert digests.tolist() == pagedkv._core.token_block_digests(tokens.tolist()[:8], 4).tolist()
    assert digests.tolist() == pagedkv._core.token_block_digests(tokens.astype(np.int64), 4).tolist()
    # Every array form reads the same ids (the contiguous uint32 fast path and the general one).
    strided = np.repeat(tokens, 2)[::2]
    readonly = tokens.copy()
    readonly.flags.writeable = False
    for form in (strided, readonly, tokens.astype(">u4"), tokens.view(type("Sub", (np.ndarray,), {}))):
        assert pagedkv._core.token_block_digests(form, 4).tolist() == digests.tolist()
    salted = pagedkv._core.token_block_digests(tokens, 4, extra_key="salt")
    assert salted[0] != digests[0]
    kv = pagedkv.KvCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True, enable_kv_events=True)
    kv.add_sequence(1, tokens, extra_key="salt")
    [(kind, hashes, parent, stored)] = kv.take_event_digests()
    assert (kind, parent, stored) == ("BlockStored", None, salted.tolist()) and len(hashes) == 2
    with pytest.raises(InvalidArgumentError):
        pagedkv._core.token_block_digests(tokens, 0)
    with pytest.raises(InvalidArgumentError):
        pagedkv._core.token_block_digests(np.ma.masked_array(tokens), 4)


def test_bad_inputs_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(InvalidArgumentError, match="bad.jsonl:1"):
        cluster.load_requests(str(bad))
    bad.write_text("not json\n")
    with pytest.raises(InvalidArgumentError):
        cluster.load_requests(str(bad))
    with pytest.raises(InvalidArgumentError):
        cluster.load_requests(str(tmp_path / "missing.jsonl"))
    with pytest.raises(InvalidArgumentError):
        cluster.load_requests("nope")
    with pytest.raises(InvalidArgumentError):
        cluster.simulate_cluster([], 1, "random")
    with pytest.raises(InvalidArgumentError):
        cluster.ClusterConfig(num_slots=1, block_size=16)


def test_cli_writes_one_row_per_policy_and_replica_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cluster.json"
    trace = tmp_path / "tiny.jsonl"
    lines = [
        json.dumps(
            {"timestamp": 100 * i, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2 + i]}
        )
        for i in range(40)
    ]
    trace.write_text("\n".join(lines) + "\n")
    code = cli.main(
        ["cluster", "--workload", str(trace), "--replicas", "1,2", "--policy", "all", "--json", str(out)]
    )
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["policy"], r["replicas"]) for r in rows] == [(p, n) for p in cluster.POLICIES for n in (1, 2)]
    for row in rows:
        assert {
            "policy",
            "replicas",
            "token_hit_rate",
            "prefill_tokens",
            "load_max_over_mean",
            "mean_ttft_s",
        } <= set(row)
    assert "cache-aware routing against round-robin" in capsys.readouterr().out
    assert cli.main(["cluster", "--workload", "nope"]) == 2
    assert cli.main(["cluster", "--replicas", "0"]) == 2


def test_default_capacity_is_the_documented_h200_deployment() -> None:
    # docs/experiments.md: (0.9 x 141 GB - 16.06 GB of Llama-3-8B weights - 2 GB) / 128 KiB.
    tokens = int((0.9 * 141e9 - 8_030_261_248 * 2 - 2e9) // (2 * 32 * 8 * 128 * 2))
    assert tokens == 830_379
    assert cluster.DEFAULT_NUM_SLOTS == cluster.ClusterConfig().num_slots == 829_952 == tokens // 512 * 512
    assert cluster.deployment_num_slots(16) == tokens // 16 * 16


_ROW = '{{"timestamp": {ts}, "input_length": {n}, "output_length": 1, "hash_ids": [1]}}\n'


@pytest.mark.parametrize(
    "name, body, reason",
    [
        ("deep", ("[" * 100_000 + "]" * 100_000 + "\n").encode(), "nested too deeply"),
        (
            "deep_field",
            ('{"timestamp": ' + "[" * 100_000 + "]" * 100_000 + "}\n").encode(),
            "nested too deeply",
        ),
        ("length_1e400", _ROW.format(ts=0, n="1e400").encode(), "input_length must be an integer"),
        ("length_float", _ROW.format(ts=0, n="10.0").encode(), "input_length must be an integer"),
        ("length_bool", _ROW.format(ts=0, n="true").encode(), "input_length must be an integer"),
        ("length_5000_digits", _ROW.format(ts=0, n="9" * 5000).encode(), "too many digits"),
        ("timestamp_10_400", _ROW.format(ts=10**400, n=10).encode(), "timestamp out of range"),
        ("timestamp_1e400", _ROW.format(ts="1e400", n=10).encode(), "timestamp out of range"),
        ("timestamp_nan", _ROW.format(ts="NaN", n=10).encode(), "timestamp out of range"),
        ("not_utf8", _ROW.format(ts=0, n=10).encode() + b'{"timestamp": "\xff\xfe"}\n', "not UTF-8"),
        ("not_an_object", b"[1, 2]\n", "expected a JSON object"),
        ("missing", b'{"timestamp": 0}\n', "missing input_length"),
    ],
)
def test_cli_refuses_a_malformed_trace_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, body: bytes, reason: str
) -> None:
    # Each of these once escaped as a traceback (RecursionError, OverflowError,
    # UnicodeDecodeError) or was read as another number (10.0, true): now one line on stderr
    # naming the file and line, and exit status 2.
    trace = tmp_path / f"{name}.jsonl"
    trace.write_bytes(body)
    assert cli.main(["cluster", "--workload", str(trace), "--replicas", "1", "--policy", "cost"]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert f"{trace}:" in line and reason in line and "Traceback" not in captured.err, line


def test_cli_runs_the_bundled_mooncake_trace_outside_a_checkout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As after `pip install` in an empty folder: no $PAGEDKV_TRACES, no shared/traces.
    from pagedkv.sim import traces

    monkeypatch.delenv("PAGEDKV_TRACES", raising=False)
    monkeypatch.setattr(traces, "_repo_roots", lambda: [])
    monkeypatch.chdir(tmp_path)
    argv = ["cluster", "--workload", "mooncake-conversation", "--max-requests", "200", "--replicas", "1"]
    assert cli.main([*argv, "--policy", "cost"]) == 0
    captured = capsys.readouterr()
    assert "Mooncake trace release, Moonshot AI" in captured.err
    assert "mooncake-conversation: 200 requests" in captured.err
