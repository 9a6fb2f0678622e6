"""The demo experiment: every section printed, numbers that tell the story."""

import pytest
from pagedkv.sim import experiments
from pagedkv.sim.names import ALLOCATOR_LABELS


@pytest.fixture(scope="module")
def demo_data():
    lines = []
    data = experiments.demo(out=lines.append, progress=False, num_requests=200)
    return data, "\n".join(lines)


def test_every_section_is_printed(demo_data):
    _, text = demo_data
    for marker in (
        "(a) paged attention equals contiguous attention",
        "(b) one workload, identical memory",
        "(c) block-size sweep",
        "(d) copy-on-write",
        "(e) exhaustion and recovery",
        "(f) prefix caching",
        "Demo done in",
    ):
        assert marker in text


def test_demo_numbers(demo_data):
    data, _ = demo_data
    assert set(experiments.DEMO_SECTIONS) <= set(data)
    assert data["attention"]["equal"]
    results = data["allocators"]["results"]
    assert (
        results[ALLOCATOR_LABELS["paged"]]["mean_resident_requests"]
        > results[ALLOCATOR_LABELS["contiguous-max"]]["mean_resident_requests"]
    )
    assert (
        results[ALLOCATOR_LABELS["paged"]]["token_states"]
        > results[ALLOCATOR_LABELS["contiguous-max"]]["token_states"]
    )
    stages = data["copy_on_write"]["stages"]
    assert stages[0]["blocks_in_use"] == 63 and stages[0]["unshared_blocks"] == 252
    recovery = data["recovery"]["results"]
    assert recovery["recompute"]["preemptions"] > 0 and recovery["swap"]["preemptions"] > 0
    assert recovery["swap"]["bytes_moved"] > 0 and recovery["recompute"]["bytes_moved"] == 0
    caching = data["prefix_caching"]
    assert caching["hit_rate"] > 0.3 and caching["prefill_tokens_saved"] > 0.3
