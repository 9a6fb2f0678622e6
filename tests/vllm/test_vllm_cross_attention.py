"""Cross-attention groups (encoder-decoder models such as Whisper) on pagedkv's vLLM manager:
the encoder blocks of a request are allocated once at its admission from the decoder's pool,
never cached, freed with it (docs/integrations/vllm.md, Cross-attention).

Every scenario runs the same calls on vLLM's own manager and on pagedkv's and compares, after
every call: the answer (refused, or the new blocks per group), the free blocks, the usage and
every request's blocks per group (``get_block_ids`` and the coordinator's ``req_to_blocks``,
which vLLM's tests read); pagedkv's ``check_invariants`` runs after every call (the encoder
core's tables, and every pool block free or in exactly one table). The scheduler differential
drives vLLM's scheduler, set up as vLLM's own encoder-decoder tests set it up, on both
managers with a pool small enough to preempt. Runs in the vLLM stage (scripts/vllm/stage.sh).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.kv_cache_manager")

BS = 4


def _config(layout: str, num_blocks: int, cross_dtype: Any = None) -> Any:
    """A KV-cache config of one group per letter of ``layout``: f full attention (the
    decoder's self-attention), c cross-attention, s sliding window."""
    import torch
    from vllm.v1.kv_cache_interface import (
        CrossAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    shape = dict(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    specs = {
        "f": lambda: FullAttentionSpec(**shape),
        "c": lambda: CrossAttentionSpec(**{**shape, "dtype": cross_dtype or torch.float32}),
        "s": lambda: SlidingWindowSpec(**shape, sliding_window=8),
    }
    groups = [KVCacheGroupSpec([f"{k}.{i}"], specs[k]()) for i, k in enumerate(layout)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _request(rid: str, prompt_len: int, encoder_len: int) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    features = None
    if encoder_len:
        features = [
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(),
                mm_position=PlaceholderRange(offset=0, length=encoder_len),
                identifier=f"enc-{rid}",
                modality="audio",
            )
        ]
    tokens = [3 + (hash(rid) + i) % 500 for i in range(prompt_len)]
    return Request(rid, tokens, SamplingParams(max_tokens=64), None, mm_features=features)


class _Run:
    """One manager (vLLM's or pagedkv's) driven by a scenario, noting what both must agree on."""

    def __init__(self, kind: str, layout: str, num_blocks: int, watermark: float, max_model_len: int) -> None:
        from pagedkv.integrations.vllm import KVCacheManager
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

        cls = VllmKVCacheManager if kind == "vllm" else KVCacheManager
        self.m = cls(
            _config(layout, num_blocks),
            max_model_len=max_model_len,
            scheduler_block_size=BS,
            hash_block_size=BS,
            enable_caching=False,
            watermark=watermark,
        )
        self.kind = kind
        self.requests: dict[str, Any] = {}
        self.waiting: dict[str, Any] = {}  # refused or preempted, for their next admission
        self.encoder: dict[str, int] = {}
        self.seen: list[Any] = []

    def note(self, what: str, answer: Any) -> None:
        m = self.m
        views = m.coordinator.single_type_managers
        held = {
            rid: (
                tuple(len(ids) for ids in m.get_block_ids(rid)),
                tuple(len(v.req_to_blocks.get(rid, [])) for v in views),
                tuple(len(ids) for ids in m.get_block_ids_for_computed_tokens(rid, r.num_computed_tokens)),
            )
            for rid, r in sorted(self.requests.items())
        }
        self.seen.append((what, answer, m.block_pool.get_num_free_blocks(), round(m.usage, 9), held))
        if self.kind == "pagedkv":
            m.check_invariants()

    def admit(
        self,
        rid: str,
        prompt_len: int,
        encoder_len: int,
        *,
        full: bool = True,
        scheduled: bool = True,
        lookahead: int = 0,
    ) -> bool:
        """The scheduler's admission of a waiting request; False when refused."""
        from vllm.v1.request import RequestStatus

        request = self.waiting.pop(rid, None) or _request(rid, prompt_len, encoder_len)
        self.encoder[rid] = encoder_len
        got = self.m.allocate_slots(
            request,
            request.num_tokens,
            num_lookahead_tokens=lookahead,
            num_encoder_tokens=encoder_len,
            full_sequence_must_fit=full,
            has_scheduled_reqs=scheduled,
        )
        answer = None if got is None else tuple(len(ids) for ids in got.get_block_ids())
        if got is not None:
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = request.num_tokens
            request.append_output_token_ids(7)
            self.requests[rid] = request
        else:
            self.waiting[rid] = request
        self.note(f"admit {rid} ({prompt_len} + encoder {encoder_len})", answer)
        return got is not None

    def step(self, rid: str, lookahead: int = 0) -> bool:
        """A decode step of a running request; refused: it is preempted (freed, to wait)."""
        from vllm.v1.request import RequestStatus

        request = self.requests[rid]
        got = self.m.allocate_slots(request, 1, num_lookahead_tokens=lookahead)
        answer = None if got is None else tuple(len(ids) for ids in got.get_block_ids())
        if got is None:
            self.m.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            del self.requests[rid]
            self.waiting[rid] = request
        else:
            request.num_computed_tokens += 1
            request.append_output_token_ids(8)
        self.note(f"step {rid}", answer)
        return got is not None

    def finish(self, rid: str) -> None:
        self.m.free(self.requests.pop(rid))
        self.note(f"finish {rid}", None)

    def reset(self) -> None:
        self.note("reset_prefix_cache", self.m.reset_prefix_cache())


def _same(scenario: Callable[[_Run], None], layout: str = "fc", num_blocks: int = 20, **kw: Any) -> list[Any]:
    args = dict(watermark=kw.get("watermark", 0.0), max_model_len=kw.get("max_model_len", 64))
    runs = {kind: _Run(kind, layout, num_blocks, **args) for kind in ("vllm", "pagedkv")}
    for run in runs.values():
        scenario(run)
    for a, b in zip(runs["vllm"].seen, runs["pagedkv"].seen, strict=True):
        assert b == a
    return runs["pagedkv"].seen


def test_encoder_blocks_counted_with_the_decoders() -> None:
    """Encoder blocks come from the decoder's pool: they count in the free blocks, the usage
    and vLLM's admission check (decoder + encoder + watermark); a refusal changes nothing;
    a request without encoder inputs holds none; freeing returns them."""

    def scenario(run: _Run) -> None:
        assert run.admit("a", 6, 17)  # 2 decoder + 5 encoder blocks
        assert run.admit("text", 5, 0)  # no encoder inputs: no cross-attention block
        assert not run.admit("big", 4, 40)  # 1 + 10 blocks, 10 free: refused whole
        assert run.admit("b", 4, 24)  # 1 + 6 of 10
        assert not run.admit("c", 4, 9)  # 1 + 3 of 3
        assert run.admit("d", 4, 8)  # 1 + 2 of 3: the pool's last blocks
        run.step("a")
        run.reset()  # blocks held: refused, as vLLM's
        run.finish("a")
        assert run.admit("big", 4, 40) is False  # 1 + 10 of 7 free
        run.finish("d")
        run.finish("b")
        assert run.admit("big", 4, 40)
        run.finish("big")
        run.finish("text")
        run.reset()

    seen = _same(scenario)
    # The encoder blocks are in vLLM's count: "a" holds 2 + 5.
    assert seen[0][4]["a"][0] == (2, 5)


@pytest.mark.parametrize("layout", ["fc", "cf", "fcc", "ffc", "cfc"])
def test_group_layouts(layout: str) -> None:
    """Cross-attention groups before, between and after decoder groups, one or two: every
    group's blocks where vLLM has them."""

    def scenario(run: _Run) -> None:
        run.admit("a", 9, 13)
        run.admit("b", 3, 0)
        for _ in range(4):
            run.step("a")
        if not run.admit("c", 5, 70):  # refused with "a" held (more groups, more blocks)
            run.finish("a")
            run.admit("c", 5, 70)
        if "c" in run.requests:
            run.step("c")

    _same(scenario, layout=layout, num_blocks=40)


def test_watermark_and_chunk_only_admission() -> None:
    """The watermark counts against the encoder blocks too (waiting requests while others
    run), and the chunk-only admission (``scheduler_reserve_full_isl=False``) checks the chunk
    plus the encoder blocks."""

    def scenario(run: _Run) -> None:
        run.admit("a", 4, 8, scheduled=False)
        # 26 blocks free once "a" holds 3, 6 of them the watermark: encoder sizes whose
        # admissions fit without the watermark and not with it, then not at all.
        for n in range(16, 28):
            run.admit(f"w{n}", 4, n * BS - 1, scheduled=True)
            run.admit(f"x{n}", 4, n * BS - 1, scheduled=False, full=False, lookahead=2)
            for rid in [r for r in run.requests if r != "a"]:
                run.finish(rid)

    _same(scenario, num_blocks=30, watermark=0.2)


def test_zeroing_gets_the_encoder_blocks() -> None:
    """With KV-cache zeroing (a mixed-precision cache), the new blocks to zero include the
    encoder's, as vLLM's cross-attention manager records them."""
    import torch

    def scenario(run: _Run) -> None:
        run.m = type(run.m)(
            _config("fc", 30, cross_dtype=torch.float16),
            max_model_len=64,
            scheduler_block_size=BS,
            hash_block_size=BS,
            enable_caching=False,
        )
        assert run.m.kv_cache_config.needs_kv_cache_zeroing
        for rid, (p, e) in {"a": (6, 9), "b": (3, 0), "c": (9, 30)}.items():
            run.admit(rid, p, e)
            new = run.m.take_new_block_ids()
            held = sorted(b for ids in run.m.get_block_ids(rid) for b in ids)
            run.note(f"zero {rid}", (len(new), sorted(new) == held))
        run.step("a")
        run.note("zero step", len(run.m.take_new_block_ids()))

    _same(scenario)


def test_preemption_frees_and_readmission_reallocates() -> None:
    """A decode step refused for want of blocks preempts its request: both managers free its
    encoder blocks, and its readmission takes them again."""

    def scenario(run: _Run) -> None:
        run.admit("a", 7, 20)
        run.admit("b", 7, 10)
        steps = 0
        while run.step("a"):
            steps += 1
        # "a" preempted: readmit it (refused until "b" goes)
        run.admit("a", 7, 20)
        run.finish("b")
        run.admit("a", 7, 20)
        run.step("a")

    seen = _same(scenario, num_blocks=16)
    assert any(what.startswith("step a") and answer is None for what, answer, *_ in seen)


def test_randomized_differential() -> None:
    """Random admissions (with and without encoder inputs, whole-prompt or chunk checks, with
    and without scheduled requests, lookahead), decode steps that preempt, finishes and
    prefix-cache resets, on tiny pools with a watermark: identical after every call."""
    for seed in range(40):

        def scenario(run: _Run, seed: int = seed) -> None:
            rng = random.Random(seed)
            waiting: list[tuple[str, int, int]] = []
            for i in range(60):
                op = rng.random()
                if op < 0.35 or not run.requests:
                    if waiting and rng.random() < 0.5:
                        rid, p, e = waiting.pop(0)
                    else:
                        rid, p, e = f"r{i}", rng.randint(1, 24), rng.choice([0, 0, 1, 3, 4, 5, 16, 23, 40])
                    ok = run.admit(
                        rid,
                        p,
                        e,
                        full=rng.random() < 0.7,
                        scheduled=rng.random() < 0.7,
                        lookahead=rng.choice([0, 0, 1, 3]),
                    )
                    if not ok:
                        waiting.append((rid, p, e))
                elif op < 0.85:
                    rid = rng.choice(sorted(run.requests))
                    if not run.step(rid, lookahead=rng.choice([0, 0, 2])):
                        waiting.append((rid, 0, run.encoder[rid]))
                elif op < 0.97:
                    run.finish(rng.choice(sorted(run.requests)))
                else:
                    run.reset()

        layout = random.Random(seed).choice(["fc", "cf", "fcc", "ffc"])
        _same(scenario, layout=layout, num_blocks=random.Random(seed).randint(12, 40), watermark=0.1)


def test_refused_inputs_change_nothing() -> None:
    """Hostile or unsupported calls raise typed errors and leave the state as it was."""
    from pagedkv.errors import InvalidArgumentError, UnsupportedVllmFeatureError

    run = _Run("pagedkv", "fc", 20, 0.0, 64)
    run.admit("a", 6, 9)
    before = run.seen[-1][2:]
    request = _request("neg", 4, 0)
    with pytest.raises(InvalidArgumentError):
        run.m.allocate_slots(request, 4, num_encoder_tokens=-1)
    with pytest.raises(UnsupportedVllmFeatureError, match="already holds blocks"):
        run.m.allocate_slots(run.requests["a"], 1, num_encoder_tokens=4)
    with pytest.raises(UnsupportedVllmFeatureError, match="cross-attention"):
        run.m.allocate_slots(_request("ext", 8, 4), 4, num_external_computed_tokens=4)
    with pytest.raises(UnsupportedVllmFeatureError, match="cross-attention"):
        run.m.pop_blocks_for_free(run.requests["a"])
    with pytest.raises(UnsupportedVllmFeatureError, match="cross-attention"):
        run.m.coordinator.get_num_blocks_to_allocate("a", 40)
    run.note("after", None)
    assert run.seen[-1][2:] == before


@pytest.mark.parametrize(
    ("layout", "caching", "match"),
    [
        ("fc", True, "prefix caching with cross-attention"),
        ("sc", False, "beside sliding-window"),
        ("c", False, "without a decoder group"),
    ],
)
def test_unsupported_configs_refused(layout: str, caching: bool, match: str) -> None:
    from pagedkv.errors import UnsupportedVllmFeatureError
    from pagedkv.integrations.vllm import KVCacheManager

    with pytest.raises(UnsupportedVllmFeatureError, match=match):
        KVCacheManager(
            _config(layout, 20),
            max_model_len=64,
            scheduler_block_size=BS,
            hash_block_size=BS,
            enable_caching=caching,
        )


def test_cross_group_view_is_vllms_class_with_pagedkvs_state() -> None:
    """The cross-attention group's view is an instance of vLLM's ``CrossAttentionManager`` (what
    vLLM's tests look for) whose ``req_to_blocks`` are the encoder core's tables."""
    from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager

    run = _Run("pagedkv", "fc", 20, 0.0, 64)
    run.admit("a", 6, 9)
    view = run.m.coordinator.single_type_managers[1]
    assert isinstance(view, CrossAttentionManager)
    ids = [b.block_id for b in view.req_to_blocks["a"]]
    assert ids == run.m.get_block_ids("a")[1] == [int(b) for b in run.m._cross.core.block_table(0)]
    assert len(ids) == 3 and not set(ids) & set(run.m.get_block_ids("a")[0])
    assert dict(view.num_cached_block) == {}


# ---------------------------------------------------------------- the scheduler differential


def _scheduler(bench: ModuleType, manager: Any, num_blocks: int) -> Any:
    """vLLM's scheduler set up as vLLM's own encoder-decoder tests set it up (a decoder-only
    model config patched to encoder-decoder), on a pool of ``num_blocks``."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.encoder_cache_manager import EncoderDecoderCacheManager
    from vllm.v1.core.sched import scheduler as scheduler_module
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    max_len = 256
    model_config = ModelConfig(model=bench._model_dir(), dtype="float16", seed=42, skip_tokenizer_init=True)
    scheduler_config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=max_len, max_model_len=max_len, is_encoder_decoder=True
    )
    cache_config = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, enable_prefix_caching=False)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config
    )
    saved = scheduler_module.KVCacheManager
    scheduler_module.KVCacheManager = manager
    try:
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=_config("fc", num_blocks),
            block_size=BS,
            hash_block_size=BS,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vllm_config),
        )
    finally:
        scheduler_module.KVCacheManager = saved
    scheduler.is_encoder_decoder = True
    scheduler.max_num_encoder_input_tokens = max_len
    scheduler.encoder_cache_manager = EncoderDecoderCacheManager(cache_size=max_len)
    return scheduler


def _scheduler_trace(bench: ModuleType, manager: Any, seed: int, num_blocks: int) -> tuple[list[Any], int]:
    from vllm.v1.request import RequestStatus

    scheduler = _scheduler(bench, manager, num_blocks)
    rng = random.Random(seed)
    requests = []
    for i in range(14):
        request = _request(str(i), rng.randint(2, 30), rng.choice([0, 3, 16, 17, 40, 61]))
        request.sampling_params.max_tokens = rng.randint(2, 30)
        request.sampling_params.ignore_eos = True
        requests.append(request)
        scheduler.add_request(request)
    views = scheduler.kv_cache_manager.coordinator.single_type_managers
    out_rng = random.Random(1)
    trace: list[Any] = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        runner_output = bench._runner_output(out, scheduler, out_rng)
        engine_outputs = scheduler.update_from_output(out, runner_output)
        finished = sorted(
            o.request_id
            for eco in engine_outputs.values()
            for o in eco.outputs
            if o.finish_reason is not None
        )
        running = sorted(r.request_id for r in scheduler.running if r.status == RequestStatus.RUNNING)
        blocks = [(rid, tuple(len(v.req_to_blocks.get(rid, [])) for v in views)) for rid in running]
        trace.append(
            (
                sorted(out.num_scheduled_tokens.items()),
                sorted(out.preempted_req_ids or ()),
                finished,
                blocks,
                scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            )
        )
        if hasattr(scheduler.kv_cache_manager, "check_invariants"):
            scheduler.kv_cache_manager.check_invariants()
        assert len(trace) < 5000
    return trace, sum(r.num_preemptions for r in requests)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scheduler_differential(vllm_scheduler: ModuleType, seed: int) -> None:
    """vLLM's scheduler on both managers, encoder-decoder requests (some without encoder
    inputs) on a pool that preempts: identical schedules, preemptions, finishes, encoder
    blocks and free blocks, step by step."""
    from pagedkv.integrations.vllm import KVCacheManager
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

    reference, preemptions = _scheduler_trace(vllm_scheduler, VllmKVCacheManager, seed, 48)
    candidate, _ = _scheduler_trace(vllm_scheduler, KVCacheManager, seed, 48)
    assert preemptions > 0  # the pool is small enough to preempt
    assert any(blocks[1] for step in reference for _rid, blocks in step[3])  # encoder blocks held
    for step, (a, b) in enumerate(zip(reference, candidate, strict=True)):
        assert b == a, f"step {step}"


def test_check_invariants_sees_encoder_blocks_out_of_step() -> None:
    """``check_invariants`` compares the encoder core with the manager's requests: an encoder
    sequence freed behind the manager's back, or one no request holds, is a violation."""
    from pagedkv.errors import InvariantViolation

    run = _Run("pagedkv", "fc", 20, 0.0, 64)
    run.admit("a", 6, 9)
    run.m.check_invariants()
    run.m._cross.core.free(0)
    with pytest.raises(InvariantViolation):
        run.m.check_invariants()
    run = _Run("pagedkv", "fc", 20, 0.0, 64)
    run.admit("a", 6, 0)
    run.m._cross.core.add_sequence(7, num_tokens=5)
    with pytest.raises(InvariantViolation):
        run.m.check_invariants()
