"""vLLM's auxiliary-output connector (``aux_output_config``, e.g. routed experts) on pagedkv's
manager sees what it sees on vLLM's (docs/integrations/vllm.md, Auxiliary outputs).

vLLM's real scheduler (benches/vllm_scheduler.py's harness) runs the same requests on each
manager with vLLM's own ``AuxOutputSchedulerConnector`` attached, as the scheduler attaches it
when ``aux_output_config`` is on. Per step, compared whole: the connector's metadata (the
hashes sent per request, the finished requests, the block hashes it retains and releases past
its capacity) and the answer of ``block_pool.get_cached_block`` for every hash of every request
(the look-up by one hash the connector makes). They must be equal step for step, except after
vLLM first indexed two copies of one content (pagedkv keeps one copy per content,
docs/conformance.md, Duplicate copies). Then ``get_cached_block`` against vLLM's answers for
hashes and groups no block holds, and ``PagedkvScheduler`` accepting the config.
"""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest

NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.sched.scheduler")


def _with_aux_rows(output: Any, scheduler: Any) -> Any:
    """The fake model runner's output with auxiliary rows for every scheduled request (the
    worker's ``aux_output_connector_output``), covering every token the request may hold."""
    import numpy as np
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

    output.aux_output_connector_output = {
        r: AuxRequestOutput(0, np.zeros((scheduler.requests[r].num_tokens + 8, 1, 1), np.uint8))
        for r in output.req_ids
    }
    return output


def _metadata(meta: Any) -> tuple[Any, ...]:
    return (
        meta.generation,
        tuple(sorted(meta.requests.items())),
        tuple(sorted((r, tuple(h)) for r, h in meta.block_hashes.items())),
        tuple(sorted(meta.finished_requests)),
        tuple(meta.retained_block_hashes or ()),
        tuple(meta.released_block_hashes or ()),
    )


