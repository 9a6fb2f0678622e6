"""pagedkv's drop-in publishes the KV events vLLM's own manager publishes.

vLLM's real scheduler (benches/vllm_scheduler.py's harness) runs the same requests twice, once on
vLLM's ``KVCacheManager`` and once on pagedkv's, both with ``enable_kv_cache_events``; the events
each manager hands the scheduler per step (``take_events``) are compared whole: ``BlockStored``
(block hashes, parent hash, token ids, block size, medium, group index, LoRA id and name, extra
keys, session id, ...), ``BlockRemoved`` and ``AllBlocksCleared``, in order. They must be equal
step for step, except after vLLM first indexed two copies of one content: pagedkv keeps one copy
per content (docs/conformance.md, Duplicate copies), so from there vLLM reports stores and
removals of copies pagedkv never made (docs/integrations/vllm.md, KV events).
"""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest


def _recording(cls: Any) -> Any:
    """`cls` with KV events on, keeping what it hands the scheduler per step."""

    class Recording(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["enable_kv_cache_events"] = True
            super().__init__(*args, **kwargs)
            self.steps: list[list[Any]] = []

        def take_events(self) -> list[Any]:
            events = super().take_events()
            self.steps.append(list(events))
            return events

    return Recording


def _requests(module: ModuleType, w: Any, extras: bool) -> list[Any]:
    """The workload's requests; with `extras`, every request carries a session, and some a
    LoRA adapter, a cache salt, or vLLM's "full" report mode (hits reported as stores)."""
    requests = module.make_requests(w)
    if not extras:
        return requests
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(w.block_size, sha256)
    out = []
    for i, r in enumerate(requests):
        params = SamplingParams(
            max_tokens=r.sampling_params.max_tokens,
            ignore_eos=True,
            extra_args={"kv_cache_report_mode": "full"} if i % 2 else None,
        )
        out.append(
            Request(
                request_id=r.request_id,
                prompt_token_ids=list(r.prompt_token_ids),
                sampling_params=params,
                pooling_params=None,
                block_hasher=hasher,
                lora_request=LoRARequest("adapter-a", 7, "/nonexistent") if i % 3 == 1 else None,
                cache_salt="salt" if i % 5 == 2 else None,
                session_id=f"session-{i % 4}",
            )
        )
    return out


def _run(module: ModuleType, w: Any, manager: Any, extras: bool) -> tuple[list[list[Any]], int | None]:
    """Events per step of one scheduler run (the last step: a prefix-cache reset once every
    request finished), and the first step after which vLLM's index held two copies of one
    content (None: never, or not vLLM's manager): in that step vLLM stored the second copy."""
    scheduler = module.build_scheduler(w, _recording(manager))
    for request in _requests(module, w, extras):
        scheduler.add_request(request)
    rng = random.Random(1)
    kv = scheduler.kv_cache_manager
    duplicates_since = None
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, module._runner_output(out, scheduler, rng))
        if duplicates_since is None and module.has_duplicate_copies(kv):
            duplicates_since = steps
        steps += 1
        assert steps < 10_000
    assert scheduler.reset_prefix_cache()
    kv.take_events()  # the scheduler publishes the reset's events at its next step
    return kv.steps, duplicates_since


def _first_difference(reference: list[list[Any]], candidate: list[list[Any]]) -> tuple[int, str] | None:
    for i, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return i, f"step {i}:\n  vLLM:    {a}\n  pagedkv: {b}"
    if len(reference) != len(candidate):
        return min(len(reference), len(candidate)), f"{len(reference)} steps != {len(candidate)} steps"
    return None


CONFIGS = {
    "full": dict(requests=16, num_blocks=60, max_num_batched_tokens=128),
    # vLLM recomputes a prefix whose window blocks were evicted and indexes a second copy of
    # its full-attention blocks (step 14), where pagedkv stores only the rest: equal before.
    "full+window": dict(
        requests=16, num_blocks=80, max_num_batched_tokens=128, groups=("full", "swa"), window=32
    ),
    "async": dict(requests=16, num_blocks=60, max_num_batched_tokens=128, async_scheduling=True),
    "extra-keys": dict(requests=16, num_blocks=60, max_num_batched_tokens=128),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_kv_events_as_vllms_manager(name: str, vllm_scheduler: ModuleType) -> None:
    module = vllm_scheduler
    w = module.Workload(**CONFIGS[name])
    extras = name == "extra-keys"
    reference, duplicates_since = _run(module, w, module.manager_class("vllm"), extras)
    candidate, _ = _run(module, w, module.manager_class("pagedkv"), extras)
    difference = _first_difference(reference, candidate)
    if difference is not None:
        step, words = difference
        # Explained only from the step vLLM indexed a second copy of one content on (its store
        # is the first event pagedkv does not make: the module docstring).
        assert duplicates_since is not None and step >= duplicates_since, words
    # The comparison covers what it is for: stores, removals (evictions), the reset, and with
    # the extras every field vLLM fills from the request.
    flat = [e for step in reference for e in step]
    kinds = {type(e).__name__ for e in flat}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds
    if extras:
        stored = [e for e in flat if type(e).__name__ == "BlockStored"]
        assert any(e.lora_name == "adapter-a" for e in stored)
        assert any(e.extra_keys and any(k is not None for k in e.extra_keys) for e in stored)
        assert {e.session_id for e in stored} >= {"session-0", "session-1"}
    if len(w.groups) > 1:
        assert {e.group_idx for e in flat if type(e).__name__ == "BlockStored"} == {0, 1}
