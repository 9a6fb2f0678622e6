"""`pagedkv.sim.shared_tier`: a KV store shared by the simulated replicas, and its use in
`pagedkv.sim.cluster` and `pagedkv cluster --shared-tier`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv import cli
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import cluster
from pagedkv.sim.costmodel import LLAMA3_8B
from pagedkv.sim.shared_tier import GBIT_BYTES, SharedTier, SharedTierConfig

BLOCK = 100  # bytes per block in the unit tests


def test_lru_by_bytes_evicts_the_least_recently_used() -> None:
    tier = SharedTier(SharedTierConfig(capacity_bytes=3 * BLOCK + 99), BLOCK)  # room for 3 blocks
    for key in (1, 2, 3):
        tier.put(key)
    assert len(tier) == 3 and tier.used_bytes == 300
    tier.put(4)  # 1 is the oldest
    assert 1 not in tier and {2, 3, 4} == {k for k in (1, 2, 3, 4) if k in tier}
    assert tier.load([2]) == BLOCK  # 2 is now the most recent: 3 goes next
    tier.put(5)
    assert 3 not in tier and 2 in tier
    tier.put(4)  # refreshing a held block writes nothing new
    tier.put(6)
    assert 2 not in tier and 4 in tier
    assert (tier.stored_blocks, tier.evicted_blocks, tier.loaded_blocks, len(tier)) == (6, 3, 1, 3)
    tier.check_invariants()


def test_a_tier_smaller_than_a_block_holds_nothing() -> None:
    for capacity in (0, BLOCK - 1):
        tier = SharedTier(SharedTierConfig(capacity_bytes=capacity), BLOCK)
        tier.put(7)
        assert len(tier) == 0 and tier.match([7]) == 0
        tier.check_invariants()


def test_match_stops_at_the_first_missing_block_and_load_refuses_missing_ones() -> None:
    tier = SharedTier(SharedTierConfig(capacity_bytes=None), BLOCK)
    for key in (1, 2, 4):
        tier.put(key)
    assert tier.match([1, 2, 3, 4]) == 2 and tier.match([3, 4]) == 0 and tier.match([]) == 0
    with pytest.raises(InvalidArgumentError):
        tier.load([1, 3])
    assert tier.loaded_blocks == 0  # all or nothing


def test_serve_loads_after_the_local_hit_and_leaves_the_last_token_to_compute() -> None:
    config = SharedTierConfig(capacity_bytes=None, load_gbps=8.0, load_latency_s=0.5)
    tier = SharedTier(config, BLOCK)
    for key in (10, 11, 12):
        tier.put(key)
    # 2 blocks local (10, 11 are also in the tier: not loaded again), then 12, then a miss.
    tokens, seconds = tier.serve([10, 11, 12, 13], 2, 4 * 16 + 5, 16)
    assert tokens == 16 and seconds == pytest.approx(BLOCK / (8 * GBIT_BYTES) + 0.5)
    # A prompt of exactly 3 full blocks, all in the tier: the last block is computed.
    assert tier.serve([10, 11, 12], 0, 3 * 16, 16)[0] == 2 * 16
    # Nothing to load: no latency either.
    assert tier.serve([13], 0, 20, 16) == (0, 0.0)
    assert tier.loaded_blocks == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_bytes": -1},
        {"capacity_bytes": True},
        {"capacity_bytes": 1.5},
        {"capacity_bytes": 1, "load_gbps": 0.0},
        {"capacity_bytes": 1, "load_gbps": float("nan")},
        {"capacity_bytes": 1, "load_gbps": float("inf")},
        {"capacity_bytes": 1, "load_latency_s": -1e-3},
    ],
)
def test_bad_configs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        SharedTierConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_block_sizes_are_refused() -> None:
    for size in (0, -5, True, 2.0):
        with pytest.raises(InvalidArgumentError):
            SharedTier(SharedTierConfig(None), size)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    capacity_blocks=st.integers(0, 6),
    ops=st.lists(st.tuples(st.sampled_from(["put", "load"]), st.integers(0, 9)), max_size=60),
)
def test_tier_matches_a_list_lru_model(capacity_blocks: int, ops: list[tuple[str, int]]) -> None:
    tier = SharedTier(SharedTierConfig(capacity_bytes=capacity_blocks * BLOCK), BLOCK)
    model: list[int] = []  # oldest first
    for op, key in ops:
        if op == "put":
            if capacity_blocks:
                if key in model:
                    model.remove(key)
                model.append(key)
                del model[: max(0, len(model) - capacity_blocks)]
            tier.put(key)
        elif key in model:
            model.remove(key)
            model.append(key)
            assert tier.load([key]) == BLOCK
        else:
            assert tier.match([key]) == 0
        assert [k for k in range(10) if k in tier] == sorted(model)
        tier.check_invariants()
    # The eviction order is the model's: fill with fresh keys and watch the old ones leave,
    # oldest first.
    for number in range(capacity_blocks - len(model)):
        tier.put(100 + number)
    for number, key in enumerate(model):
        assert key in tier
        tier.put(200 + number)
        assert key not in tier


@pytest.mark.parametrize("trace", ["mooncake-conversation", "mooncake-synthetic"])
def test_one_replica_with_an_unbounded_tier_hits_the_traces_ideal_rate(trace: str) -> None:
    # A pool of 512 blocks evicts most of the trace's reuse (the replica alone keeps far less
    # than the ideal), yet rejects no request; every evicted block lands in the unbounded tier,
    # so local + shared hits are the ideal prefix hit rate exactly.
    requests = cluster.load_requests(trace)[:2000]
    config = cluster.ClusterConfig(num_slots=512 * 512)
    ideal = cluster.ideal_hit_rate(requests, config.block_size)
    alone = cluster.simulate_cluster(requests, 1, "round-robin", config)
    row = cluster.simulate_cluster(requests, 1, "round-robin", config, shared_tier=SharedTierConfig(None))
    assert alone["rejected_requests"] == row["rejected_requests"] == 0
    assert alone["token_hit_rate"] < ideal / 2
    assert row["token_hit_rate"] == pytest.approx(ideal, abs=1e-12)
    assert row["local_hit_rate"] + row["shared_hit_rate"] == pytest.approx(row["token_hit_rate"], abs=1e-12)
    assert row["shared_hit_rate"] > 0.2
    assert row["prefill_tokens"] + row["prefill_tokens_saved"] == sum(r.input_tokens for r in requests)
    assert row["shared_tier_loaded_bytes"] == row["shared_hit_tokens"] * LLAMA3_8B.kv_bytes_per_token
    assert row["router_predicted_hit_tokens"] == row["local_hit_tokens"]


def test_the_tier_saves_prefill_across_replicas_and_its_load_time_is_charged() -> None:
    requests = cluster.load_requests("multi-turn", seed=4)[:1500]
    config = cluster.ClusterConfig(num_slots=64 * 512)
    alone = cluster.simulate_cluster(requests, 4, "round-robin", config)
    fast = cluster.simulate_cluster(
        requests, 4, "round-robin", config, shared_tier=SharedTierConfig(1 << 40, load_gbps=1e4)
    )
    assert alone["shared_hit_tokens"] == alone["mean_load_s"] == 0 and alone["shared_tier_bytes"] is None
    assert fast["token_hit_rate"] > alone["token_hit_rate"] + 0.2
    assert fast["mean_ttft_s"] < alone["mean_ttft_s"]
    # The same loads over a link far slower than prefill (50 ms latency, 0.01 Gb/s): TTFT grows.
    slow = cluster.simulate_cluster(
        requests,
        4,
        "round-robin",
        config,
        shared_tier=SharedTierConfig(1 << 40, load_gbps=0.01, load_latency_s=0.05),
    )
    assert slow["mean_load_s"] > 1.0 and slow["mean_ttft_s"] > alone["mean_ttft_s"]
    # A tier of one block's bytes fewer than it needs holds nothing: routing alone, exactly.
    empty = cluster.simulate_cluster(
        requests,
        4,
        "round-robin",
        config,
        shared_tier=SharedTierConfig(512 * LLAMA3_8B.kv_bytes_per_token - 1),
    )
    for field in ("token_hit_rate", "prefill_tokens", "mean_ttft_s", "load_max_over_mean"):
        assert empty[field] == alone[field], field
    # A bounded tier evicts and keeps less than an unbounded one.
    small = cluster.simulate_cluster(
        requests,
        4,
        "round-robin",
        config,
        shared_tier=SharedTierConfig(32 * 512 * LLAMA3_8B.kv_bytes_per_token),
    )
    assert small["shared_tier_evicted_blocks"] > 0
    assert alone["token_hit_rate"] < small["token_hit_rate"] < fast["token_hit_rate"]


def _tiny_trace(tmp_path: Path) -> Path:
    trace = tmp_path / "tiny.jsonl"
    lines = [
        json.dumps(
            {
                "timestamp": 100 * i,
                "input_length": 1100,
                "output_length": 20,
                "hash_ids": [i % 3 * 100, i % 3 * 100 + 1, 1000 + i],
            }
        )
        for i in range(40)
    ]
    trace.write_text("\n".join(lines) + "\n")
    return trace


def test_cli_runs_each_policy_with_and_without_the_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cluster.json"
    argv = ["cluster", "--workload", str(_tiny_trace(tmp_path)), "--replicas", "1,2", "--num-slots", "2048"]
    argv += ["--shared-tier", "64GiB", "--shared-tier-gbps", "200", "--shared-tier-latency-ms", "0.5"]
    assert cli.main([*argv, "--json", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["policy"], r["replicas"], r["shared_tier_bytes"]) for r in rows] == [
        (p, n, tier) for p in cluster.POLICIES for tier in (None, 64 << 30) for n in (1, 2)
    ]
    assert data["shared_tier"] == {"capacity_bytes": 64 << 30, "load_gbps": 200.0, "load_latency_s": 0.0005}
    assert 0 < data["ideal_token_hit_rate"] < 1
    for row in rows:
        assert {
            "policy",
            "replicas",
            "token_hit_rate",
            "prefill_tokens",
            "load_max_over_mean",
            "mean_ttft_s",
            "local_hit_rate",
            "shared_hit_rate",
            "prefill_tokens_saved",
        } <= set(row)
    # Three prefixes of 2 blocks take turns on pools of 4 blocks: each request evicts the
    # prefix before it, which the tier then serves.
    assert any(row["shared_hit_rate"] > 0 for row in rows)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "shared tier against routing alone" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        (["--shared-tier", "12XB"], "argument --shared-tier: expected bytes"),
        (["--shared-tier", "0"], "argument --shared-tier: expected bytes > 0"),
        (["--shared-tier=-5GB"], "argument --shared-tier: expected bytes"),
        (["--shared-tier", "2000000EB"], "argument --shared-tier: expected bytes"),
        (["--shared-tier", "1GB", "--shared-tier-gbps", "0"], "argument --shared-tier-gbps"),
        (["--shared-tier", "1GB", "--shared-tier-gbps", "nan"], "argument --shared-tier-gbps"),
        (["--shared-tier", "1GB", "--shared-tier-latency-ms=-1"], "argument --shared-tier-latency-ms"),
        (["--shared-tier-gbps", "10"], "--shared-tier-gbps does not apply here"),
        (["--shared-tier-latency-ms", "3"], "--shared-tier-latency-ms does not apply here"),
    ],
)
def test_cli_refuses_bad_tier_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], reason: str
) -> None:
    argv = ["cluster", "--workload", str(_tiny_trace(tmp_path)), "--replicas", "1", *options]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    # argparse prints its usage first; the error itself is one line, the last.
    assert reason in captured.err.splitlines()[-1]
    assert sum("error" in line for line in captured.err.splitlines()) == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1000", 1000),
        ("500GB", 500 * 10**9),
        ("64GiB", 64 << 30),
        ("1.5 TB", 1_500_000_000_000),
        ("unbounded", None),
    ],
)
def test_cli_reads_tier_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: int | None
) -> None:
    out = tmp_path / "c.json"
    argv = ["cluster", "--workload", str(_tiny_trace(tmp_path)), "--replicas", "1", "--policy", "cost"]
    assert cli.main([*argv, "--shared-tier", text, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["shared_tier"]["capacity_bytes"] == expected
    # Rows tell the tier runs by `shared_tier`, not by their size (an unbounded one is None).
    assert [(r["shared_tier"], r["shared_tier_bytes"]) for r in data["rows"]] == [
        (False, None),
        (True, expected),
    ]
    assert "shared tier against routing alone" in capsys.readouterr().out
