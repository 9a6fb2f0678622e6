"""The scheduler differential of ``benches/vllm_scheduler.py`` sees what it must see.

vLLM's real scheduler run twice on the same requests: with vLLM's own KV-cache manager against a
subclass that adds nothing, the traces are identical; against a manager that never reports a
prefix-cache hit (a wrong manager), they differ. The comparison of pagedkv's drop-in
(tests/vllm/test_vllm_scheduler_differential.py) relies on both.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


def test_script_imports_without_vllm(load_bench: Callable[[str], ModuleType]) -> None:
    module = load_bench("vllm_scheduler")
    assert module.Workload().groups == ("full",)


def test_identical_managers_give_identical_traces(vllm_scheduler: ModuleType) -> None:
    module = vllm_scheduler
    w = module.Workload(requests=12, num_blocks=60, max_num_batched_tokens=128)
    reference = module.run(w, module.manager_class("vllm"))
    same = module.run(w, module.manager_class("passthrough"))
    assert module.first_difference(reference, same) is None
    # the workload exercises what the comparison is for: hits and preemptions
    assert reference.prefix_hits > 0
    assert reference.preemptions > 0


def test_a_manager_that_loses_hits_is_caught(vllm_scheduler: ModuleType) -> None:
    module = vllm_scheduler
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    class NoHits(KVCacheManager):  # type: ignore[misc]
        def get_computed_blocks(self, request, max_cache_hit_length=None):  # type: ignore[no-untyped-def]
            return self.empty_kv_cache_blocks, 0, 0

    w = module.Workload(requests=12, num_blocks=60, max_num_batched_tokens=128)
    assert module.first_difference(module.run(w, module.manager_class("vllm")), module.run(w, NoHits))


def test_a_difference_is_explained_only_after_vllm_indexed_two_copies(
    load_bench: Callable[[str], ModuleType],
) -> None:
    """The explained-divergence rule (docs/conformance.md, Duplicate copies) on made-up traces:
    a difference at or before the step vLLM first indexed two copies of one content is real."""
    module = load_bench("vllm_scheduler")
    same, other = ((("a", 1),), (), ()), ((("a", 2),), (), ())
    reference = module.Trace(steps=[same, same, same, same])
    candidate = module.Trace(steps=[same, same, other, same])
    assert module.explained_divergence(reference, candidate) is None  # no duplicates: real
    reference.duplicates_since = 2
    assert module.explained_divergence(reference, candidate) is None  # not after them: real
    reference.duplicates_since = 1
    assert "from step 2" in (module.explained_divergence(reference, candidate) or "")
    assert module.explained_divergence(reference, module.Trace(steps=list(reference.steps))) is None


def test_the_step_only_count_wraps_each_step_call(
    vllm_scheduler: ModuleType, load_bench: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """benches/vllm_scheduler_instructions.py ``--steps-only``: every ``schedule`` and
    ``update_from_output`` of a run goes through ``operator.call`` (callgrind collects inside
    it only), nothing else of the loop does, and the run's trace is a plain run's."""
    import operator

    module = vllm_scheduler
    instructions = load_bench("vllm_scheduler_instructions")
    w = module.Workload(requests=8, num_blocks=60, max_num_batched_tokens=128)
    plain = module.run(w, module.manager_class("pagedkv"))
    monkeypatch.setattr(module, "build_scheduler", module.build_scheduler)  # restored after
    called: list[str] = []
    call = operator.call

    def counted(f: Callable[..., object], *args: object) -> object:
        called.append(f.__name__)
        return call(f, *args)

    monkeypatch.setattr(operator, "call", counted)
    instructions._count_steps_only()
    wrapped = module.run(w, module.manager_class("pagedkv"))
    assert module.first_difference(plain, wrapped) is None
    steps = len(wrapped.steps)
    assert steps > 10
    assert called == ["schedule", "update_from_output"] * steps
