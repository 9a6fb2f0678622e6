"""Hostile and unlucky input to the engine: configurations, sampling parameters and
prompts are checked when they are made (``InvalidArgumentError``), every accepted configuration
runs to completion, and a request that still fails inside a step finishes with an error status
while the rest of the batch goes on. On the tiny random-weight llama (tests/engine/tiny_llama.py)
except where the default model is named."""

from __future__ import annotations

import itertools

import numpy as np
import pagedkv
import pytest
from pagedkv.errors import InvalidArgumentError
from tiny_llama import VOCAB

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 12], [40, 41]]


def _drain(engine, max_steps: int = 2000):
    steps = 0
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_invariants()
        steps += 1
        assert steps < max_steps, f"no progress after {steps} steps: {engine.config}"
    assert len(engine.kv) == 0 and engine.kv.num_free_blocks == engine.config.num_blocks
    return steps


def _alone(tiny, prompt, params):
    from pagedkv.engine import EngineConfig, LLMEngine

    engine = LLMEngine(tiny, EngineConfig(num_blocks=64, block_size=4))
    rid = engine.add_request(prompt, params)
    _drain(engine)
    return [c.token_ids for c in engine.output(rid).outputs]


# ---- EngineConfig (item 4) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_seqs": 0},
        {"max_num_seqs": -1},
        {"max_num_seqs": 1.5},
        {"max_num_batched_tokens": 0},
        {"max_num_batched_tokens": True},
        {"num_blocks": 0},
        {"num_blocks": 2**24 + 1},
        {"num_blocks": "8"},
        {"block_size": 0},
        {"block_size": 2**31},
        {"num_blocks": 2**20, "block_size": 2**12},  # 2**32 slots: past int32 slot indices
        {"num_host_blocks": -1},
        {"preemption": "swap"},  # no host tier to swap to
        {"preemption": "evict"},
        {"preemption": None},
        {"reservation": "static"},
        {"max_model_len": 1},
        {"max_model_len": 0},
        {"admission_watermark_blocks": -1},
        {"admission_watermark_blocks": 513, "num_blocks": 512},
        {"kv_cache_bytes": 0},
        {"kv_cache_bytes": "1"},
        {"kv_cache_bytes": 1 << 20, "num_blocks": 8},  # one size, not two
        {"enable_prefix_caching": "yes"},
        {"enable_chunked_prefill": 1},
    ],
)
def test_engine_config_refuses(options):
    from pagedkv.engine import EngineConfig

    with pytest.raises(InvalidArgumentError, match="EngineConfig"):
        EngineConfig(**options)


def test_engine_refuses_what_needs_the_model_to_check(tiny):
    from pagedkv.engine import LLM, EngineConfig, LLMEngine

    # The tiny model's context is 256 tokens: a contiguous reservation of 256 slots in a pool of
    # 64 admitted nothing, forever.
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        LLMEngine(tiny, EngineConfig(num_blocks=16, block_size=4, reservation="contiguous"))
    LLMEngine(tiny, EngineConfig(num_blocks=16, block_size=4, reservation="contiguous", max_model_len=64))
    # 2**24 blocks of 64 tokens at 256 bytes per token: 256 GiB, refused before allocating.
    with pytest.raises(InvalidArgumentError, match="GiB"):
        LLMEngine(tiny, EngineConfig(num_blocks=2**24, block_size=64))
    with pytest.raises(InvalidArgumentError):
        LLM(tiny, num_block=8)  # a misspelt keyword
    with pytest.raises(InvalidArgumentError):
        LLMEngine(tiny, {"num_blocks": 8})  # type: ignore[arg-type]


def _grid():
    """Every combination of the knobs at their edges (tiny pools, budgets of one token, one
    sequence at a time, both policies, both reservations), as (options, accepted) pairs."""
    for values in itertools.product(
        [1, 3, 12],  # num_blocks
        [1, 2, 4],  # block_size
        [False, True],  # enable_prefix_caching
        [("recompute", 0), ("swap", 1), ("swap", 16)],  # preemption, num_host_blocks
        [1, 3],  # max_num_seqs
        [1, 2, 64],  # max_num_batched_tokens
        [False, True],  # enable_chunked_prefill
        ["paged", "contiguous"],
        [None, 2, 12],  # max_model_len
        [None, 0, 12],  # admission_watermark_blocks
    ):
        blocks, bs, prefix, (preemption, host), seqs, budget, chunked, reservation, mml, mark = values
        yield {
            "num_blocks": blocks,
            "block_size": bs,
            "enable_prefix_caching": prefix,
            "preemption": preemption,
            "num_host_blocks": host,
            "max_num_seqs": seqs,
            "max_num_batched_tokens": budget,
            "enable_chunked_prefill": chunked,
            "reservation": reservation,
            "max_model_len": mml,
            "admission_watermark_blocks": mark,
        }


