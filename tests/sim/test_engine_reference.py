"""The Rust engine agrees step for step with a plain-Python reference of the paged replay."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.sim.engine import SimConfig, Workload, simulate
from reference_model import replay_paged


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200)), min_size=1, max_size=40),
    block_size=st.sampled_from([1, 2, 3, 8, 16, 32]),
    extra_slots=st.integers(0, 3000),
    max_num_seqs=st.integers(1, 64),
    watermark=st.sampled_from([0.0, 0.01, 0.1]),
)
def test_paged_replay_matches_reference(lengths, block_size, extra_slots, max_num_seqs, watermark) -> None:
    prompt = np.array([p for p, _ in lengths], dtype=np.int64)
    output = np.array([o for _, o in lengths], dtype=np.int64)
    longest = int((prompt + output).max())
    num_slots = ((longest + block_size - 1) // block_size) * block_size + extra_slots
    config = SimConfig(
        block_size=block_size,
        num_slots=num_slots,
        max_model_len=longest,
        max_num_seqs=max_num_seqs,
        watermark=watermark,
        check_invariants=True,
    )
    got = simulate(Workload("h", prompt, output, np.zeros(len(lengths))), config)
    ref = replay_paged(
        prompt,
        output,
        block_size=block_size,
        num_slots=num_slots,
        max_num_seqs=max_num_seqs,
        watermark=watermark,
    )
    assert got.steps == ref.steps
    assert got.preemptions == ref.preemptions
    assert got.finished_requests == ref.finished_requests == len(lengths)
    assert got.generated_tokens == ref.generated_tokens
    assert got.prefill_tokens == ref.prefill_tokens
    assert got.finished_request_ids.tolist() == ref.finished_order
    slot_steps = ref.steps * num_slots
    assert got.token_states == ref.token_slots / slot_steps
    assert got.reserved == ref.reserved_slots / slot_steps
    assert got.internal_fragmentation == ref.internal_slots / slot_steps
    assert got.free == ref.free_slots / slot_steps
