"""vLLM 0.33's real scheduler driven on a CPU, offline, with a KV-cache manager of your choice:
the same requests through vLLM's ``Scheduler`` (or ``AsyncScheduler``) built once with vLLM's own
``KVCacheManager`` and once with another (pagedkv's drop-in), compared step by step, and timed.

    $VENV/bin/python benches/vllm_scheduler.py --manager pagedkv [--requests 500 --prompt-max 2000]
    $VENV/bin/python benches/vllm_scheduler.py --manager passthrough --groups full,swa --async

(``$VENV``: the vLLM venv of scripts/vllm/env.sh, with pagedkv importable.) The model runner is
a fake that samples one token for every scheduled request whose prefill is complete (vLLM's
``ModelRunnerOutput``), so what is compared is the scheduler's own decisions:
- per step: the tokens scheduled per request, the requests preempted, the requests finished;
- per run: the prefix-cache queries and hits vLLM's stats report, the output tokens per request.
Two managers that agree on every hit and every refusal give identical traces; the first step
where they differ is reported. What is timed is ``schedule()`` + ``update_from_output()`` only
(the step time a manager changes), in the same process, the two managers alternated per run.

No model download: ``ModelConfig`` points at a folder holding only a tiny llama config.json, with
``skip_tokenizer_init``; the ``KVCacheConfig`` is built by hand (vLLM's tests/v1/core/utils.py
does the same). Needs ``VLLM_TARGET_DEVICE=cpu`` (set here when absent).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_copy_watch import watch_spared_evictions  # noqa: E402 (next to this file)
from vllm_fake_connector import fake_kv_transfer_config  # noqa: E402 (next to this file)

# first_different_step is this harness's too: the tests reach the comparisons through it.
from vllm_scheduler_trace import (  # noqa: E402, F401 (next to this file)
    Trace,
    explained_divergence,
    first_difference,
    first_different_step,
)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# A llama shape small enough that nothing is ever allocated for it (no weights are loaded).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 8192,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float16",
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Workload:
    """The requests and the engine's shape (one scheduler run)."""

    requests: int = 40
    prompt_min: int = 20
    prompt_max: int = 300
    out_min: int = 4
    out_max: int = 40
    shared_prefix: int = 64  # tokens of one of 4 system prompts every prompt starts with
    block_size: int = 16
    num_blocks: int = 400
    groups: tuple[str, ...] = ("full",)  # "full" / "swa" / "mamba" (align mode) per KV-cache group
    window: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    prefix_caching: bool = True
    async_scheduling: bool = False
    # Speculative decoding with vLLM's n-gram proposer config (no draft model): the fake model
    # runner proposes up to this many random draft tokens per running request after every
    # step (``update_draft_token_ids``, as the engine core does) and accepts a random prefix of
    # the scheduled ones; the scheduler rolls the rejected ones back.
    num_spec_tokens: int = 0
    # A drafter with a KV cache of its own instead of n-gram (``DRAFTERS``): its method set on
    # the n-gram config, as vLLM's test_block_drafters_cap_requests_instead_of_draft_slots does
    # (no draft model is loaded), so the scheduler passes its manager EAGLE's dropped hit block,
    # lookahead hashing or prefill lookahead, and the requests get the lookahead hasher.
    drafter: str = ""
    # vLLM's SchedulerConfig.scheduler_reserve_full_isl: admission checks the whole prompt fits
    # (True, vLLM's default) or only the scheduled chunk (False).
    reserve_full_isl: bool = True
    # A fake KV connector (vllm_fake_connector.py): "" none; "sync" external hits loaded in the
    # step that schedules them; "mixed" those, asynchronous loads (reported finished by the
    # fake model runner two steps later) and requests without external hits.
    connector: str = ""
    # Every request whose id is a multiple of this (> 0) skips reading the prefix cache
    # (``SamplingParams.skip_reading_prefix_cache``, as prompt logprobs set it): it hits
    # nothing, and vLLM still caches its blocks for later requests.
    skip_reading_every: int = 0
    # > 0: the Mamba groups take vLLM's prefill check-points with this alignment (its Mamba2
    # layers' `num_prefill_checkpoint_blocks=1`, alignment 1): the scheduler stops ending
    # prefill chunks at block boundaries where the check-point serves.
    mamba_checkpoint_alignment: int = 0
    seed: int = 0


