"""The scheduler differential of ``benches/vllm_scheduler.py`` sees what it must see.

vLLM's real scheduler run twice on the same requests: with vLLM's own KV-cache manager against a
subclass that adds nothing, the traces are identical; against a manager that never reports a
prefix-cache hit (a wrong manager), they differ. The comparison of pagedkv's drop-in
(tests/vllm/test_vllm_scheduler_differential.py) relies on both.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benches" / "vllm_scheduler.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_scheduler", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _vllm_available() -> bool:
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except Exception:  # noqa: BLE001 (a broken partial install skips as well)
        return False
    return True


needs_vllm = pytest.mark.skipif(
    not _vllm_available(),
    reason="vLLM 0.33's scheduler (and torch) not importable: runs in the vLLM stage (scripts/vllm/stage.sh)",
)


def test_script_imports_without_vllm() -> None:
    module = _load()
    assert module.Workload().groups == ("full",)


@needs_vllm
def test_identical_managers_give_identical_traces() -> None:
    module = _load()
    w = module.Workload(requests=12, num_blocks=60, max_num_batched_tokens=128)
    reference = module.run(w, module.manager_class("vllm"))
    same = module.run(w, module.manager_class("passthrough"))
    assert module.first_difference(reference, same) is None
    # the workload exercises what the comparison is for: hits and preemptions
    assert reference.prefix_hits > 0
    assert reference.preemptions > 0


@needs_vllm
def test_a_manager_that_loses_hits_is_caught() -> None:
    module = _load()
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    class NoHits(KVCacheManager):  # type: ignore[misc]
        def get_computed_blocks(self, request, max_cache_hit_length=None):  # type: ignore[no-untyped-def]
            return self.empty_kv_cache_blocks, 0, 0

    w = module.Workload(requests=12, num_blocks=60, max_num_batched_tokens=128)
    assert module.first_difference(module.run(w, module.manager_class("vllm")), module.run(w, NoHits))


def test_a_difference_is_explained_only_after_vllm_indexed_two_copies() -> None:
    """The explained-divergence rule (docs/conformance.md, Duplicate copies) on made-up traces:
    a difference at or before the step vLLM first indexed two copies of one content is real."""
    module = _load()
    same, other = ((("a", 1),), (), ()), ((("a", 2),), (), ())
    reference = module.Trace(steps=[same, same, same, same])
    candidate = module.Trace(steps=[same, same, other, same])
    assert module.explained_divergence(reference, candidate) is None  # no duplicates: real
    reference.duplicates_since = 2
    assert module.explained_divergence(reference, candidate) is None  # not after them: real
    reference.duplicates_since = 1
    assert "from step 2" in (module.explained_divergence(reference, candidate) or "")
    assert module.explained_divergence(reference, module.Trace(steps=list(reference.steps))) is None
