"""`pagedkv demo`: every section printed, JSON with every section, numbers that tell the story."""

import pytest
from pagedkv.sim import experiments


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
    assert results["vLLM"]["mean_resident_requests"] > results["Orca (Max)"]["mean_resident_requests"]
    assert results["vLLM"]["token_states"] > results["Orca (Max)"]["token_states"]
    stages = data["copy_on_write"]["stages"]
    assert stages[0]["blocks_in_use"] == 63 and stages[0]["unshared_blocks"] == 252
    recovery = data["recovery"]["results"]
    assert recovery["recompute"]["preemptions"] > 0 and recovery["swap"]["preemptions"] > 0
    assert recovery["swap"]["bytes_moved"] > 0 and recovery["recompute"]["bytes_moved"] == 0
    caching = data["prefix_caching"]
    assert caching["hit_rate"] > 0.3 and caching["prefill_tokens_saved"] > 0.3


def test_demo_cli_writes_json_and_plot(run_cli, read_json, tmp_path):
    pytest.importorskip("matplotlib")
    run = run_cli(
        "demo",
        "--num-requests",
        100,
        "--json",
        tmp_path / "d.json",
        "--plot",
        tmp_path / "d.png",
        "--no-progress",
    )
    assert run.code == 0, run.err
    data = read_json(tmp_path / "d.json")
    assert set(experiments.DEMO_SECTIONS) <= set(data)
    assert (tmp_path / "d.png").stat().st_size > 10_000
