"""Fuzzing the engine's parameters: every EngineConfig field, SamplingParams field, prompt and
request id drawn from valid values and junk (wrong types, NaN, infinities, denormals, huge and
negative integers, NumPy scalars, masked and float arrays). Each construction either succeeds or
raises ``InvalidArgumentError`` (never another exception); whatever is accepted runs to
completion on the tiny random-weight llama within a step bound, with ``check_invariants()``
after every step and every block free at the end. ``PAGEDKV_FUZZ_EXAMPLES`` scales the budget."""

from __future__ import annotations

import os
from typing import Any

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, event, given, settings
from pagedkv.errors import InvalidArgumentError
from tiny_llama import VOCAB

SCALE = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "1"))

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([5e-324, -0.0, 1e-300, 1.9, 2**63, 2**64, -1, 0]),
    st.text(max_size=3),
    st.binary(max_size=2),
    st.lists(st.integers(-2, 5), max_size=2),
    st.sampled_from([np.int64(3), np.uint8(2), np.float32(0.5), np.float64("nan"), np.bool_(True)]),
)


def _field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # Junk one time in 12 (one_of would merge repeated branches), so that many examples run.
    return st.integers(0, 11).flatmap(lambda k: JUNK if k == 0 else valid)


CONFIG = st.fixed_dictionaries(
    {},
    optional={
        "num_blocks": _field(st.integers(1, 24)),
        "block_size": _field(st.integers(1, 5)),
        "enable_prefix_caching": _field(st.booleans()),
        "num_host_blocks": _field(st.integers(0, 8)),
        "preemption": _field(st.sampled_from(["recompute", "swap"])),
        "max_num_seqs": _field(st.integers(1, 4)),
        "max_num_batched_tokens": _field(st.integers(1, 16)),
        "enable_chunked_prefill": _field(st.booleans()),
        "reservation": _field(st.sampled_from(["paged", "contiguous"])),
        "max_model_len": _field(st.one_of(st.none(), st.integers(2, 40))),
        "admission_watermark_blocks": _field(st.one_of(st.none(), st.integers(0, 3))),
    },
)
PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "n": _field(st.integers(1, 3)),
        "temperature": _field(st.one_of(st.just(0.0), st.floats(0.0, 2.0))),
        "top_k": _field(st.integers(0, 8)),
        "top_p": _field(st.floats(0.01, 1.0)),
        "max_tokens": _field(st.integers(1, 5)),
        "seed": _field(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        "stop": _field(st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=2), max_size=2))),
        "ignore_eos": _field(st.booleans()),
    },
)
VALID_PROMPT = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
JUNK_PROMPT = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12).map(lambda ids: np.array(ids)),
    st.lists(st.one_of(st.integers(-3, VOCAB + 3), JUNK), max_size=4),
    st.lists(st.floats(0, VOCAB), min_size=1, max_size=3).map(lambda xs: np.array(xs)),
    st.just(np.ma.masked_array([1, 2, 3], mask=[0, 1, 0])),
    JUNK,
)
PROMPT = st.integers(0, 5).flatmap(lambda k: JUNK_PROMPT if k == 0 else VALID_PROMPT)
REQUESTS = st.lists(
    st.tuples(PROMPT, PARAMS, _field(st.one_of(st.none(), st.integers(0, 3)))), min_size=1, max_size=4
)


@settings(
    max_examples=150 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(config=CONFIG, requests=REQUESTS)
def test_engine_parameters_are_refused_or_run_to_completion(tiny, config, requests):
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    try:
        engine = LLMEngine(tiny, EngineConfig(**config))
    except InvalidArgumentError:
        event("config refused")
        return
    for prompt, options, request_id in requests:
        try:
            engine.add_request(prompt, SamplingParams(**options), request_id)
        except InvalidArgumentError:
            pass
    event(f"requests accepted: {len(engine.requests)}")
    steps = 0
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_invariants()
        steps += 1
        assert steps < 500, f"no progress: {engine.config}"
    assert len(engine.kv) == 0 and engine.kv.num_free_blocks == engine.config.num_blocks
    for rid in engine.requests:
        assert all(c.finish_reason in ("stop", "length") for c in engine.output(rid).outputs)
