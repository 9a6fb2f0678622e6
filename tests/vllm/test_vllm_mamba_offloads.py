"""The boundary-state offers of a Mamba group (``take_boundary_state_offloads``) on pagedkv's vLLM
manager are vLLM's: vLLM's ``MambaManager`` offers, in align mode, every state block its
``cache_blocks`` caches, with the tokens up to its end, and the scheduler drains them every step
into the KV connector's block state (a connector offloads them so that a later request can hit
that prefix). vLLM's real scheduler runs the same requests on both managers (benches/
vllm_scheduler.py's harness) and the offers each hands the scheduler per step are compared:
requests, groups and boundaries equal, each block the request's own block at that boundary,
until the schedules part (where they do: a traced duplicate copy,
tests/vllm/test_vllm_scheduler_differential.py). Runs in the vLLM stage (scripts/vllm/stage.sh);
skipped elsewhere.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from vllm_test_inputs import mamba_workload, window_mamba_workload

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.kv_cache_manager")

CONFIGS = {
    "full+mamba": mamba_workload(),
    "full+mamba-chunk-admission": mamba_workload(reserve_full_isl=False),
    "async-full+mamba": mamba_workload(async_scheduling=True),
    "connector-sync-full+mamba": mamba_workload(connector="sync"),
    "connector-mixed-full+mamba": mamba_workload(155, connector="mixed"),
    "full+mamba-skip-reading": mamba_workload(skip_reading_every=3),
    "full+mamba-tight": mamba_workload(80),
    # beside a window group of 48 tokens (the schedules part at step 37 on 140 blocks)
    "full+swa+mamba-chunk-admission": window_mamba_workload(200, reserve_full_isl=False),
    "full+swa+mamba-tight": window_mamba_workload(140),
}


def _recording(cls: Any, block_size: int, log: list[dict[str, list[tuple[int, int]]]]) -> Any:
    """`cls`, noting per step the offers it hands the scheduler as (group, boundary) per request,
    after checking each offered block is the request's block at its boundary."""

    class Recording(cls):  # type: ignore[misc, valid-type]
        def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
            offers = super().take_boundary_state_offloads()
            step: dict[str, list[tuple[int, int]]] = {}
            for request_id, entries in offers.items():
                tables = self.get_block_ids(request_id)
                for group, block, boundary in entries:
                    assert block == tables[group][boundary // block_size - 1], (request_id, group)
                    step.setdefault(request_id, []).append((group, boundary))
            log.append(step)
            return offers

    return Recording


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_boundary_state_offers_as_vllms_manager(name: str, vllm_scheduler: ModuleType) -> None:
    module = vllm_scheduler
    w = module.Workload(**CONFIGS[name])
    theirs: list[dict[str, list[tuple[int, int]]]] = []
    ours: list[dict[str, list[tuple[int, int]]]] = []
    reference = module.run(w, _recording(module.manager_class("vllm"), w.block_size, theirs))
    candidate = module.run(
        w, _recording(module.manager_class("pagedkv"), w.block_size, ours), check_invariants=True
    )
    parted = module.first_different_step(reference, candidate)
    compared = len(theirs) if parted is None else parted
    # (Step i's offers are drained at the end of schedule i: equal up to the first step that
    # schedules differently.)
    for step in range(compared):
        assert ours[step] == theirs[step], f"step {step}: vLLM {theirs[step]}, pagedkv {ours[step]}"
    assert sum(len(entries) for step in theirs[:compared] for entries in step.values()) > 30


@pytest.mark.parametrize("release", ["free", "pop_blocks_for_free", "none"])
def test_a_freed_requests_offers_are_dropped(release: str) -> None:
    """An admission whose chunk ends at a block's end caches its state block and offers it; a
    request freed before the offers are taken (preempted in the same step, finished in an
    async update) has its offers dropped on both managers, the others kept."""
    from pagedkv.integrations.vllm import KVCacheManager
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm_test_inputs import BS, admit_alike, mamba_config

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    args: dict[str, Any] = dict(
        max_model_len=512, enable_caching=True, scheduler_block_size=BS, hash_block_size=BS
    )
    managers = {
        "vllm": VllmKVCacheManager(mamba_config(64), **args),
        "pagedkv": KVCacheManager(mamba_config(64), **args),
    }
    a = admit_alike(managers, "a", list(range(1, 3 * BS + 1)), hasher)
    admit_alike(managers, "b", list(range(1000, 1000 + 2 * BS)), hasher)
    answers = {}
    for kind, m in managers.items():
        if release != "none":
            getattr(m, release)(a[kind])
        answers[kind] = {
            rid: [(g, t) for g, _, t in entries] for rid, entries in m.take_boundary_state_offloads().items()
        }
        assert m.take_boundary_state_offloads() == {}  # drained
    assert answers["vllm"] == answers["pagedkv"]
    expected = {"b": [(1, 2 * BS)]} if release != "none" else {"a": [(1, 3 * BS)], "b": [(1, 2 * BS)]}
    assert answers["pagedkv"] == expected
