"""The Python face of the replay engine: results, frames, validation, groups, progress."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pagedkv import _core
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.engine import ALLOCATORS, SimConfig, SimResult, Workload, record_frames, simulate
from sim_helpers import synthetic_workload

DESIGN_KEYS = {
    "token_states",
    "reserved",
    "internal_fragmentation",
    "external_fragmentation",
    "free",
    "mean_resident_requests",
    "peak_resident_requests",
    "preemptions",
    "finished_requests",
    "steps",
    "generated_tokens",
}


def shares(r: SimResult) -> float:
    return r.token_states + r.reserved + r.internal_fragmentation + r.external_fragmentation + r.free


def plain(prompts: list[int], outputs: list[int]) -> Workload:
    n = len(prompts)
    return Workload("t", np.array(prompts), np.array(outputs), np.zeros(n))


@pytest.mark.parametrize("allocator", ALLOCATORS)
@pytest.mark.parametrize("placement", ["first-fit", "buddy"])
def test_shares_sum_to_one_and_every_request_finishes(allocator: str, placement: str) -> None:
    w = synthetic_workload(200, seed=3)
    r = simulate(w, SimConfig(allocator=allocator, placement=placement, check_invariants=True))
    assert math.isclose(shares(r), 1.0, abs_tol=1e-9)
    assert r.finished_requests == 200
    assert r.generated_tokens == int(w.output_tokens.sum())
    assert r.waste_per_request_tokens.shape == (200,)
    assert r.block_table_len.dtype == np.int64
    assert sorted(r.finished_request_ids.tolist()) == list(range(200))
    d = r.to_dict()
    assert DESIGN_KEYS <= d.keys()
    json.dumps(d)  # JSON-ready
    if allocator != "paged":
        assert r.preemptions == 0
        assert not r.block_table_len.any()


def test_paged_beats_contiguous_on_the_synthetic_workload() -> None:
    w = synthetic_workload(400, seed=0)
    results = {a: simulate(w, SimConfig(allocator=a)) for a in ALLOCATORS}
    paged = results["paged"]
    for name in ("contiguous-max", "contiguous-pow2", "contiguous-oracle"):
        other = results[name]
        assert paged.token_states > other.token_states, name
        assert paged.mean_resident_requests > other.mean_resident_requests, name
        assert paged.steps < other.steps, name
    # While requests queue (memory is the bottleneck) paging keeps nearly every slot busy.
    assert paged.queued_steps > 0
    assert paged.shares_while_queued["token_states"] > 0.9
    assert math.isclose(sum(paged.shares_while_queued.values()), 1.0)
    assert results["contiguous-max"].token_states < 0.35
    assert results["contiguous-max"].internal_fragmentation > 0.4
    # Paged waste per request is the unused tail of the last block: about block_size / 2.
    assert 4 < paged.waste_per_request_tokens.mean() < 12


def test_waste_per_request_tracks_half_the_block_size() -> None:
    w = synthetic_workload(300, seed=1)
    for block_size in (4, 16, 64):
        r = simulate(w, SimConfig(block_size=block_size, num_slots=64 * 256))
        mean_waste = float(r.waste_per_request_tokens.mean())
        assert abs(mean_waste - block_size / 2) < block_size * 0.2, (block_size, mean_waste)
        lengths = w.prompt_tokens + w.output_tokens
        expected = np.ceil(lengths[r.finished_request_ids] / block_size)
        assert np.array_equal(r.block_table_len, expected.astype(np.int64))


def test_record_frames_counts_match_the_pool() -> None:
    w = synthetic_workload(60, seed=2)
    for allocator in ("paged", "contiguous-pow2"):
        config = SimConfig(allocator=allocator, block_size=16, num_slots=4096)
        rec = record_frames(w, config, max_steps=50)
        frames = rec["frames"]
        assert len(frames) == rec["summary"]["steps"] == 50
        assert rec["num_blocks"] == 256
        for f in frames:
            assert len(f["pool"]) == 256
            total = f["token_slots"] + f["reserved_slots"] + f["internal_frag_slots"]
            total += f["external_frag_slots"] + f["free_slots"]
            assert total == 4096
            assert f["used_blocks"] == sum(1 for cell in f["pool"] if cell[0] >= 0)
            assert sum(cell[1] for cell in f["pool"]) == f["token_slots"]
            assert f["running"] == len(f["tables"])
            for rid, table in f["tables"].items():
                assert table["num_tokens"] >= w.prompt_tokens[rid]
                if allocator == "paged":
                    assert len(table["blocks"]) == math.ceil(table["num_tokens"] / 16)
            # Waste: slots neither holding a token nor free, in % of the pool (as in the tables).
            wasted = total - f["token_slots"] - f["free_slots"]
            assert f["waste_pct"] == pytest.approx(100 * wasted / 4096)
        assert [f["step"] for f in frames] == list(range(50))
        assert all(f["pool"].dtype == np.int64 and f["pool"].shape == (256, 3) for f in frames)
        json.dumps(rec, default=lambda a: a.tolist())


def test_parallel_samples_share_prompt_blocks() -> None:
    w = Workload("cow", np.array([1000]), np.array([1]), np.zeros(1), np.array([4]), "parallel")
    rec = record_frames(w, SimConfig(num_slots=16 * 128), max_steps=5)
    frame = rec["frames"][0]
    assert frame["used_blocks"] == 62 + 4
    assert frame["token_slots"] == 62 * 16 + 4 * 9
    assert len(frame["tables"][0]["sequences"]) == 4
    assert all(refcount == 4 for _, refcount in frame["shared"])
    no_sharing = simulate(w, SimConfig(allocator="contiguous-oracle", num_slots=8192))
    assert no_sharing.finished_requests == 1


def test_beam_search_runs_and_shares() -> None:
    n = 12
    w = Workload("beam", np.full(n, 300), np.full(n, 80), np.zeros(n), np.full(n, 4), "beam")
    beam = simulate(w, SimConfig(num_slots=32768, check_invariants=True))
    parallel = simulate(
        Workload("par", w.prompt_tokens, w.output_tokens, w.arrival_s, w.group_size, "parallel"),
        SimConfig(num_slots=32768),
    )
    assert beam.finished_requests == parallel.finished_requests == n
    assert beam.generated_tokens == 4 * 80 * n
    assert beam.mean_used_blocks < parallel.mean_used_blocks


def test_invalid_input_raises_invalid_argument_naming_the_request() -> None:
    with pytest.raises(InvalidArgumentError, match="request 1: prompt_tokens is -5"):
        simulate(plain([10, -5], [3, 3]), SimConfig())
    with pytest.raises(InvalidArgumentError, match="request 0: output_tokens is 0"):
        simulate(plain([10], [0]), SimConfig())
    with pytest.raises(InvalidArgumentError, match=r"request 2 needs \d+ blocks"):
        simulate(plain([10, 10, 1500], [3, 3, 500]), SimConfig(num_slots=1024, max_model_len=4096))
    with pytest.raises(InvalidArgumentError, match="request 2 needs a contiguous reservation"):
        simulate(
            plain([10, 10, 1500], [3, 3, 500]),
            SimConfig(allocator="contiguous-oracle", num_slots=1024, max_model_len=4096),
        )
    with pytest.raises(InvalidArgumentError, match="exceeds max_model_len 2048"):
        simulate(plain([2000], [100]), SimConfig())
    with pytest.raises(InvalidArgumentError, match="request 1: prompt_tokens is 2.5"):
        simulate(Workload("f", np.array([3.0, 2.5]), np.array([1, 1]), np.zeros(2)), SimConfig())
    with pytest.raises(InvalidArgumentError, match="1-D"):
        simulate(Workload("2d", np.ones((2, 2), dtype=np.int64), np.ones(2), np.zeros(2)), SimConfig())
    with pytest.raises(InvalidArgumentError, match="output_tokens has 1 entries"):
        simulate(Workload("len", np.ones(2, dtype=np.int64), np.ones(1), np.zeros(2)), SimConfig())
    with pytest.raises(InvalidArgumentError, match="non-decreasing"):
        simulate(Workload("order", np.ones(2, dtype=np.int64), np.ones(2), np.array([1.0, 0.0])), SimConfig())


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (SimConfig(allocator="segmented"), "unknown allocator"),
        (SimConfig(placement="best-fit"), "unknown placement"),
        (SimConfig(arrival="bursty"), "unknown arrival"),
        (SimConfig(block_size=0), "block_size"),
        (SimConfig(block_size=-3), "block_size must be a non-negative int"),
        (SimConfig(block_size=2.5), "block_size must be a non-negative int"),  # type: ignore[arg-type]
        (SimConfig(step_time_s=0.0), "step_time_s"),
        (SimConfig(max_num_seqs=0), "max_num_seqs"),
        (SimConfig(arrival="poisson", poisson_rate=-1.0), "poisson_rate"),
        (SimConfig(watermark=1.5), "watermark"),
        (SimConfig(enable_prefix_caching=1), "enable_prefix_caching must be a bool"),  # type: ignore[arg-type]
    ],
)
def test_bad_config_raises_invalid_argument(config: SimConfig, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        simulate(plain([10], [2]), config)


def test_wrong_types_are_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError):
        simulate("not a workload", SimConfig())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        simulate(plain([1], [1]), {"allocator": "paged"})  # type: ignore[arg-type]
    ones = np.ones(1, dtype=np.int64)
    with pytest.raises(InvalidArgumentError, match="int64"):
        _core.simulate([1], ones, np.zeros(1), None, "none", None, None, {})
    with pytest.raises(InvalidArgumentError, match="unknown config key"):
        _core.simulate(ones, ones, np.zeros(1), None, "none", None, None, {"colour": "red"})
    with pytest.raises(InvalidArgumentError, match="max_steps"):
        record_frames(plain([1], [1]), SimConfig(), max_steps=0)


def test_arrival_processes() -> None:
    n = 30
    w = Workload("arr", np.full(n, 32), np.full(n, 10), 50.0 + np.arange(n) * 2.0)
    trace = simulate(w, SimConfig(arrival="trace"))
    assert trace.peak_resident_requests == 1
    assert trace.simulated_seconds == pytest.approx((n - 1) * 2.0 + 10 * 0.02)
    assert np.allclose(trace.latency_s, 0.2)
    p1 = simulate(w, SimConfig(arrival="poisson", poisson_rate=5.0, seed=1))
    # Poisson arrivals replace the trace's own times (2 s apart, starting at 50 s): 30 requests at
    # 5 per second arrive within about 6 s (29 gaps of mean 0.2 s; 15 s is > 10 standard deviations).
    assert p1.finished_requests == n
    assert 29 * 0.2 / 3 < p1.simulated_seconds < 15.0
    assert simulate(w, SimConfig(arrival="poisson", poisson_rate=5.0, seed=1)).to_dict() == p1.to_dict()
    assert (
        simulate(w, SimConfig(arrival="poisson", poisson_rate=5.0, seed=2)).simulated_seconds
        != p1.simulated_seconds
    )
    assert simulate(w, SimConfig()).peak_resident_requests == n


def test_recompute_preemption_under_pressure() -> None:
    w = synthetic_workload(200, seed=4)
    r = simulate(w, SimConfig(num_slots=2048, max_model_len=2048, check_invariants=True))
    assert r.finished_requests == 200
    assert r.preemptions > 0
    assert r.recompute_preemptions == r.preemptions
    assert r.recomputed_tokens > 0
    assert r.prefill_tokens == int(w.prompt_tokens.sum()) + r.recomputed_tokens
    assert r.generated_tokens == int(w.output_tokens.sum())


def test_progress_callback_and_early_stop(capsys: pytest.CaptureFixture[str]) -> None:
    w = Workload("long", np.full(4, 10), np.full(4, 20000), np.zeros(4))
    config = SimConfig(num_slots=2**17, max_model_len=2**15)
    calls: list[tuple[int, int, int]] = []

    def stop_after_two(steps: int, finished: int, total: int) -> bool:
        calls.append((steps, finished, total))
        return len(calls) < 2

    cfg = simulate.__globals__["_config_dict"](config)
    args = simulate.__globals__["_columns"](w)
    raw = _core.simulate(*args, cfg, stop_after_two)
    assert len(calls) == 2 and calls[0][2] == 4
    assert raw["steps"] == calls[-1][0] < 20000

    def boom(steps: int, finished: int, total: int) -> bool:
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        _core.simulate(*args, cfg, boom)
    r = simulate(w, config, progress=True)
    assert r.finished_requests == 4


def test_shared_system_prompts_hit_the_prefix_cache() -> None:
    # 16 system prompts of 1,024 tokens plus unique suffixes of 100-500 tokens.
    rng = np.random.default_rng(7)
    n = 200
    prefix_id = rng.integers(0, 16, size=n)
    suffix = rng.integers(100, 501, size=n)
    w = Workload(
        "system-prompts",
        1024 + suffix,
        rng.integers(10, 200, size=n),
        np.zeros(n),
        prefix_id=prefix_id,
        prefix_tokens=np.full(n, 1024),
    )
    config = SimConfig(num_slots=65_536, max_model_len=2048, check_invariants=True)
    on = simulate(w, SimConfig(**{**config.__dict__, "enable_prefix_caching": True}))
    off = simulate(w, config)
    assert on.finished_requests == off.finished_requests == n
    # Every request after the first of its prefix hits all 64 prefix blocks.
    first_of_prefix = len(set(prefix_id.tolist()))
    assert on.prefix_hit_tokens >= (n - first_of_prefix) * 1024
    assert on.prefix_query_tokens == int(w.prompt_tokens.sum())
    assert on.prefix_hit_rate > 0.6
    assert on.prefill_tokens == int(w.prompt_tokens.sum()) - on.prefix_hit_tokens
    assert off.prefix_hit_tokens == 0 and off.prefill_tokens == int(w.prompt_tokens.sum())
    assert on.mean_used_blocks < off.mean_used_blocks
    assert on.mean_resident_requests >= off.mean_resident_requests


def test_swap_and_recompute_preemption() -> None:
    w = synthetic_workload(200, seed=4)
    base = SimConfig(num_slots=2048, max_model_len=2048, check_invariants=True)
    recompute = simulate(w, base)
    swap = simulate(w, SimConfig(**{**base.__dict__, "preemption": "swap", "num_host_slots": 8192}))
    assert recompute.preemptions > 0 and swap.preemptions > 0
    assert swap.swap_preemptions == swap.preemptions and swap.recomputed_tokens == 0
    assert swap.swapped_out_blocks == swap.swapped_in_blocks > 0
    assert swap.swapped_blocks == 2 * swap.swapped_out_blocks
    assert swap.generated_tokens == recompute.generated_tokens == int(w.output_tokens.sum())
    assert swap.prefill_tokens == int(w.prompt_tokens.sum())
    with pytest.raises(InvalidArgumentError, match="host tier"):
        simulate(w, SimConfig(preemption="swap"))


def test_empty_workload_and_bad_group_kind() -> None:
    empty = Workload("empty", np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0))
    r = simulate(empty, SimConfig())
    assert (r.steps, r.finished_requests, r.free) == (0, 0, 1.0)
    with pytest.raises(InvalidArgumentError, match="unknown group_kind"):
        simulate(
            Workload(
                "g", np.ones(1, dtype=np.int64), np.ones(1, dtype=np.int64), np.zeros(1), group_kind="tree"
            ),
            SimConfig(),
        )
    with pytest.raises(InvalidArgumentError, match="more than any pool holds"):
        simulate(plain([2**40], [1]), SimConfig())
