"""``pagedkv.integrations.vllm``: what it refuses at construction, and its scheduler class.

Unsupported optional paths of vLLM's scheduler are refused by name (never a different schedule);
``PagedkvScheduler`` builds vLLM's scheduler on pagedkv's manager without leaving vLLM's module
patched, and becomes the async scheduler when async scheduling is configured.
Runs in the vLLM stage of the test command (scripts/vllm/stage.sh); skipped elsewhere.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.sched.scheduler")


def _config(spec):  # type: ignore[no-untyped-def]
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])


def _manager(config, **kwargs):  # type: ignore[no-untyped-def]
    from pagedkv.integrations.vllm import KVCacheManager

    args = dict(max_model_len=256, scheduler_block_size=16, hash_block_size=16)
    args.update(kwargs)
    return KVCacheManager(config, **args)


def _small_blocks_manager(manager_kind: str, bs: int) -> tuple[Any, Any]:
    """vLLM's manager or pagedkv's (``manager_kind``) on one full-attention group of 64 blocks of
    ``bs`` tokens, and vLLM's sha256 block hasher for its requests."""
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    args = dict(max_model_len=256, scheduler_block_size=bs, hash_block_size=bs)
    manager = VllmKVCacheManager(config, **args) if manager_kind == "vllm" else _manager(config, **args)
    return manager, get_request_block_hasher(bs, sha256)


def test_full_attention_constructs_like_vllms() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    m = _manager(_config(FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)))
    assert m.coordinator.single_type_managers[0].block_size == 16
    assert m.block_pool.get_num_free_blocks() == 31  # block 0 is vLLM's null block
    assert m.usage == 0.0


@pytest.mark.parametrize("kinds", [("full",), ("full", "swa"), ("swa", "full", "swa")])
@pytest.mark.parametrize("enable_caching", [True, False])
def test_the_coordinator_view_is_of_vllms_coordinator_class(
    kinds: tuple[str, ...], enable_caching: bool
) -> None:
    """vLLM builds a ``HybridKVCacheCoordinator`` for several groups with prefix caching, and its
    code and tests check for it (``isinstance``); the view is one there and only there. A method
    of vLLM's class the view does not answer raises instead of running vLLM's machinery on
    pagedkv's tables."""
    from pagedkv.integrations.vllm import KVCacheManager
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm_test_inputs import kv_cache_config

    args = dict(max_model_len=256, scheduler_block_size=16, hash_block_size=16, enable_caching=enable_caching)
    ours = KVCacheManager(kv_cache_config(*kinds), **args).coordinator
    theirs = VllmKVCacheManager(kv_cache_config(*kinds), **args).coordinator
    assert isinstance(ours, HybridKVCacheCoordinator) == isinstance(theirs, HybridKVCacheCoordinator)
    if isinstance(ours, HybridKVCacheCoordinator):
        with pytest.raises(AttributeError):
            ours.find_longest_cache_hit([], 0)
        with pytest.raises(AttributeError):
            ours.free("nobody")


def test_unsupported_group_kinds_are_refused_by_name() -> None:
    import torch
    from pagedkv.integrations.vllm import UnsupportedVllmFeatureError
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, MambaSpec

    cross = CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    with pytest.raises(UnsupportedVllmFeatureError, match="CrossAttentionSpec"):
        _manager(_config(cross))
    mamba = MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,))
    with pytest.raises(UnsupportedVllmFeatureError, match="MambaSpec"):
        _manager(_config(mamba))


def test_unsupported_options_are_refused_by_name() -> None:
    import torch
    from pagedkv.integrations.vllm import UnsupportedVllmFeatureError
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    config = _config(FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32))
    # EAGLE's dropped hit block is supported on one full-attention group (test_vllm_draft.py
    # compares it with vLLM's, and its refusals with other groups)
    assert _manager(config, use_eagle=True) is not None
    with pytest.raises(UnsupportedVllmFeatureError, match="hash block size"):
        _manager(config, hash_block_size=8)
    with pytest.raises(UnsupportedVllmFeatureError, match="DCP/PCP"):
        _manager(config, dcp_world_size=2)