def _run(module: ModuleType, w: Any, manager: Any) -> tuple[list[Any], int | None]:
    """Per step: the connector's metadata and the cached-or-not answer for every hash of every
    request, by group; and the first step after which vLLM's index held two copies of one
    content (None: never, or not vLLM's manager)."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    scheduler = module.build_scheduler(w, manager)
    kv = scheduler.kv_cache_manager
    scheduler.aux_output_connector = AuxOutputSchedulerConnector(kv)
    requests = module.make_requests(w)
    for request in requests:
        scheduler.add_request(request)
    rng = random.Random(1)
    groups = range(len(w.groups))
    steps: list[Any] = []
    duplicates_since = None
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        meta = _metadata(out.aux_output_connector_metadata)
        scheduler.update_from_output(
            out, _with_aux_rows(module._runner_output(out, scheduler, rng), scheduler)
        )
        cached = tuple(
            kv.block_pool.get_cached_block(h, [g]) is not None
            for r in requests
            for h in r.block_hashes
            for g in groups
        )
        if duplicates_since is None and module.has_duplicate_copies(kv):
            duplicates_since = len(steps)
        steps.append((meta, cached))
        assert len(steps) < 10_000
    assert scheduler.reset_prefix_cache()
    steps.append((_metadata(scheduler.schedule().aux_output_connector_metadata), ()))
    return steps, duplicates_since


CONFIGS = {
    # 24 requests on 40 blocks: evictions, and retained blocks past the connector's capacity
    # (the pool's blocks) released.
    "full": dict(requests=24, num_blocks=40, max_num_batched_tokens=128, prompt_max=160),
    # vLLM's hybrid coordinator: the connector asks about its full_attention_group_id (1 here);
    # a window group's released blocks are evicted while the full group's are held, so the two
    # groups' answers differ (no shared prefixes: no recomputed prefix, no duplicate copies).
    "window+full": dict(
        requests=16,
        num_blocks=80,
        max_num_batched_tokens=128,
        groups=("swa", "full"),
        window=32,
        prompt_max=160,
        shared_prefix=0,
    ),
    "async": dict(
        requests=24, num_blocks=40, max_num_batched_tokens=128, prompt_max=160, async_scheduling=True
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_aux_output_connector_sees_the_same_cache(name: str, vllm_scheduler: ModuleType) -> None:
    module = vllm_scheduler
    w = module.Workload(**CONFIGS[name])
    reference, duplicates_since = _run(module, w, module.manager_class("vllm"))
    candidate, _ = _run(module, w, module.manager_class("pagedkv"))
    end = len(reference) if duplicates_since is None else duplicates_since
    for step, (a, b) in enumerate(zip(reference[:end], candidate[:end], strict=False)):
        assert a == b, f"{name}: step {step} differs:\n  vLLM:    {a}\n  pagedkv: {b}"
    if duplicates_since is None:
        assert len(reference) == len(candidate)
    # The comparison covers what it is for: retained and released blocks, cached answers that
    # change from True to False (evictions) within the compared steps.
    compared = reference[:end]
    assert end >= 10, f"{name}: only {end} steps before duplicate copies"
    assert any(meta[4] for meta, _ in compared), f"{name}: nothing retained"
    assert any(meta[5] for meta, _ in compared), f"{name}: nothing released"
    pairs = zip(compared, compared[1:], strict=False)
    evicted = any(x and not y for (_, c0), (_, c1) in pairs for x, y in zip(c0, c1, strict=False))
    assert evicted, f"{name}: no eviction observed"
    if len(w.groups) > 1:
        # The answers are per group (one group's cached block is not the other's).
        per_group = any(c[i] != c[i + 1] for _, c in compared for i in range(0, len(c), 2))
        assert per_group, f"{name}: the groups' answers never differ"


def test_get_cached_block_misses_as_vllms(vllm_scheduler: ModuleType) -> None:
    """A hash no block holds, a group the model does not have: ``None`` from both pools; the
    coordinator's ``full_attention_group_id`` is vLLM's."""
    module = vllm_scheduler
    for groups in (("full",), ("swa", "full"), ("full", "swa")):
        w = module.Workload(requests=2, num_blocks=40, groups=groups)
        answers = []
        for name in ("vllm", "pagedkv"):
            scheduler = module.build_scheduler(w, module.manager_class(name))
            kv = scheduler.kv_cache_manager
            for request in module.make_requests(w):
                scheduler.add_request(request)
            scheduler.schedule()
            known = next(iter(scheduler.requests.values())).block_hashes[0]
            pool = kv.block_pool
            answers.append(
                (
                    getattr(kv.coordinator, "full_attention_group_id", None),
                    pool.get_cached_block(b"\x07" * 32, [0]),
                    pool.get_cached_block(known, [len(groups)]),
                    pool.get_cached_block(known, list(range(len(groups)))) is not None,
                )
            )
        assert answers[0] == answers[1], (groups, answers)
        assert answers[0][3]


def test_pagedkv_scheduler_accepts_aux_outputs(vllm_scheduler: ModuleType) -> None:
    """``PagedkvScheduler`` builds with ``aux_output_config`` on, and vLLM's scheduler attaches
    its connector to pagedkv's manager."""
    from pagedkv.integrations.vllm import KVCacheManager, PagedkvScheduler
    from vllm.config import AuxOutputConfig

    class WithAux(PagedkvScheduler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["vllm_config"].aux_output_config = AuxOutputConfig(enable_return_routed_experts=True)
            super().__init__(*args, **kwargs)

    module = vllm_scheduler
    scheduler = module.build_scheduler(
        module.Workload(requests=1, num_blocks=40), module.manager_class("vllm"), scheduler_cls=WithAux
    )
    assert isinstance(scheduler.kv_cache_manager, KVCacheManager)
    assert scheduler.aux_output_connector is not None
    assert scheduler.aux_output_connector._block_pool is scheduler.kv_cache_manager.block_pool
