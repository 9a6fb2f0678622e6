"""vLLM's HiSparse on pagedkv's vLLM manager: every HiSparse piece of a KV-cache config is
refused at construction by name, where vLLM's manager builds HiSparse machinery that answers
differently from full attention; the HiSparse look-alikes that vLLM answers as full attention are
accepted and answer the same calls identically; and the scheduler's HiSparse paths that do not
reach the manager's HiSparse state (a pending reclamation stalls a request rather than preempting
one, a pending spill keeps the scheduler alive) run the same on both managers.
docs/integrations/vllm.md (HiSparse: vLLM's contract and what pagedkv needs) says why the rest is
refused. Runs in the vLLM stage (scripts/vllm/stage.sh); skipped elsewhere.
"""

from __future__ import annotations

import functools
import random
from dataclasses import replace
from typing import Any

import pytest
from vllm_test_inputs import BS, request

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.sched.scheduler")

KINDS = ["vllm", "pagedkv"]


def _spec() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _hisparse_config(num_blocks: int = 16, host_num_blocks: int | None = 16) -> Any:
    """The four groups of a HiSparse model (as vLLM's own tests lay them out): the host
    source, the indexer, GPU-resident pages and a hot region."""
    from vllm.v1.kv_cache_interface import (
        HiSparseHotSpec,
        HiSparseResidentSpec,
        KVCacheConfig,
        KVCacheGroupRole,
        KVCacheGroupSpec,
    )

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        hisparse_host_num_blocks=host_num_blocks,
        kv_cache_groups=[
            KVCacheGroupSpec(["source"], _spec(), role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
            KVCacheGroupSpec(["indexer"], _spec(), role=KVCacheGroupRole.HISPARSE_INDEXER),
            KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=BS, page_size=BS * 4)),
            KVCacheGroupSpec(
                ["hot"],
                HiSparseHotSpec(block_size=BS, page_size=BS * 4, blocks_per_request=2),
                enable_kv_transfer=False,
            ),
        ],
    )


# The scheduler runs these to their max_tokens (no EOS stops them).
_request = functools.partial(request, ignore_eos=True)


def _one_group(num_blocks: int = 9, **group: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], _spec(), **group)],
    )


def _manager(kind: str, config: Any, **kwargs: Any) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

    args: dict[str, Any] = dict(max_model_len=128, scheduler_block_size=BS, hash_block_size=BS)
    args.update(kwargs)
    if kind == "vllm":
        return VllmKVCacheManager(config, **args)
    from pagedkv.integrations.vllm import KVCacheManager

    return KVCacheManager(config, **args)


def _answers(m: Any) -> list[Any]:
    """The answers of one manager to a fixed run of calls: admissions of three-block prompts,
    one decode growth past a block, frees, a prefix look-up; each answer the block ids, None, or
    the exception's type where the manager raised (and the run stops there)."""
    out: list[Any] = []
    try:
        held = []
        for i in range(4):
            r = _request(f"r{i}", 3 * BS, first=1000 * (i % 2))  # r2 repeats r0's prompt
            blocks, hit = m.get_computed_blocks(r)[:2]
            out.append(("hit", int(hit)))
            got = m.allocate_slots(r, 3 * BS - hit, hit, blocks if hit else None)
            out.append(None if got is None else got.get_block_ids())
            if got is not None:
                held.append(r)
        r = held[0]
        r.num_computed_tokens = 3 * BS
        r.append_output_token_ids(7)
        got = m.allocate_slots(r, 1)
        out.append(None if got is None else got.get_block_ids())
        for r in held:
            m.free(r)
        out.append(("free blocks", m.block_pool.get_num_free_blocks()))
        out.append(("hit after free", int(m.get_computed_blocks(_request("p", 3 * BS))[1])))
    except Exception as e:  # noqa: BLE001 (the exception's type is the answer compared)
        out.append(("raised", type(e).__name__))
    return out


def _refused_or_equal(config: Any, **kwargs: Any) -> str | None:
    """``"refused"`` when pagedkv's manager refuses the config by name at construction; None
    when it answers every call of ``_answers`` as vLLM's does; else the difference (a wrong
    schedule, which must never happen)."""
    from pagedkv.integrations.vllm import UnsupportedVllmFeatureError

    try:
        ours = _manager("pagedkv", config, **kwargs)
    except UnsupportedVllmFeatureError as e:
        assert "HiSparse" in str(e), e
        return "refused"
    theirs = _answers(_manager("vllm", config, **kwargs))
    mine = _answers(ours)
    ours.check_invariants()
    return None if mine == theirs else f"vLLM {theirs} != pagedkv {mine}"


