"""Experiments on the real KvCacheManager with exact block counts, and the sweep's crossing."""

import numpy as np
import pagedkv
import pytest
from pagedkv.sim import experiments
from pagedkv.sim.experiments import sharing, sweep


def test_copy_on_write_exact_counts():
    data = experiments.copy_on_write(prompt_tokens=1000, num_samples=4, generated_tokens=100, block_size=16)
    after_fork, after_decode = data["stages"]
    # 1000 tokens = 62 full blocks + 8 tokens: 63 blocks held once, refcount 4.
    assert after_fork["blocks_in_use"] == 63 and after_fork["cache_token_slots"] == 1008
    assert data["first_block_refcount_after_fork"] == 4
    # The shared partial block is copied for 3 samples (the 4th owns it alone by then);
    # each sample then holds 108 own tokens = 7 blocks: 62 + 4 * 7 = 90.
    assert len(data["copy_ops"]) == 3
    assert after_decode["blocks_in_use"] == 90 and after_decode["unshared_blocks"] == 4 * 69


def test_group_usage_by_hand():
    manager = pagedkv.KvCacheManager(num_blocks=16, block_size=16)
    rng = np.random.default_rng(0)
    physical, logical, next_id = sharing._group_block_usage(manager, 32, 1, 2, "parallel", rng, 0, 16, 2.0)
    # Prompt: 2 full shared blocks; one token each starts a new block: 2 + 2 physical, 2 * 3 logical.
    assert (physical, logical, next_id) == (4.0, 6.0, 2)
    assert manager.num_sequences == 0 and manager.stats()["num_blocks_in_use"] == 0


def test_sharing_savings_parallel_below_beam_with_invariants():
    data = experiments.sharing_savings(
        widths=(2, 4), workload_names=("alpaca",), num_requests=6, check_invariants=True
    )
    saved = {(row["kind"], row["width"]): row["blocks_saved"] for row in data["rows"]}
    assert 0 < saved[("parallel", 2)] < saved[("parallel", 4)]
    assert saved[("parallel", 4)] < saved[("beam", 4)]


def test_beam_parents_keep_the_best():
    rng = np.random.default_rng(1)
    parents, scores = sharing._beam_parents(rng, np.array([0.0, -50.0]), 2, 8, 1.0)
    # The second beam is far behind: both survivors descend from the first.
    assert parents.tolist() == [0, 0] and scores[0] >= scores[1]


def test_crossing_interpolates_in_log_space():
    block_size, value = sweep._crossing([4, 16], [2.0, 8.0], [8.0, 2.0])
    assert block_size == pytest.approx(8.0) and value == pytest.approx(4.0)
    assert sweep._crossing([4, 16], [1.0, 2.0], [8.0, 4.0]) is None


def test_attention_check_is_exact_on_scattered_tables():
    data = experiments.attention_check(seq_lens=(5, 40, 70), block_size=8)
    assert data["equal"] and data["rows"][2]["scattered"] and data["rows"][2]["blocks"] == 9
