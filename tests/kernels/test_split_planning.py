"""The occupancy-aware split planner (pure Python) on the cases that motivated it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.attention.split_planning import (
    SM90,
    ctas_per_sm_from_resources,
    plan_splits,
)

H200_SMS = 132
TILE = 32  # fp16, head_dim 128


@pytest.mark.parametrize(
    "regs,smem,threads,expected",
    [
        (32, 0, 128, 16),  # thread-limited: 2048 / 128
        (64, 0, 128, 8),  # 64 regs x 128 threads = 8192 per CTA
        (128, 0, 128, 4),
        (168, 0, 128, 2),  # 168 -> 5376 per warp (rounded to 256) x 4 warps; 65536 / 21504 = 3.04
        (255, 0, 128, 2),
        (40, 100_000, 128, 2),  # shared-limited: (100000 + 1024) rounded -> 2 per 228 KiB
        (40, 200_000, 128, 1),
        (16, 0, 32, 32),  # the CTA limit
    ],
)
def test_ctas_per_sm_follows_the_occupancy_rules(regs, smem, threads, expected):
    if regs == 168:
        expected = 65536 // (math.ceil(168 * 32 / 256) * 256 * 4)
    assert ctas_per_sm_from_resources(regs, smem, threads, SM90) == expected


def test_group8_batch8_fills_whole_waves():
    """64 CTAs per split (8 sequences x 8 KV heads). The old planner, aiming at 2 x 132 CTAs
    whatever the occupancy, gave 5 splits = 320 CTAs: two waves where one suffices."""
    one_per_sm = plan_splits(64, 4096, TILE, H200_SMS, ctas_per_sm=1)
    assert (one_per_sm.num_splits, one_per_sm.waves) == (2, 1)
    assert one_per_sm.wave_efficiency > 0.96
    two_per_sm = plan_splits(64, 4096, TILE, H200_SMS, ctas_per_sm=2)
    assert (two_per_sm.num_splits, two_per_sm.waves) == (4, 1)
    assert two_per_sm.num_ctas == 256 <= 264


def test_batch1_1k_context_uses_128_token_chunks():
    """Batch 1 x 1K (8 KV heads): the old planner gave 4 splits, 32 CTAs on 132 SMs."""
    plan = plan_splits(8, 1024, TILE, H200_SMS, ctas_per_sm=2)
    assert plan.num_splits == 8 and plan.tokens_per_split == 128 and plan.num_ctas == 64


def test_a_full_machine_is_not_split():
    plan = plan_splits(64 * 8, 4096, TILE, H200_SMS, ctas_per_sm=2)
    assert plan.num_splits == 1 and plan.waves == 2
    # 3.9 waves at one CTA per SM: splitting nine ways would round to 35 waves, under 1 % better
    # in the model, not worth 4608 CTAs and a merge.
    assert plan_splits(64 * 8, 16384, TILE, H200_SMS, ctas_per_sm=1).num_splits == 1


def test_requested_splits_are_honoured_and_capped():
    assert plan_splits(8, 4096, TILE, H200_SMS, 2, requested=5).num_splits == 5
    assert plan_splits(8, 4096, TILE, H200_SMS, 2, requested=500, max_splits=16).num_splits == 16
    # More splits than tiles: no empty trailing split is launched.
    assert plan_splits(8, 40, TILE, H200_SMS, 2, requested=7).num_splits == 2


def test_empty_batch_is_one_split():
    plan = plan_splits(8, 0, TILE, H200_SMS, 2)
    assert plan.num_splits == 1


@settings(max_examples=200, deadline=None)
@given(
    base=st.integers(1, 4096),
    max_seq_len=st.integers(1, 200_000),
    tile=st.sampled_from([16, 32, 64]),
    sms=st.integers(1, 160),
    per_sm=st.integers(1, 16),
    max_splits=st.integers(1, 256),
)
def test_plan_covers_every_token_with_whole_tiles(base, max_seq_len, tile, sms, per_sm, max_splits):
    plan = plan_splits(base, max_seq_len, tile, sms, per_sm, max_splits=max_splits)
    assert 1 <= plan.num_splits <= max_splits
    assert plan.tokens_per_split % tile == 0
    assert plan.num_splits * plan.tokens_per_split >= max_seq_len  # every token in some split
    assert (plan.num_splits - 1) * plan.tokens_per_split < max_seq_len  # no empty split
    assert plan.num_splits == 1 or plan.tokens_per_split >= 128  # chunks down to 128 tokens
    assert plan.waves == math.ceil(plan.num_ctas / plan.slots)
    # The choice is never worse than no split at all under the model.
    assert (
        plan.cost_token_steps
        <= plan_splits(base, max_seq_len, tile, sms, per_sm, requested=1).cost_token_steps
    )