def test_vllm_builds_hisparse_managers_for_what_pagedkv_refuses() -> None:
    """Each HiSparse piece makes vLLM build a per-group manager other than full attention's
    (the host pool, resident pages, a hot region), which pagedkv's core does not have: pagedkv
    refuses each by name, whether it comes alone or in a whole HiSparse layout."""
    from pagedkv.integrations.vllm import UnsupportedVllmFeatureError
    from vllm.v1.core.single_type_kv_cache_manager import (
        FullAttentionManager,
        HiSparseHotManager,
        HiSparseResidentManager,
        HiSparseSourceManager,
    )
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
    from vllm.v1.kv_cache_interface import KVCacheGroupRole

    full = _hisparse_config()
    vllm_full = _manager("vllm", full)
    kinds = [type(g) for g in vllm_full.coordinator.single_type_managers]
    assert kinds == [HiSparseSourceManager, FullAttentionManager, HiSparseResidentManager, HiSparseHotManager]
    coordinator = get_hisparse_coordinator(vllm_full)
    assert coordinator.get_host_block_pool().num_gpu_blocks == 16  # the source group's own pool
    source_only = _one_group(role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True)
    for config in (source_only, _one_group(role="hisparse_source")):
        assert type(_manager("vllm", config).coordinator.single_type_managers[0]) is HiSparseSourceManager

    def without_host(groups: list[Any]) -> Any:
        return replace(full, hisparse_host_num_blocks=None, kv_cache_groups=groups)

    cases = [
        (full, "hisparse_host_num_blocks=16"),
        (without_host(full.kv_cache_groups[1:]), "group 1: HiSparse HiSparseResidentSpec"),
        (without_host(full.kv_cache_groups[:2]), "group 0: the HiSparse source role"),
        (without_host(full.kv_cache_groups[1::2]), "group 1: HiSparse HiSparseHotSpec"),
        (source_only, "group 0: the HiSparse source role"),
        (_one_group(role=KVCacheGroupRole.HISPARSE_SOURCE), "HiSparse source role"),
        # hostile spellings: the role as a plain string (vLLM's registry finds the source
        # manager by it), an empty host pool (vLLM fails binding it)
        (_one_group(role="hisparse_source"), "HiSparse source role"),
        (replace(full, hisparse_host_num_blocks=0), "hisparse_host_num_blocks=0"),
    ]
    for config, name in cases:
        with pytest.raises(UnsupportedVllmFeatureError, match=name):
            _manager("pagedkv", config)


@pytest.mark.parametrize("caching", [False, True])
def test_a_hisparse_source_group_is_refused_where_vllm_answers_otherwise(caching: bool) -> None:
    """A source-role group without a host pool: vLLM's HiSparseSourceManager counts no device
    blocks for it and needs its coordinator to cache or to refuse (it fails an allocation
    full attention would refuse, and, with caching, the first one). pagedkv accepting it as full
    attention would answer those calls differently; it refuses the config by name."""
    from vllm.v1.kv_cache_interface import KVCacheGroupRole

    config = _one_group(role=KVCacheGroupRole.HISPARSE_SOURCE)
    vllm_answers = _answers(_manager("vllm", config, enable_caching=caching))
    plain = _answers(_manager("vllm", _one_group(), enable_caching=caching))
    assert vllm_answers != plain  # vLLM itself does not answer it as full attention
    assert vllm_answers[-1] == ("raised", "AssertionError")
    assert _refused_or_equal(config, enable_caching=caching) == "refused"


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("group", ["indexer", "host_resident"])
def test_hisparse_look_alikes_vllm_answers_as_full_attention_are_accepted(group: str, caching: bool) -> None:
    """An indexer-role group (vLLM builds a FullAttentionManager) and a host-resident group
    of the default role (the flag places tensors; the manager never reads it): both managers
    give the same block ids, refusals, frees and hits on the same calls."""
    from vllm.v1.kv_cache_interface import KVCacheGroupRole

    kwargs: dict[str, Any] = (
        {"role": KVCacheGroupRole.HISPARSE_INDEXER} if group == "indexer" else {"host_resident": True}
    )
    config = _one_group(**kwargs)
    assert _refused_or_equal(config, enable_caching=caching) is None
    # the run reaches a refusal (the fourth admission) and a hit (r2, and after the frees)
    answers = _answers(_manager("pagedkv", config, enable_caching=caching))
    assert None in answers and ("raised", "AssertionError") not in answers
    assert (("hit", 2 * BS) in answers) == caching


def test_the_scheduler_class_names_hisparse_before_its_connector(vllm_scheduler: Any) -> None:
    """A HiSparse model comes with its connector (kv_transfer_config): PagedkvScheduler names
    HiSparse, not the connector on a non-full-attention group that its resident groups are."""
    from pagedkv.integrations.vllm import PagedkvScheduler, UnsupportedVllmFeatureError

    module = vllm_scheduler
    base = module.build_scheduler(module.Workload(requests=1, connector="sync"), module.manager_class("vllm"))
    for host_blocks, name in ((16, "HiSparse host blocks"), (None, "group 0: the HiSparse source role")):
        with pytest.raises(UnsupportedVllmFeatureError, match=name):
            PagedkvScheduler(
                vllm_config=base.vllm_config,
                kv_cache_config=_hisparse_config(host_num_blocks=host_blocks),
                block_size=BS,
                log_stats=True,
                structured_output_manager=base.structured_output_manager,
            )


