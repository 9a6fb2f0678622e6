"""Cache-aware scheduling in the simulator (docs/scheduling.md): prefix-sharing traces as
workloads, the policies' ordering properties against the offline optimum and the aging bound
(hypothesis), the many-tenants workload, and the result fields."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import builders, cluster, traces, workloads
from pagedkv.sim.engine import SimConfig, Workload, simulate

BLOCK = 8  # tokens per trace block in the generated traces


def _trace(conversations: list[list[int]], turn_blocks: list[int], *, cut: int = 3) -> Workload:
    """One request per entry of ``turn_blocks`` (index into ``conversations``): the conversation's
    history so far plus one new block, its last block cut to ``cut`` tokens."""
    histories = [list(c) for c in conversations]
    next_id = 10_000
    prompts, offsets, ids = [], [0], []
    for k in turn_blocks:
        histories[k].append(next_id)
        next_id += 1
        blocks = histories[k]
        prompts.append((len(blocks) - 1) * BLOCK + cut)
        ids.extend(blocks)
        offsets.append(len(ids))
    n = len(prompts)
    return Workload(
        "trace",
        np.array(prompts, dtype=np.int64),
        np.full(n, 3, dtype=np.int64),
        np.arange(n, dtype=np.float64),
        block_offsets=np.array(offsets, dtype=np.int64),
        block_ids=np.array(ids, dtype=np.int64),
        block_tokens=BLOCK,
    )


def _config(scheduling: str, **kw) -> SimConfig:
    defaults = dict(
        block_size=4,
        num_slots=512,
        max_model_len=4096,
        enable_prefix_caching=True,
        watermark=0.0,
        check_invariants=True,
        scheduling=scheduling,
    )
    defaults.update(kw)
    return SimConfig(**defaults)


def _write_mooncake(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_rows_become_block_chains(tmp_path):
    path = _write_mooncake(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 1000, "input_length": 600, "output_length": 0, "hash_ids": [4, 5]},
            {"timestamp": 1500, "input_length": 1100, "output_length": 7, "hash_ids": [4, 5, 6]},
        ],
    )
    w = traces.mooncake_workload(traces.read_mooncake_jsonl(path), name="t")
    assert w.prompt_tokens.tolist() == [600, 1100]
    assert w.output_tokens.tolist() == [1, 7]  # no output: the prefill's first token
    assert w.block_offsets.tolist() == [0, 2, 5] and w.block_ids.tolist() == [4, 5, 4, 5, 6]
    assert w.block_tokens == traces.TRACE_BLOCK_TOKENS
    assert w.arrival_s.tolist() == [1.0, 1.5]
    picked = w.select(np.array([1]))
    assert picked.block_offsets.tolist() == [0, 3] and picked.block_ids.tolist() == [4, 5, 6]
    assert picked.prompt_tokens.tolist() == [1100]


def test_fcfs_with_a_pool_that_holds_everything_matches_the_cluster_ideal():
    """Two implementations agree: the simulator's real prefix cache, never evicting, against
    `cluster.ideal_hit_rate` (trace blocks alone)."""
    requests = cluster.load_requests("mooncake-synthetic", max_requests=60)
    w = traces.mooncake_workload(requests, name="head")
    distinct = len({h for r in requests for h in r.hash_ids}) * traces.TRACE_BLOCK_TOKENS
    longest = int((w.prompt_tokens + w.output_tokens).max())
    config = builders.build_config(
        w,
        synthetic=False,
        block_size=64,
        num_slots=(distinct + 64 * longest) // 64 * 64,
        enable_prefix_caching=True,
    )
    r = simulate(w, config)
    assert r.token_hit_rate == pytest.approx(cluster.ideal_hit_rate(requests, 64))
    assert r.token_hit_rate <= r.optimal_token_hit_rate
    # In arrival order nothing is lost but last blocks an earlier equal prompt could have spared.
    assert r.optimal_token_hit_rate == pytest.approx(r.token_hit_rate, abs=0.01)


conversation_traces = st.builds(
    lambda tenants, turns, cut: _trace([[t] for t in tenants], [k % len(tenants) for k in turns], cut=cut),
    st.lists(st.integers(0, 3), min_size=1, max_size=5),
    st.lists(st.integers(0, 20), min_size=2, max_size=30),
    st.integers(1, BLOCK),
)


@settings(max_examples=25, deadline=None)
@given(
    trace=conversation_traces,
    slots=st.integers(200, 800),
    bound=st.integers(0, 8),
    saturated=st.booleans(),
)
def test_policies_stay_under_the_optimum_within_the_aging_bound(trace, slots, bound, saturated):
    longest = int((trace.prompt_tokens + trace.output_tokens).max())
    num_slots = max(slots, -(-longest // 4) * 4)
    hits = {}
    for scheduling in ("fcfs", "lpm", "dfs"):
        config = _config(
            scheduling,
            num_slots=num_slots,
            aging_bound=bound,
            max_num_seqs=3,
            arrival="saturated" if saturated else "trace",
            step_time_s=0.5,
        )
        r = simulate(trace, config)
        assert r.finished_requests == trace.num_requests
        assert r.prompt_hit_tokens <= r.optimal_hit_tokens
        assert r.max_passed_over <= bound
        assert len(r.wait_s) == trace.num_requests and (r.wait_s >= 0).all()
        hits[scheduling] = r
    if bound == 0:  # the bound at 0 is first come, first served
        fcfs = hits["fcfs"]
        for scheduling in ("lpm", "dfs"):
            assert hits[scheduling].finished_request_ids.tolist() == fcfs.finished_request_ids.tolist()
            assert hits[scheduling].prompt_hit_tokens == fcfs.prompt_hit_tokens


def test_longest_prefix_groups_a_cold_conversation_set():
    """Eight conversations' turns interleaved, a pool for about one history at a time: FCFS
    recomputes each history every turn, the cache-aware policies serve a conversation's turns
    back to back."""
    trace = _trace([[c] for c in range(8)], [t % 8 for t in range(64)])
    runs = {s: simulate(trace, _config(s, num_slots=256, max_num_seqs=2)) for s in ("fcfs", "lpm", "dfs")}
    assert runs["fcfs"].hit_rate_of_optimum < 0.5
    for s in ("lpm", "dfs"):
        assert runs[s].hit_rate_of_optimum >= 0.96, (s, runs[s].hit_rate_of_optimum)
        assert runs[s].prefill_tokens < runs["fcfs"].prefill_tokens


def test_scheduling_is_refused_without_a_prefix_cache():
    trace = _trace([[1]], [0, 0])
    with pytest.raises(InvalidArgumentError, match="scheduling 'lpm'"):
        simulate(trace, _config("lpm", enable_prefix_caching=False))
    with pytest.raises(InvalidArgumentError, match="unknown scheduling"):
        simulate(trace, _config("sjf"))
    bad = trace.select(slice(0, 2))
    bad = Workload(**{**bad.__dict__, "block_offsets": np.array([0, 1, 9])})
    with pytest.raises(InvalidArgumentError, match="block_offsets must end"):
        simulate(bad, _config("fcfs"))


def test_result_fields_and_summary():
    trace = _trace([[1], [2]], [0, 1, 0, 1, 0])
    r = simulate(trace, _config("lpm", aging_bound=3))
    d = r.to_dict()
    for key in (
        "token_hit_rate",
        "optimal_token_hit_rate",
        "hit_rate_of_optimum",
        "p99_wait_s",
        "mean_wait_s",
        "prompt_tokens",
        "prompt_hit_tokens",
        "aging_bound",
        "max_passed_over",
        "forced_admissions",
        "evicted_wanted_blocks",
    ):
        assert key in d, key
    assert d["scheduling"] == "lpm" and d["aging_bound"] == 3
    assert d["token_hit_rate"] == pytest.approx(r.prompt_hit_tokens / r.prompt_tokens)
    assert r.prompt_tokens == int(trace.prompt_tokens.sum()) == r.optimal_prompt_tokens
    assert 0 <= d["hit_rate_of_optimum"] <= 1


def test_many_tenants_is_a_two_level_prefix_tree():
    w = workloads.many_tenants(400, num_tenants=16, tasks_per_tenant=3, seed=5)
    again = workloads.many_tenants(400, num_tenants=16, tasks_per_tenant=3, seed=5)
    assert np.array_equal(w.block_ids, again.block_ids)
    assert np.array_equal(w.prompt_tokens, again.prompt_tokens)
    assert (w.prompt_tokens + w.output_tokens).max() <= 2048
    offsets, ids = w.block_offsets, w.block_ids
    chains = [tuple(ids[offsets[i] : offsets[i + 1]].tolist()) for i in range(w.num_requests)]
    first = {c[0] for c in chains}
    assert len(first) <= 16
    # Requests of one tenant share its prompt blocks and differ after them only by task.
    by_tenant: dict[int, set[tuple[int, ...]]] = {}
    for c in chains:
        by_tenant.setdefault(c[0], set()).add(c)
    assert all(len(tasks) <= 3 for tasks in by_tenant.values())
    # Zipf popularity: the busiest tenant has many more requests than the median one.
    counts = sorted((sum(1 for c in chains if c[0] == t) for t in first), reverse=True)
    assert counts[0] > 3 * counts[len(counts) // 2]
    with pytest.raises(InvalidArgumentError, match="exceeds max_model_len"):
        workloads.many_tenants(10, max_model_len=512)
    d = workloads.describe(w)
    assert d["distinct_prefix_blocks"] <= d["prefix_blocks"]


def test_build_workload_reads_named_and_path_prefix_traces(tmp_path):
    notes: list[str] = []
    named = builders.build_workload("mooncake-conversation", num_requests=30, on_note=notes.append)
    assert named.num_requests == 30 and named.block_ids is not None
    assert notes == [traces.MOONCAKE_ATTRIBUTION]
    path = _write_mooncake(
        tmp_path / "mine.jsonl",
        [{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}],
    )
    mine = builders.build_workload(str(path))
    assert mine.name == "mine.jsonl" and mine.block_ids.tolist() == [1]