# drafter -> (method, MTP modules, lookahead hashes disabled): what vLLM's config makes of them
# (vllm/config/vllm.py): "eagle" hashes one token ahead; "eagle-drop" drops its hit's last
# block; "mtp3" hashes and re-prefills 3 tokens; "mtp3-drop" drops and re-prefills; "dflash"
# reserves a block of draft slots (no drop, no lookahead hash).
DRAFTERS: dict[str, tuple[str, int, bool]] = {
    "eagle": ("eagle", 1, False),
    "eagle-drop": ("eagle", 1, True),
    "mtp3": ("mtp", 3, False),
    "mtp3-drop": ("mtp", 3, True),
    "dflash": ("dflash", 1, False),
}


def _set_drafter(vllm_config: Any, drafter: str) -> None:
    """Turns the built config's n-gram drafter into ``drafter`` (see ``DRAFTERS``), then redoes
    the step that sizes the batch by the drafter's slots, as vLLM's test does."""
    from types import SimpleNamespace

    method, modules, no_lookahead_hashes = DRAFTERS[drafter]
    speculative_config = vllm_config.speculative_config
    hf_config = SimpleNamespace(num_nextn_predict_layers=modules)
    object.__setattr__(speculative_config, "method", method)
    object.__setattr__(speculative_config, "draft_model_config", SimpleNamespace(hf_config=hf_config))
    object.__setattr__(speculative_config, "disable_lookahead_block_hashes", no_lookahead_hashes)
    vllm_config._set_max_num_scheduled_tokens()


def _model_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), "pagedkv-vllm-tiny-llama")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    return path


def manager_class(name: str) -> Any:
    """The KV-cache manager class named `name`: vllm, passthrough or pagedkv."""
    from vllm.v1.core import kv_cache_manager

    if name == "vllm":
        return kv_cache_manager.KVCacheManager
    if name == "passthrough":

        class PassThrough(kv_cache_manager.KVCacheManager):
            pass

        return PassThrough
    if name == "pagedkv":
        from pagedkv.integrations.vllm import KVCacheManager

        return KVCacheManager
    raise ValueError(f"unknown manager {name!r}")