def _bind_hisparse_connector(scheduler: Any) -> Any:
    """A HiSparse connector on `scheduler`, bound to the coordinator of a HiSparse layout on
    vLLM's own manager (the only manager that builds one), as vLLM's scheduler tests bind it;
    its per-step metadata is left out (the scheduler's manager holds the requests, not the
    HiSparse one). Returns the coordinator."""
    from unittest.mock import Mock

    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
        HiSparseConnector,
        HiSparseConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    connector = object.__new__(HiSparseConnector)
    connector.connector_scheduler = HiSparseConnectorScheduler(async_speculative=False)
    connector.connector_worker = None  # the scheduler's side only
    coordinator = get_hisparse_coordinator(_manager("vllm", _hisparse_config()))
    connector.connector_scheduler.bind_coordinator(coordinator)
    composite = object.__new__(MultiConnector)
    composite._connectors = (connector,)
    composite.build_connector_meta = Mock(return_value=None)
    scheduler.connector = composite
    return coordinator


def _stall_trace(vllm_scheduler: Any, kind: str) -> list[Any]:
    """Two decoding requests on a pool they fill; the first needs a block at step 3 (from 0). A
    pending HiSparse reclamation (steps 3 and 4) must stall the step rather than preempt; once it is
    done, the scheduler preempts the second request as without HiSparse. Then both run to the
    end, and a spill left pending keeps the scheduler alive. The trace: per step, the scheduled
    tokens, the preempted requests and every request's status and preemption count."""
    from vllm.v1.request import RequestStatus

    module = vllm_scheduler
    w = module.Workload(requests=2, num_blocks=5, prefix_caching=False, max_model_len=128)
    scheduler = module.build_scheduler(w, module.manager_class(kind))
    requests = [_request(str(i), 2 * BS - 2, first=100 * i, max_tokens=6) for i in range(2)]
    for r in requests:
        scheduler.add_request(r)
    rng = random.Random(0)
    trace: list[Any] = []
    coordinator, composite = None, None
    reclaiming = {"now": False}
    for step in range(40):
        if not scheduler.has_unfinished_requests():
            break
        if step == 3:
            coordinator = _bind_hisparse_connector(scheduler)
            coordinator.has_pending_reclamation = lambda: reclaiming["now"]
        if step == 6:  # half-built as in vLLM's tests, it answers no finishing request: detach it
            composite, scheduler.connector = scheduler.connector, None
        reclaiming["now"] = step in (3, 4)
        out = scheduler.schedule()
        statuses = tuple((r.request_id, r.status.name, r.num_preemptions) for r in requests)
        scheduled = tuple(sorted(out.num_scheduled_tokens.items()))
        trace.append((scheduled, tuple(sorted(out.preempted_req_ids)), statuses))
        if reclaiming["now"]:
            assert not out.num_scheduled_tokens and not out.preempted_req_ids
            assert all(r.status == RequestStatus.RUNNING and r.num_preemptions == 0 for r in requests)
        scheduler.update_from_output(out, module._runner_output(out, scheduler, rng))
        if hasattr(scheduler.kv_cache_manager, "check_invariants"):
            scheduler.kv_cache_manager.check_invariants()
    assert not scheduler.has_unfinished_requests() and coordinator is not None
    assert requests[1].num_preemptions == 1  # once the reclamation was done
    scheduler.connector = composite
    scheduler.finished_req_ids.clear()  # reported by the step that would follow
    assert not scheduler.has_requests()
    coordinator.pending_spills[0] = object()  # a spill still in flight
    assert scheduler.has_requests()
    coordinator.pending_spills.clear()
    assert not scheduler.has_requests()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == w.num_blocks - 1
    return trace


def test_a_pending_hisparse_reclamation_stalls_rather_than_preempts(vllm_scheduler: Any) -> None:
    """vLLM's scheduler tests of a HiSparse connector's pending reclamation and pending spills
    (test_pending_hisparse_reclamation_defers_preemption, ..._spill_keeps_scheduler_alive) with
    the scheduler's allocation really refused, not mocked: the stalled step calls pagedkv's
    allocate_slots, which refuses and changes nothing, and the same calls the next step. Both
    managers give the same trace."""
    vllm_trace = _stall_trace(vllm_scheduler, "vllm")
    pagedkv_trace = _stall_trace(vllm_scheduler, "pagedkv")
    assert pagedkv_trace == vllm_trace
    assert vllm_trace[3][0] == vllm_trace[4][0] == ()  # stalled twice,
    assert vllm_trace[5][1] == ("1",)  # then the second request preempted
