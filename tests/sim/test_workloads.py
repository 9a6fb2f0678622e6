"""Synthetic workloads: seeded, within the model length, with the requested means and shapes."""

import numpy as np
import pytest
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import workloads


def _check_valid(workload, max_model_len):
    prompt, output, arrival = workload.prompt_tokens, workload.output_tokens, workload.arrival_s
    assert prompt.dtype == np.int64 and output.dtype == np.int64 and arrival.dtype == np.float64
    assert prompt.shape == output.shape == arrival.shape
    assert prompt.min() >= 1 and output.min() >= 1
    assert (prompt + output).max() <= max_model_len
    assert arrival[0] == 0.0 and np.all(np.diff(arrival) >= 0)


@pytest.mark.parametrize("name", workloads.WORKLOAD_NAMES)
def test_every_named_workload_is_valid_and_seeded(name):
    first = workloads.make_workload(name, num_requests=300, seed=7)
    again = workloads.make_workload(name, num_requests=300, seed=7)
    other = workloads.make_workload(name, num_requests=300, seed=8)
    _check_valid(first, 2048)
    assert np.array_equal(first.prompt_tokens, again.prompt_tokens)
    assert np.array_equal(first.output_tokens, again.output_tokens)
    assert not np.array_equal(first.prompt_tokens, other.prompt_tokens)


def test_synthetic_is_mostly_short_with_a_few_long():
    workload = workloads.synthetic(4000, seed=1)
    output = workload.output_tokens
    short_share = np.mean(output <= 64)
    long_share = np.mean(output >= 256)
    assert 0.87 < short_share < 0.93
    assert 0.07 < long_share < 0.13
    assert short_share + long_share == pytest.approx(1.0)


def test_synthetic_scales_down_to_a_short_model_length():
    _check_valid(workloads.synthetic(500, max_model_len=256), 256)


@pytest.mark.parametrize(
    "prompt_mean, output_mean, sigma", [(161, 338, 1.0), (50, 900, 0.5), (19.31, 58.45, 0.3)]
)
def test_lognormal_hits_requested_means_after_clipping(prompt_mean, output_mean, sigma):
    workload = workloads.lognormal(
        5000,
        prompt_mean_tokens=prompt_mean,
        output_mean_tokens=output_mean,
        prompt_sigma=sigma,
        output_sigma=sigma,
        seed=3,
    )
    _check_valid(workload, 2048)
    assert workload.prompt_tokens.mean() == pytest.approx(prompt_mean, rel=2e-3)
    assert workload.output_tokens.mean() == pytest.approx(output_mean, rel=2e-3)


def test_lognormal_without_spread_is_constant():
    workload = workloads.lognormal(
        100, prompt_mean_tokens=120, output_mean_tokens=30, prompt_sigma=0, output_sigma=0
    )
    assert set(workload.prompt_tokens.tolist()) == {120} and set(workload.output_tokens.tolist()) == {30}


def test_lognormal_spread_controls_the_tail():
    narrow = workloads.lognormal(
        5000, prompt_mean_tokens=200, output_mean_tokens=200, prompt_sigma=0.1, output_sigma=0.1
    )
    wide = workloads.lognormal(
        5000, prompt_mean_tokens=200, output_mean_tokens=200, prompt_sigma=1.2, output_sigma=1.2
    )
    assert np.std(wide.output_tokens) > 5 * np.std(narrow.output_tokens)


def test_sharegpt_like_has_the_paper_means():
    workload = workloads.sharegpt_like(2000, seed=0)
    assert workload.prompt_tokens.mean() == pytest.approx(161, rel=2e-3)
    assert workload.output_tokens.mean() == pytest.approx(338, rel=2e-3)


def test_system_prompt_workload_shares_prefixes():
    workload = workloads.system_prompt(800, seed=2)
    _check_valid(workload, 2048)
    assert set(np.unique(workload.prefix_id)) == set(range(16))
    assert np.all(workload.prefix_tokens == 1024)
    suffix = workload.prompt_tokens - workload.prefix_tokens
    assert suffix.min() >= 100 and suffix.max() <= 500


def test_system_prompt_rejects_what_cannot_fit():
    with pytest.raises(InvalidArgumentError, match="exceeds max_model_len"):
        workloads.system_prompt(10, max_model_len=1500)


def test_groups_keep_requests_and_mark_the_kind():
    base = workloads.synthetic(50)
    beam = workloads.with_groups(base, 4, "beam")
    assert beam.group_kind == "beam" and np.all(beam.group_size == 4)
    assert np.array_equal(beam.prompt_tokens, base.prompt_tokens)
    with pytest.raises(InvalidArgumentError):
        workloads.with_groups(base, 0, "parallel")
    with pytest.raises(InvalidArgumentError):
        workloads.with_groups(base, 2, "sideways")


@pytest.mark.parametrize("kwargs", [dict(num_requests=0), dict(max_model_len=1), dict(num_requests=2.5)])
def test_bad_parameters_are_typed_errors(kwargs):
    with pytest.raises(InvalidArgumentError):
        workloads.make_workload("synthetic", **kwargs)


def test_unknown_workload_names_the_choices():
    with pytest.raises(InvalidArgumentError, match="synthetic"):
        workloads.make_workload("shakespeare")


def test_describe_summarises():
    summary = workloads.describe(workloads.system_prompt(100))
    assert summary["requests"] == 100 and summary["distinct_prefixes"] <= 16
    assert summary["prompt_tokens_p50"] >= 1124
