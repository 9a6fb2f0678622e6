"""Workload and config builders: the settings of the command line as typed keyword arguments."""

import numpy as np
import pytest
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import builders, names
from pagedkv.sim.engine import SimConfig

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_synthetic_workloads_are_seeded_and_bounded():
    first = builders.build_workload("sharegpt", num_requests=50, seed=3, max_model_len=512)
    again = builders.build_workload("sharegpt", num_requests=50, seed=3, max_model_len=512)
    np.testing.assert_array_equal(first.prompt_tokens, again.prompt_tokens)
    assert first.num_requests == 50
    assert int((first.prompt_tokens + first.output_tokens).max()) <= 512


def test_a_trace_is_cut_to_num_requests_and_its_attribution_noted(tmp_path):
    path = tmp_path / "azure_llm_mine.csv"
    path.write_text(HEADER + "0,10,4\n1,20,5\n2,30,6\n", encoding="utf-8")
    notes = []
    workload = builders.build_workload(str(path), num_requests=2, on_note=notes.append)
    assert workload.prompt_tokens.tolist() == [10, 20] and workload.arrival_s.tolist() == [0.0, 1.0]
    assert notes == [builders.traces.AZURE_ATTRIBUTION]


def test_groups_and_their_exclusion():
    grouped = builders.build_workload("synthetic", num_requests=5, beam_width=3)
    assert grouped.group_kind == "beam" and grouped.group_size.tolist() == [3] * 5
    with pytest.raises(InvalidArgumentError, match="exclude each other"):
        builders.build_workload("synthetic", num_requests=5, beam_width=3, parallel_samples=2)
    with pytest.raises(InvalidArgumentError, match="expected one of synthetic"):
        builders.build_workload("wikipedia")


def test_config_defaults():
    workload = builders.build_workload("synthetic", num_requests=5)
    config = builders.build_config(workload, synthetic=True, preemption="swap", num_slots=4096)
    assert isinstance(config, SimConfig)
    assert config.max_model_len == builders.DEFAULT_MAX_MODEL_LEN and config.num_host_slots == 4096
    assert config.poisson_rate == SimConfig().poisson_rate
    assert builders.build_config(workload, synthetic=True, poisson_rate_per_s=2.5).poisson_rate == 2.5
    long_trace = builders.build_workload("synthetic", num_requests=5)
    long_trace = type(long_trace)("t", np.array([5000]), np.array([100]), np.zeros(1))
    assert builders.build_config(long_trace, synthetic=False).max_model_len == 5100
    assert builders.build_config(long_trace, synthetic=True).max_model_len == 2048
    with pytest.raises(InvalidArgumentError, match="num_host_slots"):
        builders.build_config(workload, synthetic=True, num_host_slots=-1)


def test_one_list_of_names():
    from pagedkv.sim import engine, workloads
    from pagedkv.viz import record

    assert engine.ALLOCATORS is names.ALLOCATORS and record.KNOWN_ALLOCATORS is names.ALLOCATORS
    assert workloads.WORKLOAD_NAMES is names.SYNTHETIC_WORKLOADS
    assert set(names.ALLOCATOR_LABELS) == set(names.ALLOCATORS)
    assert all(label.startswith(name) for name, label in names.ALLOCATOR_LABELS.items())