def build_scheduler(w: Workload, manager: Any, scheduler_cls: Any = None) -> Any:
    """vLLM's scheduler for workload `w`, with `manager` as its KV-cache manager class
    (`scheduler_cls`: another scheduler class, built with the same arguments)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.core.sched import scheduler as scheduler_module
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=_model_dir(),
        dtype="float16",
        seed=42,
        skip_tokenizer_init=True,
        max_model_len=w.max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=w.async_scheduling,
        scheduler_reserve_full_isl=w.reserve_full_isl,
    )
    cache_config = CacheConfig(
        block_size=w.block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=w.prefix_caching,
        # A Mamba group's blocks hold states at block boundaries ("align"; vLLM's scheduler
        # then ends a prefill chunk at a block boundary, _mamba_block_aligned_split).
        mamba_cache_mode="align" if "mamba" in w.groups else "none",
    )
    speculative_config = None
    if w.num_spec_tokens:
        speculative_config = SpeculativeConfig(model="ngram", num_speculative_tokens=w.num_spec_tokens)
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        speculative_config=speculative_config,
        kv_transfer_config=fake_kv_transfer_config(w.connector) if w.connector else None,
    )
    if w.drafter:
        _set_drafter(vllm_config, w.drafter)
    shape = dict(block_size=w.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)

    def spec(kind: str) -> Any:
        if kind == "full":
            return FullAttentionSpec(**shape)
        if kind == "swa":
            return SlidingWindowSpec(**shape, sliding_window=w.window)
        if kind == "mamba":
            checkpoints: dict[str, Any] = {}
            if w.mamba_checkpoint_alignment:
                checkpoints = dict(
                    num_prefill_checkpoint_blocks=1,
                    prefill_checkpoint_alignment=w.mamba_checkpoint_alignment,
                )
            return MambaSpec(
                block_size=w.block_size,
                shapes=((1,), (1,)),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
                **checkpoints,
            )
        raise ValueError(f"unknown KV group kind {kind!r}")

    specs = [KVCacheGroupSpec([f"{kind}.{i}"], spec(kind)) for i, kind in enumerate(w.groups)]
    kv_cache_config = KVCacheConfig(num_blocks=w.num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)
    cache_config.num_gpu_blocks = w.num_blocks
    cls = scheduler_cls or (AsyncScheduler if w.async_scheduling else Scheduler)
    saved = scheduler_module.KVCacheManager
    scheduler_module.KVCacheManager = manager  # the scheduler builds it from its module's name
    try:
        return cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            block_size=w.block_size,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vllm_config),
        )
    finally:
        scheduler_module.KVCacheManager = saved


def block_hasher(w: Workload) -> Any:
    """vLLM's block hasher for the workload's requests: with a drafter that hashes ahead, its
    lookahead (vLLM's ``num_hash_lookahead_tokens``: the prefill lookahead)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    lookahead = 0
    if w.drafter and w.prefix_caching:
        method, modules, no_lookahead_hashes = DRAFTERS[w.drafter]
        if method in ("eagle", "mtp") and not no_lookahead_hashes:
            lookahead = w.num_spec_tokens if method == "mtp" and min(modules, w.num_spec_tokens) > 1 else 1
    return get_request_block_hasher(w.block_size, sha256, lookahead)


def make_requests(w: Workload) -> list[Any]:
    """The workload's requests (deterministic for its seed), hashed as vLLM hashes them."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = block_hasher(w)
    rng = random.Random(w.seed)
    systems = [[rng.randrange(3, 32000) for _ in range(w.shared_prefix)] for _ in range(4)]
    requests = []
    for i in range(w.requests):
        length = rng.randint(w.prompt_min, w.prompt_max)
        prompt = (rng.choice(systems) if w.shared_prefix else [])[:length]
        prompt += [rng.randrange(3, 32000) for _ in range(length - len(prompt))]
        params = SamplingParams(
            max_tokens=rng.randint(w.out_min, w.out_max),
            ignore_eos=True,
            skip_reading_prefix_cache=bool(w.skip_reading_every) and i % w.skip_reading_every == 0 or None,
        )
        requests.append(
            Request(
                request_id=str(i),
                prompt_token_ids=prompt,
                sampling_params=params,
                pooling_params=None,
                block_hasher=hasher,
            )
        )
    return requests


def _finished_loads(scheduler: Any, loading: dict[str, int], step: int) -> Any:
    """The fake connector's async loads finished now (two steps after they started), as the
    worker reports them (``KVConnectorOutput.finished_recving``), or None."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    for req_id, request in scheduler.requests.items():
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req_id not in loading:
            loading[req_id] = step
    done = {r for r, since in loading.items() if step - since >= 2}
    for r in done:
        del loading[r]
    return KVConnectorOutput(finished_recving=done) if done else None


def _runner_output(scheduler_output: Any, scheduler: Any, rng: random.Random) -> Any:
    """One sampled token for each scheduled request whose prompt is now computed, after the
    accepted part of its scheduled drafts (each accepted with probability 1/2, left to right;
    padding drafts never)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids, sampled = [], []
    drafts = scheduler_output.scheduled_spec_decode_tokens
    for req_id in scheduler_output.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        req_ids.append(req_id)
        done = request.num_computed_tokens >= request.num_prompt_tokens  # schedule() advanced it
        accepted: list[int] = []
        for token in drafts.get(req_id, ()):
            # -1: a padding draft (vLLM pads an admission whose hit leaves one token into a
            # full spec step); a model runner never accepts it.
            if token < 0 or rng.random() >= 0.5:
                break
            accepted.append(token)
        sampled.append(accepted + [rng.randrange(3, 32000)] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _propose_drafts(scheduler: Any, max_drafts: int, rng: random.Random) -> None:
    """The drafter's proposals for the next step (the engine core's
    ``update_draft_token_ids``): 0 to ``max_drafts`` random tokens per running request."""
    from vllm.v1.outputs import DraftTokenIds

    req_ids = [r.request_id for r in scheduler.running]
    drafts = [[rng.randrange(3, 32000) for _ in range(rng.randint(0, max_drafts))] for _ in req_ids]
    scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))


def has_duplicate_copies(manager: Any) -> bool:
    """Whether vLLM's prefix index holds two blocks of one content (it indexes every copy;
    False for a manager without vLLM's block pool)."""
    index = getattr(getattr(manager, "block_pool", None), "cached_block_hash_to_block", None)
    if index is None:
        return False
    return any(isinstance(copies, dict) and len(copies) >= 2 for copies in index._cache.values())