def test_every_accepted_configuration_runs_to_completion(tiny):
    """A sample of the grid (every edge value appears many times; the whole grid is 23,328
    configurations): each is refused at construction or runs every request it accepts to the
    end within a step bound, with the invariants after every step and every block free."""
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    grid = list(_grid())
    rng = np.random.default_rng(28)
    chosen = [grid[i] for i in rng.choice(len(grid), size=500, replace=False)]
    accepted = ran = 0
    seen: set[tuple[str, object]] = set()
    for options in chosen:
        try:
            engine = LLMEngine(tiny, EngineConfig(**options))
        except InvalidArgumentError:
            continue
        accepted += 1
        seen.update(options.items())
        for prompt, n in zip(PROMPTS, (2, 1, 3), strict=True):
            try:
                engine.add_request(prompt, SamplingParams(n=n, max_tokens=4, ignore_eos=True))
            except InvalidArgumentError:
                pass  # can never fit this pool or context: refused, nothing queued
        ran += bool(engine.requests)
        _drain(engine, max_steps=500)
        for rid in engine.requests:
            assert all(c.finish_reason == "length" for c in engine.output(rid).outputs)
    assert accepted > 200 and ran > 100, (accepted, ran)
    # Every edge value of every knob ran in some accepted configuration.
    assert {pair for options in grid for pair in options.items()} == seen


def test_the_configurations_that_spun_forever_are_refused(tiny):
    from pagedkv.engine import EngineConfig, LLMEngine

    for options in ({"max_num_seqs": 0}, {"max_num_batched_tokens": 0}, {"preemption": "bogus"}):
        with pytest.raises(InvalidArgumentError):
            EngineConfig(**options)
    with pytest.raises(InvalidArgumentError):
        LLMEngine(tiny, EngineConfig(num_blocks=4, block_size=4, reservation="contiguous", max_model_len=17))


# ---- SamplingParams (item 5) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": -1e-9},
        {"temperature": 101.0},
        {"temperature": "0.5"},
        {"temperature": True},
        {"temperature": 10**400},
        {"top_p": 0.0},
        {"top_p": 1.0000001},
        {"top_p": float("nan")},
        {"top_k": -1},
        {"top_k": 2.0},
        {"n": 0},
        {"n": 1.0},
        {"n": True},
        {"max_tokens": 0},
        {"max_tokens": "16"},
        {"seed": -1},
        {"seed": 2**64},
        {"seed": 1.5},
        {"stop": ("",)},
        {"stop": (b"x",)},
        {"stop": 5},
        {"stop": ("\ud800",)},
        {"ignore_eos": "no"},
    ],
)
def test_sampling_params_refuse(options):
    from pagedkv.engine import SamplingParams

    with pytest.raises(InvalidArgumentError, match="SamplingParams"):
        SamplingParams(**options)


def test_sampling_params_normalize():
    from pagedkv.engine import SamplingParams

    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), seed=np.uint64(7), top_p=1)
    assert (type(p.n), type(p.temperature), type(p.seed), type(p.top_p)) == (int, float, int, float)


def test_a_denormal_temperature_samples_the_argmax(tiny):
    """temperature=5e-324 passed validation and made step() raise after the forward pass (inf -
    inf in the scaled logits), wedging its batch. It is a valid temperature: the argmax."""
    from pagedkv.engine import SamplingParams

    for prompt in PROMPTS:
        tiny_t = _alone(tiny, prompt, SamplingParams(temperature=5e-324, seed=3, max_tokens=5))
        assert tiny_t == _alone(tiny, prompt, SamplingParams(max_tokens=5))