def test_scheduler_class_builds_on_pagedkv_and_restores_vllms_name(vllm_scheduler: ModuleType) -> None:
    from pagedkv.integrations.vllm import KVCacheManager, PagedkvAsyncScheduler, PagedkvScheduler
    from vllm.v1.core.sched import scheduler as scheduler_module
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    module = vllm_scheduler
    saved = scheduler_module.KVCacheManager
    for async_scheduling in (False, True):
        w = module.Workload(requests=4, async_scheduling=async_scheduling)
        # build_scheduler builds the class it is given through vLLM's own module name; here the
        # class is the plain one, and PagedkvScheduler must swap the manager in by itself.
        sched = module.build_scheduler(w, saved, scheduler_cls=PagedkvScheduler)
        assert isinstance(sched.kv_cache_manager, KVCacheManager)
        configured = bool(sched.vllm_config.scheduler_config.async_scheduling)
        assert isinstance(sched, PagedkvAsyncScheduler) == configured
        assert isinstance(sched, AsyncScheduler) == configured
        assert scheduler_module.KVCacheManager is saved
    # vLLM's config may turn async scheduling off on a CPU; the class choice itself:
    for flag in (False, True):
        config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=flag))
        chosen = PagedkvScheduler.__new__(PagedkvScheduler, vllm_config=config)
        assert isinstance(chosen, PagedkvAsyncScheduler) == flag


@pytest.mark.parametrize("manager_kind", ["vllm", "pagedkv"])
def test_a_hash_arriving_after_its_blocks_ids_is_indexed(manager_kind: str) -> None:
    """A hasher with a lookahead token hashes a block only once the token after it exists: a
    4-token prompt (one block) gets its block's hash from the prefill's sampled token, when no
    new id needs giving. ``cache_blocks`` must index the block then, as vLLM's manager does
    (vLLM's own test_finished_spec_request_caches_completed_blocks[prefill-1-*])."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    bs = 4
    config = _config(FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32))
    args = dict(max_model_len=64, scheduler_block_size=bs, hash_block_size=bs)
    m = VllmKVCacheManager(config, **args) if manager_kind == "vllm" else _manager(config, **args)
    hasher = get_request_block_hasher(bs, sha256, 1)

    def request(rid: str, prompt: list[int]) -> Request:
        return Request(rid, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)

    producer = request("producer", [0, 1, 2, 3])
    assert producer.block_hashes == []  # block 0's lookahead token is not known yet
    blocks, hit = m.get_computed_blocks(producer)[:2]
    assert hit == 0
    assert m.allocate_slots(producer, 4, 0, blocks, num_lookahead_tokens=2, full_sequence_must_fit=True)
    producer.num_computed_tokens = 4
    producer.append_output_token_ids(4)  # the prefill's sampled token: block 0's hash now
    assert len(producer.block_hashes) == 1
    m.cache_blocks(producer, 4)
    m.free(producer)
    probe = request("probe", [0, 1, 2, 3, 4, 99, 99, 99, 99])
    assert m.get_computed_blocks(probe)[1] == bs


def test_decode_gives_token_ids_once_per_block() -> None:
    """A decoding request's ids reach the core once per filled block, not once per step (the
    per-call cost of benches/results/2026-12-06-vllm-scheduler-v2.md), and each full block is
    still indexed: a second request hits the whole decoded prefix."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    bs = 4
    config = _config(FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32))
    m = _manager(config, max_model_len=64, scheduler_block_size=bs, hash_block_size=bs)
    hasher = get_request_block_hasher(bs, sha256)
    calls = [0]
    core = m._core

    class Counting:
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(core, name)

        def provide_token_ids(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls[0] += 1
            return core.provide_token_ids(*args, **kwargs)

    m._core = Counting()
    req = Request("r", [0, 1, 2, 3, 4, 5], SamplingParams(max_tokens=32), None, block_hasher=hasher)
    blocks, hit = m.get_computed_blocks(req)[:2]
    assert m.allocate_slots(req, 6, hit, blocks, full_sequence_must_fit=True) is not None
    req.num_computed_tokens = 6
    for token in range(100, 110):  # ten decode steps: tokens 6..15 fill blocks 1, 2 and 3
        req.append_output_token_ids(token)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    assert calls[0] <= 3  # one per block the decode filled (once per step would be 10)
    m.free(req)
    probe = Request(
        "p", [*req.all_token_ids[:16], 7], SamplingParams(max_tokens=1), None, block_hasher=hasher
    )
    assert m.get_computed_blocks(probe)[1] == 16  # blocks 0-3: every filled block indexed


@pytest.mark.parametrize("manager_kind", ["vllm", "pagedkv"])
def test_a_sequence_longer_than_the_pool_is_not_admitted(manager_kind: str) -> None:
    """A prompt whose full-attention blocks pass the whole pool gets None from admission (the
    scheduler keeps it waiting), as from vLLM's manager; the core's own refusal (an error) would
    stop the scheduler's step instead. The pool is not touched."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    bs = 16
    config = _config(FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32))
    args = dict(max_model_len=1024, scheduler_block_size=bs, hash_block_size=bs)
    m = VllmKVCacheManager(config, **args) if manager_kind == "vllm" else _manager(config, **args)
    hasher = get_request_block_hasher(bs, sha256)
    too_long = Request("long", list(range(40 * bs)), SamplingParams(max_tokens=1), None, block_hasher=hasher)
    free = m.block_pool.get_num_free_blocks()
    assert m.allocate_slots(too_long, bs, full_sequence_must_fit=True) is None
    assert m.block_pool.get_num_free_blocks() == free
    fits = Request("short", list(range(2 * bs)), SamplingParams(max_tokens=1), None, block_hasher=hasher)
    assert m.allocate_slots(fits, 2 * bs, full_sequence_must_fit=True) is not None


@pytest.mark.parametrize(
    ("kinds", "use_eagle"),
    # (EAGLE is refused beside a window or a Mamba group: refusals tested there)
    [(("full",), False), (("full",), True), (("full", "swa"), False), (("full", "mamba"), False)],
)
def test_a_prompt_longer_than_the_pool_is_looked_up_as_vllm_does(
    kinds: tuple[str, ...], use_eagle: bool
) -> None:
    """The prefix-cache look-up of a prompt longer than the whole pool answers the hit the cache
    holds (a cached 3-block prefix here) and admission then None, as vLLM's manager does; a
    look-up of the whole prompt would be the core's refusal, an error stopping the step."""
    import torch
    from pagedkv.integrations.vllm import KVCacheManager
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm_test_inputs import kv_cache_config, request

    bs = 16

    def config() -> KVCacheConfig:
        if kinds != ("full", "mamba"):
            return kv_cache_config(*kinds, num_blocks=8, window=bs)
        fa = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
        mamba = MambaSpec(block_size=bs, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align")
        return KVCacheConfig(
            num_blocks=8,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["f"], fa), KVCacheGroupSpec(["m"], mamba)],
        )

    args = dict(
        max_model_len=1024,
        scheduler_block_size=bs,
        hash_block_size=bs,
        enable_caching=True,
        use_eagle=use_eagle,
    )
    answers = {}
    for kind, cls in (("vllm", VllmKVCacheManager), ("pagedkv", KVCacheManager)):
        m = cls(config(), **args)
        first = request("first", 3 * bs + 1)
        for _ in range(3):  # one block per step: a Mamba group caches a state at each boundary
            blocks, hit = m.get_computed_blocks(first)[:2] if not first.num_computed_tokens else (None, 0)
            assert m.allocate_slots(first, bs, hit, blocks) is not None
            first.num_computed_tokens += bs
        m.free(first)
        too_long = request("long", 20 * bs + 3)
        blocks, hit, boundary = m.get_computed_blocks(too_long)
        answer = m.allocate_slots(too_long, bs, hit, blocks, full_sequence_must_fit=True)
        answers[kind] = (hit, boundary, answer, m.block_pool.get_num_free_blocks())
    assert answers["pagedkv"] == answers["vllm"]
    assert answers["vllm"][0] > 0 and answers["vllm"][2] is None


