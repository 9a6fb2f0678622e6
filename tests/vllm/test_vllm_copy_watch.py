"""The shadow of pagedkv's one-copy prefix index that benches/vllm_copy_watch.py keeps from vLLM's
block pool (``Trace.spared_copy_since``, which the scheduler differential bounds two of its
configurations by) is pagedkv's own, step by step.

vLLM's scheduler runs the same workload on vLLM's manager, with the shadow, and on pagedkv's
drop-in: after every step the shadow's free-list count (vLLM's unindexed free blocks, one block
per spare copy, less one per content pagedkv kept where vLLM evicted it) must equal the core's
``num_free_list_blocks``, until the first step where the shadow stops (its mark), a revived copy
(which it does not follow) or the traces part. The workloads are chosen so that the count differs
from vLLM's own unindexed free blocks at some of those steps: the spare copies and the kept
contents are what is checked.

Runs in the vLLM stage of the test command (scripts/vllm/stage.sh); skipped elsewhere.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from vllm_test_inputs import window_config

# name -> Workload overrides: the differential's two configurations that part at a kept content,
# and two identical to the end whose shadows keep contents no look-up reaches (the copies of a
# connector's async loads; of two live requests, with chunk-only admission, until a revival).
WORKLOADS: dict[str, dict[str, object]] = {
    "chunk-admission-full+swa": window_config(48, reserve_full_isl=False),
    "connector-sync-chunk-admission-full+swa": window_config(48, connector="sync", reserve_full_isl=False),
    "connector-mixed-full+swa-two-tokens": window_config(2, connector="mixed"),
    "connector-mixed-full+swa": window_config(48, connector="mixed"),
}


def _run(module: ModuleType, w: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list]:
    """One run on manager `name`; its trace and, per step, (the free-list count: the shadow's on
    vLLM's manager, the core's on pagedkv's; vLLM's unindexed free blocks, or None)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    shadows: list[Any] = []
    watch = module.watch_spared_evictions

    def watching(*args: Any) -> Any:
        shadows.append(watch(*args))
        return shadows[-1]

    counts: list[tuple[int, int | None]] = []
    update = Scheduler.update_from_output

    def updated(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = update(self, *args, **kwargs)
        if shadows:
            pool = self.kv_cache_manager.block_pool
            unindexed = sum(b.block_hash is None for b in pool.free_block_queue.get_all_free_blocks())
            counts.append((shadows[0].free_list_blocks(), unindexed))
        else:
            counts.append((int(self.kv_cache_manager._core.num_free_list_blocks), None))
        return out

    with monkeypatch.context() as patch:
        patch.setattr(module, "watch_spared_evictions", watching)
        patch.setattr(Scheduler, "update_from_output", updated)
        trace = module.run(w, module.manager_class(name), shadow_copies=True)
    assert bool(shadows) == (name == "vllm")
    return trace, counts


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_shadow_free_list_is_pagedkvs(
    vllm_scheduler: ModuleType, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = vllm_scheduler
    w = module.Workload(**WORKLOADS[name])
    reference, shadow = _run(module, w, "vllm", monkeypatch)
    ours, core = _run(module, w, "pagedkv", monkeypatch)
    marks = [
        reference.spared_copy_since,
        reference.revived_copy_since,
        module.first_different_step(reference, ours),
    ]
    end = min([m for m in marks if m is not None], default=len(reference.steps))
    assert end > 10
    # the shadow's count is the core's at every step before its end ...
    assert [s[0] for s in shadow[:end]] == [c[0] for c in core[:end]]
    # ... and not merely vLLM's unindexed free blocks: spare copies were on pagedkv's free list
    assert any(free != unindexed for free, unindexed in shadow[:end])