def test_a_failing_request_finishes_with_an_error_and_the_batch_goes_on(tiny, monkeypatch):
    """A request whose sampling raises inside a step (forced here: every parameter that could
    cause it is now refused up front) is finished with finish_reason "error", the error kept on
    its output and its stream event, its blocks freed; the innocent requests batched with it
    generate what they generate alone."""
    import pagedkv.engine.llm_engine as llm_engine
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    real = llm_engine.sample_token

    def poisoned(logits, params, rng):
        if params.seed == 666:
            raise FloatingPointError("poisoned")
        return real(logits, params, rng)

    innocent = SamplingParams(max_tokens=6)
    expected = [_alone(tiny, p, innocent) for p in PROMPTS]
    monkeypatch.setattr(llm_engine, "sample_token", poisoned)
    for n in (1, 3):
        engine = LLMEngine(tiny, EngineConfig(num_blocks=32, block_size=2, enable_prefix_caching=True))
        bad = SamplingParams(n=n, temperature=0.7, seed=666, max_tokens=6)
        rids = [engine.add_request(p, innocent) for p in PROMPTS]
        poison = engine.add_request(PROMPTS[0], bad)
        events = []
        steps = 0
        while engine.has_unfinished():
            events += engine.step()
            engine.kv.check_invariants()
            steps += 1
            assert steps < 200
        assert len(engine.kv) == 0 and engine.kv.num_free_blocks == 32
        assert [[c.token_ids for c in engine.output(r).outputs] for r in rids] == expected
        out = engine.output(poison)
        assert [c.finish_reason for c in out.outputs] == ["error"] * n
        assert out.error == "FloatingPointError: poisoned"
        failed = [e for e in events if e.request_id == poison]
        assert [(e.finish_reason, e.token_id, e.error) for e in failed] == [("error", -1, out.error)] * n
        assert engine.stats.failed_requests == 1


# ---- prompts and request ids (minor items) -------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    [
        [5, float("nan")],
        [5, None],
        [1.9, 2],
        ["5"],
        [True, 3],
        [5, 6.0],
        np.array([5.0, 6.0]),
        np.array([[5, 6]]),
        np.ma.masked_array([5, 6, 7], mask=[0, 1, 0]),
        np.array(["5"]),
        "56",
        [],
        [VOCAB],
        [-1],
        [2**70],
        5,
        None,
    ],
)
def test_prompts_must_be_real_integers(tiny, prompt):
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(tiny, EngineConfig(num_blocks=16, block_size=4))
    with pytest.raises(InvalidArgumentError):
        engine.add_request(prompt, SamplingParams())
    assert not engine.has_unfinished() and not engine.requests