@pytest.mark.parametrize("manager_kind", ["vllm", "pagedkv"])
def test_admission_without_the_whole_sequence_check(manager_kind: str) -> None:
    """``full_sequence_must_fit=False`` (vLLM's ``scheduler_reserve_full_isl=False``): a prompt
    longer than the pool is admitted while its scheduled chunk fits, grows until the pool is
    short (None: the scheduler preempts), and a chunk that can never fit gets None; the same
    answers and free-block counts from both managers."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    bs = 16
    config = _config(FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32))
    args = dict(max_model_len=1024, scheduler_block_size=bs, hash_block_size=bs, enable_caching=True)
    m = VllmKVCacheManager(config, **args) if manager_kind == "vllm" else _manager(config, **args)
    hasher = get_request_block_hasher(bs, sha256)
    free = m.block_pool.get_num_free_blocks()  # 31: block 0 is the null block
    huge = Request("huge", list(range(40 * bs)), SamplingParams(max_tokens=1), None, block_hasher=hasher)
    assert m.allocate_slots(huge, 32 * bs, full_sequence_must_fit=False) is None  # never fits
    assert m.block_pool.get_num_free_blocks() == free
    assert m.allocate_slots(huge, 4 * bs, full_sequence_must_fit=True) is None  # the whole prompt
    assert m.block_pool.get_num_free_blocks() == free
    long = Request("long", list(range(40 * bs)), SamplingParams(max_tokens=1), None, block_hasher=hasher)
    blocks = m.allocate_slots(long, 4 * bs, full_sequence_must_fit=False)
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 4
    assert m.block_pool.get_num_free_blocks() == free - 4
    computed = 4 * bs
    while True:
        long.num_computed_tokens = computed
        got = m.allocate_slots(long, 8 * bs)
        if got is None:
            break
        computed += 8 * bs
    # 4 + 3 * 8 = 28 blocks held, 3 free: the next 8-block chunk (36 in all) can never fit.
    assert computed == 28 * bs
    assert m.block_pool.get_num_free_blocks() == free - 28
    assert m.allocate_slots(long, 2 * bs) is not None  # 2 of the 3 left
    long.num_computed_tokens = computed + 2 * bs
    assert m.allocate_slots(long, 2 * bs) is None  # 1 left: short now (vLLM preempts)
    assert m.block_pool.get_num_free_blocks() == free - 30
    assert len(m.get_block_ids("long")[0]) == 30


@pytest.mark.parametrize("manager_kind", ["vllm", "pagedkv"])
def test_hits_longer_than_the_first_look_up(manager_kind: str) -> None:
    """pagedkv's ``get_computed_blocks`` looks up the first blocks first and the whole request
    only when the hit reaches their end (admission.py, ``_FIRST_LOOKUP_BLOCKS``): hits shorter
    than, exactly as long as and longer than that first look-up are the ones vLLM finds."""
    from pagedkv.integrations.vllm.admission import _FIRST_LOOKUP_BLOCKS
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    bs = 4
    m, hasher = _small_blocks_manager(manager_kind, bs)
    prompt = list(range(1, 40 * bs + 1))
    producer = Request("producer", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    assert m.allocate_slots(producer, len(prompt), full_sequence_must_fit=True) is not None
    m.free(producer)  # 40 cached blocks
    first = _FIRST_LOOKUP_BLOCKS
    hits = []
    for blocks in (first - 1, first, first + 1, 39, 40):
        probe = Request(
            f"p{blocks}",
            [*prompt[: blocks * bs], 0, 0],
            SamplingParams(max_tokens=1),
            None,
            block_hasher=hasher,
        )
        hits.append(m.get_computed_blocks(probe)[1])
    diverging = Request(
        "d",
        [*prompt[: (first + 3) * bs], 7, 7, 7, 7, 7],
        SamplingParams(max_tokens=1),
        None,
        block_hasher=hasher,
    )
    hits.append(m.get_computed_blocks(diverging)[1])
    capped = Request("c", prompt + [0], SamplingParams(max_tokens=1), None, block_hasher=hasher)
    hits.append(m.get_computed_blocks(capped, max_cache_hit_length=(first + 2) * bs + 1)[1])
    assert hits == [b * bs for b in (first - 1, first, first + 1, 39, 40, first + 3, first + 2)]


@pytest.mark.parametrize("manager_kind", ["vllm", "pagedkv"])
def test_a_request_skipping_the_cache_reads_none_and_writes_it(manager_kind: str) -> None:
    """A request that skips reading the prefix cache (``skip_reading_prefix_cache``, as prompt
    logprobs set it) hits nothing, even over cached blocks, and its own blocks are cached for
    later requests, as vLLM caches them (its blocks over contents already cached too, a second
    copy in vLLM's index)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    bs = 4
    m, hasher = _small_blocks_manager(manager_kind, bs)

    def request(rid: str, prompt: list[int], skip: bool = False) -> Request:
        params = SamplingParams(max_tokens=1, skip_reading_prefix_cache=skip or None)
        return Request(rid, prompt, params, None, block_hasher=hasher)

    shared = list(range(1, 6 * bs + 1))
    producer = request("producer", [*shared, 0])
    assert m.allocate_slots(producer, len(shared) + 1) is not None
    m.free(producer)  # 6 cached blocks
    skipper = request("skipper", [*shared, *range(100, 100 + 5 * bs), 0], skip=True)
    assert m.get_computed_blocks(skipper)[1] == 0  # reads nothing, though 6 blocks are cached
    got = m.allocate_slots(skipper, 11 * bs + 1)
    assert got is not None and len(got.get_block_ids()[0]) == 12
    assert m.estimate_cached_tokens(skipper) == 11 * bs  # its own blocks, written
    free = m.block_pool.get_num_free_blocks()
    reader = request("reader", [*shared, *range(100, 100 + 5 * bs), 7, 7])
    blocks, hit = m.get_computed_blocks(reader)[:2]
    assert hit == 11 * bs  # the skipper's 5 blocks past the shared ones are cached
    assert m.allocate_slots(reader, 2, hit, blocks) is not None
    # One new block, and the shared blocks: on vLLM's manager the producer's 6 cached-evictable
    # copies (the first it indexed), on pagedkv's the skipper's held ones, the one copy its index
    # keeps (docs/conformance.md, Duplicate copies).
    revived = 6 if manager_kind == "vllm" else 0
    assert m.block_pool.get_num_free_blocks() == free - revived - 1