def _count_calls(manager: Any, trace: Trace) -> None:
    """Wraps `manager`'s public methods (on the instance) to count the calls made into it and
    the time spent inside them, outermost calls only."""
    depth = [0]

    def wrap(method: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return method(*args, **kwargs)
            depth[0] = 1
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                trace.manager_s += time.perf_counter() - t0
                trace.manager_calls += 1
                depth[0] = 0

        return counted

    for name in dir(type(manager)):
        attr = getattr(type(manager), name, None)
        if not name.startswith("_") and callable(attr) and not isinstance(attr, type):
            setattr(manager, name, wrap(getattr(manager, name)))


def revives_held_copy(manager: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether vLLM's ``allocate_slots(request, num_new_tokens, *args, **kwargs)`` on `manager`
    (vLLM's own) takes a cached-evictable hit block while another copy of its content is held
    (the usual first consequence of duplicate copies, docs/conformance.md)."""
    blocks = kwargs.get("new_computed_blocks", args[1] if len(args) > 1 else None)
    if blocks is None:
        return False
    index = manager.block_pool.cached_block_hash_to_block._cache
    for group in blocks.blocks:
        for b in group:
            copies = None if b.is_null else index.get(b.block_hash)
            if b.ref_cnt == 0 and isinstance(copies, dict) and any(c.ref_cnt > 0 for c in copies.values()):
                return True
    return False


def _watch_revived_copies(manager: Any, trace: Trace) -> None:
    """Wraps vLLM's ``allocate_slots`` (on the instance) to note the first step whose admission
    revives a copy (``revives_held_copy``)."""
    allocate = manager.allocate_slots

    def watched(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if trace.revived_copy_since is None and revives_held_copy(manager, args, kwargs):
            trace.revived_copy_since = len(trace.steps)  # the step being scheduled
        return allocate(request, num_new_tokens, *args, **kwargs)

    manager.allocate_slots = watched


def run(
    w: Workload,
    manager: Any,
    max_steps: int = 200_000,
    count_calls: bool = False,
    check_invariants: bool = False,
    probe_hits: bool = False,
    shadow_copies: bool = False,
    watch_copies: bool = True,
    freeze_heap: bool = False,
    loop_starts: Callable[[], object] | None = None,
    trace_zeroing: bool = False,
    scheduler_cls: Any = None,
    requests: Sequence[Any] | None = None,
    loop_ends: Callable[[Any], object] | None = None,
) -> Trace:
    """One scheduler run of workload `w` on `manager`; its trace (`count_calls`: with the
    manager's calls counted and timed, which slows the run: not for the step-time ratio;
    `check_invariants`: the manager's ``check_invariants()`` after every step, where it has one,
    outside the timed calls; `probe_hits`: the trace's probe hits, which slow the run;
    `shadow_copies`: on vLLM's manager, ``Trace.spared_copy_since``, which slows the run;
    `watch_copies`: on vLLM's manager, ``Trace.duplicates_since`` and ``revived_copy_since``,
    whose checks cost vLLM's side time and instructions: off for a timed or counted run;
    `freeze_heap`: the heap as vLLM's engine leaves it, for a timed or counted run (``EngineCore``
    builds its scheduler, then collects and freezes every object the garbage collector tracks,
    so that its collections while serving skip them; unfrozen again when the run ends);
    `loop_starts`: called once the scheduler is built and the requests added, before the first
    step; `trace_zeroing`: ``Trace.zeroing``, which reads every request's block ids each step;
    `scheduler_cls`: another scheduler class, built as `build_scheduler` does, `manager` None
    for the class's own manager: ``Trace.manager_type`` says which manager ran; `requests`: these
    requests instead of the workload's own (``make_requests``); `loop_ends`: called with the
    scheduler once every request finished)."""
    scheduler = build_scheduler(w, manager, scheduler_cls)
    if freeze_heap:
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
    try:
        return _run_steps(
            w,
            scheduler,
            max_steps,
            count_calls,
            check_invariants,
            probe_hits,
            shadow_copies,
            watch_copies,
            loop_starts,
            trace_zeroing,
            requests,
            loop_ends,
        )
    finally:
        if freeze_heap:
            gc.unfreeze()


def _run_steps(
    w: Workload,
    scheduler: Any,
    max_steps: int,
    count_calls: bool,
    check_invariants: bool,
    probe_hits: bool,
    shadow_copies: bool,
    watch_copies: bool,
    loop_starts: Callable[[], object] | None,
    trace_zeroing: bool = False,
    given_requests: Sequence[Any] | None = None,
    loop_ends: Callable[[Any], object] | None = None,
) -> Trace:
    """`run`'s requests and steps on a built `scheduler`."""
    requests = make_requests(w) if given_requests is None else list(given_requests)
    for request in requests:
        scheduler.add_request(request)
    rng = random.Random(1)
    loading: dict[str, int] = {}  # the fake connector's async loads: request -> step started
    trace = Trace(manager_type=type(scheduler.kv_cache_manager))
    if count_calls:
        _count_calls(scheduler.kv_cache_manager, trace)
    watch_duplicates = (
        watch_copies
        and w.prefix_caching
        and hasattr(getattr(scheduler.kv_cache_manager, "block_pool", None), "cached_block_hash_to_block")
    )
    if watch_duplicates and not count_calls:
        _watch_revived_copies(scheduler.kv_cache_manager, trace)
    if watch_duplicates and shadow_copies:
        watch_spared_evictions(scheduler.kv_cache_manager, trace, w.block_size)
    if probe_hits:
        _probe_calls(scheduler.kv_cache_manager, w, trace)
    if loop_starts is not None:
        loop_starts()
    while scheduler.has_unfinished_requests():
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        if trace_zeroing:
            trace.zeroing.append(zeroed_positions(scheduler, out.new_block_ids_to_zero or ()))
        runner_output = _runner_output(out, scheduler, rng)
        if w.connector:
            kv_output = _finished_loads(scheduler, loading, len(trace.steps))
            runner_output.kv_connector_output = kv_output
            trace.async_loads += len(kv_output.finished_recving) if kv_output is not None else 0
        t2 = time.perf_counter()
        for req_id, drafts in out.scheduled_spec_decode_tokens.items():
            trace.draft_tokens += sum(t >= 0 for t in drafts)
            trace.accepted_drafts += max(
                len(runner_output.sampled_token_ids[runner_output.req_id_to_index[req_id]]) - 1, 0
            )
        engine_outputs = scheduler.update_from_output(out, runner_output)
        t3 = time.perf_counter()
        if w.num_spec_tokens:
            _propose_drafts(scheduler, w.num_spec_tokens, rng)
        if check_invariants and hasattr(scheduler.kv_cache_manager, "check_invariants"):
            scheduler.kv_cache_manager.check_invariants()
        trace.schedule_s += t1 - t0
        trace.update_s += t3 - t2
        finished: list[str] = []
        for eco in engine_outputs.values():
            for o in eco.outputs:
                trace.output_tokens[o.request_id] = trace.output_tokens.get(o.request_id, 0) + len(
                    o.new_token_ids
                )
                if o.finish_reason is not None:
                    finished.append(o.request_id)
            stats = eco.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                trace.prefix_queries += stats.prefix_cache_stats.queries
                trace.prefix_hits += stats.prefix_cache_stats.hits
        preempted = tuple(sorted(getattr(out, "preempted_req_ids", None) or ()))
        scheduled = tuple(sorted(out.num_scheduled_tokens.items()))
        trace.steps.append((scheduled, preempted, tuple(sorted(finished))))
        if watch_duplicates and trace.duplicates_since is None:
            if has_duplicate_copies(scheduler.kv_cache_manager):
                trace.duplicates_since = len(trace.steps) - 1
        if len(trace.steps) > max_steps:
            raise RuntimeError(f"did not finish in {max_steps} steps")
    trace.preemptions = sum(r.num_preemptions for r in requests)
    if loop_ends is not None:
        loop_ends(scheduler)
    return trace


def zeroed_positions(scheduler: Any, block_ids: Any) -> tuple[tuple[str, int, int], ...]:
    """The blocks a step hands the workers to zero, as (request, group, table position), sorted:
    the two managers number their blocks differently, their tables hold the same positions. A
    block no request holds (allocated, then freed in the same step) is ("", -1, -1). A block
    two requests hold is the first's in the scheduler's request order: a new block is shared
    only by a later admission's hit in the same step (the allocation indexed it), and which of
    two copies of one content a hit takes is the indexes' choice (one copy in pagedkv's), not
    a difference in what is zeroed."""
    if not block_ids:
        return ()
    manager = scheduler.kv_cache_manager
    held: dict[int, tuple[str, int, int]] = {}
    for request_id in scheduler.requests:
        for group, ids in enumerate(manager.get_block_ids(request_id)):
            for position, block in enumerate(ids):
                if block:  # the null block (0) is never zeroed
                    held.setdefault(block, (request_id, group, position))
    return tuple(sorted(held.get(b, ("", -1, -1)) for b in block_ids))


def _probe_calls(manager: Any, w: Workload, trace: Trace) -> None:
    """Wraps `manager`'s ``allocate_slots`` and ``cache_blocks`` (on the instance) to note,
    after each call, the hit of a probe request holding the request's tokens so far and one
    more (``get_computed_blocks``: no side effect on either manager)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    hasher = block_hasher(w)
    index = getattr(getattr(manager, "block_pool", None), "cached_block_hash_to_block", None)
    index = None if index is None else index._cache
    holders: set[str] = set()  # requests that held a block vLLM indexed two copies of

    def wrap(name: str, method: Any) -> Any:
        def probed(request: Any, *args: Any, **kwargs: Any) -> Any:
            out = method(request, *args, **kwargs)
            probe = Request(
                request_id=f"probe-{request.request_id}",
                prompt_token_ids=[*request.all_token_ids, 0],
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
                block_hasher=hasher,
            )
            trace.probe_hits.append((name, request.request_id, manager.get_computed_blocks(probe)[1]))
            if index is not None and request.request_id not in holders:
                for group in manager.get_blocks(request.request_id).blocks:
                    for b in group:
                        copies = None if b.is_null else index.get(b.block_hash)
                        if isinstance(copies, dict) and len(copies) >= 2:
                            holders.add(request.request_id)
            trace.probe_copies.append(request.request_id in holders)
            return out

        return probed

    for name in ("allocate_slots", "cache_blocks"):
        setattr(manager, name, wrap(name, getattr(manager, name)))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--manager", default="pagedkv", help="pagedkv or passthrough (compared with vllm)")
    parser.add_argument("--groups", default="full", help="comma-separated full/swa/mamba, one per KV group")
    parser.add_argument("--async", dest="async_scheduling", action="store_true")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--no-reserve-full-isl", action="store_true", help="admission checks the scheduled chunk only"
    )
    parser.add_argument(
        "--connector", default="", choices=("", "sync", "mixed"), help="a fake KV connector (Workload)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per manager, alternated")
    parser.add_argument(
        "--count-calls", action="store_true", help="one more run per manager counting its calls"
    )
    for name, default in vars(Workload()).items():
        if isinstance(default, int) and not isinstance(default, bool) and name != "seed":
            parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drafter", default="", choices=["", *DRAFTERS], help="with --num-spec-tokens")
    args = parser.parse_args()
    w = Workload(
        **{
            k: getattr(args, k)
            for k in vars(Workload())
            if k
            not in (
                "groups",
                "async_scheduling",
                "prefix_caching",
                "reserve_full_isl",
                "connector",
                "drafter",
            )
        },
        connector=args.connector,
        drafter=args.drafter,
        groups=tuple(args.groups.split(",")),
        async_scheduling=args.async_scheduling,
        prefix_caching=not args.no_prefix_caching,
        reserve_full_isl=not args.no_reserve_full_isl,
    )
    ours, theirs = manager_class(args.manager), manager_class("vllm")
    times: dict[str, list[float]] = {"vllm": [], args.manager: []}
    verdict = None
    for _ in range(args.repeat):
        reference = run(w, theirs, watch_copies=False)
        candidate = run(w, ours, watch_copies=False)
        times["vllm"].append(reference.schedule_s + reference.update_s)
        times[args.manager].append(candidate.schedule_s + candidate.update_s)
        verdict = verdict or first_difference(reference, candidate)
    reference = run(w, theirs)  # untimed: with the duplicate-copy marks the verdict reads
    steps = len(reference.steps)
    print(f"workload: {w}")
    print(f"steps: {steps}, preemptions: {reference.preemptions}, prefix hits: {reference.prefix_hits}")
    for name, seconds in times.items():
        best = min(seconds)
        print(
            f"{name:>12}: schedule + update {best:.3f} s "
            f"({best / steps * 1e6:.1f} us/step, best of {len(seconds)})"
        )
    ratio = min(times[args.manager]) / min(times["vllm"])
    print(f"step time {args.manager} / vllm: {ratio:.3f}")
    if args.count_calls:
        # A separate run per manager with the calls counted (the counting slows it, so these
        # times are not those above): calls per step, time per call, the manager's share.
        for name, cls in (("vllm", theirs), (args.manager, ours)):
            t = run(w, cls, count_calls=True)
            n = len(t.steps)
            print(
                f"{name:>12}: {t.manager_calls / n:.1f} manager calls/step, "
                f"{t.manager_s / max(t.manager_calls, 1) * 1e6:.2f} us/call, "
                f"{t.manager_s / (t.schedule_s + t.update_s):.0%} of schedule + update"
            )
    explained = explained_divergence(reference, candidate)
    if verdict is None:
        print("traces identical")
    elif explained is not None:
        print(f"traces differ {explained}: explained (docs/conformance.md, Duplicate copies): {verdict}")
    else:
        print(f"traces differ: {verdict}")
    return 0 if verdict is None or explained is not None else 1


if __name__ == "__main__":
    sys.exit(main())