def test_integer_prompts_of_every_kind_are_taken(tiny):
    from pagedkv.engine import LLM, EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(tiny, EngineConfig(num_blocks=16, block_size=4))
    for prompt in ([5, 6, 7], (5, 6, 7), np.array([5, 6, 7], np.int32), [np.int64(5), np.uint8(6), 7]):
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    _drain(engine)
    assert len({tuple(engine.output(r).outputs[0].token_ids) for r in engine.requests}) == 1
    llm = LLM(tiny, num_blocks=16, block_size=4)
    one = llm.generate(np.array([5, 6, 7]), SamplingParams(max_tokens=2))
    assert one[0].outputs[0].token_ids == engine.output(0).outputs[0].token_ids
    with pytest.raises(InvalidArgumentError):
        llm.generate([[5, 6], [1.9]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgumentError):
        llm.generate([5, 1.9], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("request_id", ["7", 1.5, True, -1, 2**63, None.__class__])
def test_request_ids_must_be_integers(tiny, request_id):
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(tiny, EngineConfig(num_blocks=16, block_size=4))
    with pytest.raises(InvalidArgumentError, match="request_id"):
        engine.add_request([5, 6], SamplingParams(), request_id=request_id)
    with pytest.raises(InvalidArgumentError, match="SamplingParams"):
        engine.add_request([5, 6], {"max_tokens": 2})  # type: ignore[arg-type]
    assert not engine.requests
    assert engine.add_request([5, 6], SamplingParams(), request_id=7) == 7


def test_every_stall_is_reported_not_spun(tiny):
    """The engine's last line of defence: a step that cannot make progress (forced here by
    stealing every block) raises after a bounded number of steps instead of spinning forever."""
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(tiny, EngineConfig(num_blocks=4, block_size=4))
    # A thief outside the engine holds the pool (past the admission watermark the engine sets).
    engine.kv.add_sequence(10**6, np.arange(16), apply_watermark=False)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(pagedkv.InvariantViolation, match="no progress"):
        for _ in range(10):
            engine.step()


def test_a_request_the_allocator_refuses_at_admission_fails_alone(tiny):
    """An admission that fails for a reason of the request's own (a typed allocator error other
    than a lack of blocks, forced here through a proxy) finishes that request with an error; the
    others run as they run alone."""
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    class RefusingKv:
        def __init__(self, kv, refused_seq_id):
            self._kv, self._refused = kv, refused_seq_id

        def add_sequence(self, seq_id, tokens, **kwargs):
            if seq_id == self._refused:
                raise InvalidArgumentError("refused by the test")
            return self._kv.add_sequence(seq_id, tokens, **kwargs)

        def __contains__(self, seq_id):
            return seq_id in self._kv

        def __getattr__(self, name):
            return getattr(self._kv, name)

    params = SamplingParams(max_tokens=4)
    expected = [_alone(tiny, p, params) for p in PROMPTS]
    engine = LLMEngine(tiny, EngineConfig(num_blocks=32, block_size=2))
    rids = [engine.add_request(p, params) for p in PROMPTS]
    bad = engine.add_request(PROMPTS[1], SamplingParams(n=2, max_tokens=4))
    engine.scheduler.kv = RefusingKv(engine.kv, engine.requests[bad].sequences[0].seq_id)
    _drain(engine)
    assert [[c.token_ids for c in engine.output(r).outputs] for r in rids] == expected
    out = engine.output(bad)
    assert [c.finish_reason for c in out.outputs] == ["error"]
    assert out.error == "InvalidArgumentError: refused by the test"


def test_a_failed_pass_fails_its_requests_and_leaves_no_unwritten_block_hittable(tiny):
    """The watermark moves when a chunk is scheduled. A pass that raises wrote none of its K/V:
    its requests fail, and their blocks leave the prefix index, so that a later request with the
    same prefix computes it rather than attending over K/V that were never written (it would
    hit 8 tokens of zeros and stale data)."""
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(max_tokens=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    engine = LLMEngine(tiny, EngineConfig(num_blocks=32, block_size=4))
    execute = engine.runner.execute

    def failing(batch):
        engine.runner.execute = execute  # only this pass fails
        raise RuntimeError("the device fell over")

    engine.runner.execute = failing
    failed = engine.add_request(prompt, params)
    engine.step()
    engine.kv.check_invariants()
    assert engine.output(failed).error == "RuntimeError: the device fell over"
    assert engine.kv.match_prefix(prompt) == 0
    later = engine.add_request(prompt + [14], params)
    _drain(engine)
    assert [c.token_ids for c in engine.output(later).outputs] == _alone(tiny, prompt + [14], params)


def test_the_pool_is_sized_in_bytes(tiny):
    """``EngineConfig(kv_cache_bytes=...)``: as many blocks as the bytes hold, by the engine's
    byte accounting (an int4 cache's residual slots set aside first); the default holds
    DEFAULT_FULL_CONTEXTS sequences at the model's full context; a budget holding no block is
    refused; ``num_blocks`` is still taken as given."""
    from pagedkv.engine import EngineConfig, LLMEngine
    from pagedkv.engine.kv_budget import (
        DEFAULT_FULL_CONTEXTS,
        blocks_for_budget,
        full_context_blocks,
        pool_block_bytes,
    )

    default = LLMEngine(tiny, EngineConfig(block_size=4))
    c = tiny.config
    blocks = full_context_blocks(default.layout, 4, default.max_model_len, 256)
    assert default.config.num_blocks == DEFAULT_FULL_CONTEXTS * blocks
    assert default.config.kv_cache_bytes is None
    per_block = pool_block_bytes(default.layout, 4, c.num_kv_heads, c.head_dim, "float32")
    assert default.kv_cache_bytes == default.config.num_blocks * per_block
    sized = LLMEngine(tiny, EngineConfig(block_size=4, kv_cache_bytes=10 * per_block + per_block // 2))
    assert sized.config.num_blocks == 10 and sized.kv_cache_bytes == 10 * per_block + per_block // 2
    budget = 1 << 20
    int4 = LLMEngine(
        tiny, EngineConfig(block_size=4, kv_cache_bytes=budget, kv_cache_dtype="int4", max_num_seqs=3)
    )
    want = blocks_for_budget(budget, int4.layout, 4, c.num_kv_heads, c.head_dim, "int4", max_num_seqs=3)
    assert int4.config.num_blocks == want
    with pytest.raises(InvalidArgumentError, match="kv_cache_bytes"):
        LLMEngine(tiny, EngineConfig(block_size=4, kv_cache_bytes=per_block - 1))
    assert LLMEngine(tiny, EngineConfig(num_blocks=7, block_size=4)).config.num_blocks == 7
