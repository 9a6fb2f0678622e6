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

from collections import Counter
from types import ModuleType
from typing import Any

import pytest
from vllm_test_inputs import mamba_workload, window_mamba_workload


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
    """Events per step of one scheduler run (the harness's loop, benches/vllm_scheduler.py, on
    these requests; the last step: a prefix-cache reset once every request finished), and the
    first step after which vLLM's index held two copies of one content (None: never, or not
    vLLM's manager): in that step vLLM stored the second copy."""
    managers: list[Any] = []

    def reset(scheduler: Any) -> None:
        assert scheduler.reset_prefix_cache()
        scheduler.kv_cache_manager.take_events()  # the scheduler publishes them at its next step
        managers.append(scheduler.kv_cache_manager)

    trace = module.run(
        w, _recording(manager), max_steps=10_000, requests=_requests(module, w, extras), loop_ends=reset
    )
    return managers[0].steps, trace.duplicates_since


def _one_copy(steps: list[list[Any]], block_size: int) -> tuple[list[list[Any]], list[set[Any]]]:
    """vLLM's events as a pool that indexes one copy per content reports them, and what a router
    fed by them knows after each step (the (group, hash) pairs it holds a copy of). vLLM stores
    a second copy of a cached content when a request recomputes it (a hit capped short of it,
    or a Mamba group's hit lagging full attention's) and removes each copy on its own: here a
    store of a content already held, and a removal that leaves a copy, are dropped. A store
    whose leading blocks are such copies starts after them, as pagedkv's store of the rest
    does (its parent the last copy's hash, its tokens and keys the rest's)."""
    from msgspec.structs import replace

    held: Counter[tuple[int, Any]] = Counter()
    events: list[list[Any]] = []
    views: list[set[Any]] = []
    for step in steps:
        kept: list[Any] = []
        for e in step:
            kind = type(e).__name__
            if kind == "BlockStored":
                new = [i for i, h in enumerate(e.block_hashes) if held[e.group_idx, h] == 0]
                for h in e.block_hashes:
                    held[e.group_idx, h] += 1
                if not new:
                    continue
                # Copies are recomputed blocks: each run of new blocks is a store of its own
                # (full attention: one run after the copies; a window group's copies can
                # follow new blocks, the run between them evicted where the rest stayed).
                runs: list[list[int]] = []
                for i in new:
                    if runs and runs[-1][-1] == i - 1:
                        runs[-1].append(i)
                    else:
                        runs.append([i])
                for run in runs:
                    first, end = run[0], run[-1] + 1
                    if (first, end) != (0, len(e.block_hashes)):
                        part = replace(
                            e,
                            block_hashes=e.block_hashes[first:end],
                            parent_block_hash=e.block_hashes[first - 1] if first else e.parent_block_hash,
                            token_ids=e.token_ids[first * block_size : end * block_size],
                            extra_keys=e.extra_keys[first:end] if e.extra_keys is not None else None,
                            lookahead_token_ids=(
                                e.lookahead_token_ids[first:end]
                                if e.lookahead_token_ids is not None
                                else None
                            ),
                        )
                    else:
                        part = e
                    kept.append(part)
            elif kind == "BlockRemoved":
                gone = []
                for h in e.block_hashes:
                    held[e.group_idx, h] -= 1
                    assert held[e.group_idx, h] >= 0, f"a removal of a block never stored: {e}"
                    if held[e.group_idx, h] == 0:
                        gone.append(h)
                if gone:
                    kept.append(replace(e, block_hashes=gone))
            else:
                held.clear()
                kept.append(e)
        events.append(kept)
        views.append({key for key, n in held.items() if n})
    return events, views


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
    "full+mamba": mamba_workload(),
    "async-full+mamba": mamba_workload(async_scheduling=True),
    "full+mamba-tight": mamba_workload(80),
    "connector-sync-full+mamba": mamba_workload(connector="sync"),
    # every third request skips reading the prefix cache, and its blocks are stored all the same
    "skip-reading": dict(requests=16, num_blocks=60, max_num_batched_tokens=128, skip_reading_every=3),
    "connector-mixed-full+mamba": mamba_workload(155, connector="mixed"),
    "connector-mixed-async-full+mamba": mamba_workload(155, connector="mixed", async_scheduling=True),
    # Mamba beside a window group of 48 tokens
    "full+swa+mamba": window_mamba_workload(140),
    "connector-mixed-async-full+swa+mamba": window_mamba_workload(
        200, connector="mixed", async_scheduling=True
    ),
}


# Steps compared past vLLM's first copy at least (where the routers' views part).
COMPARED_STEPS = {
    "full+window": 19,
    "full+mamba": 23,
    "async-full+mamba": 23,
    "full+mamba-tight": 22,
    "connector-sync-full+mamba": 19,
    "connector-mixed-full+mamba": 14,
    "connector-mixed-async-full+mamba": 14,
    # (vLLM's copies from step 2 on; the window group's recomputed blocks part the views soon)
    "full+swa+mamba": 7,
    "connector-mixed-async-full+swa+mamba": 6,
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
    if not extras:  # (vLLM's "full" report mode stores held blocks again: not copies)
        # Past the copies: vLLM's events as a one-copy pool reports them are pagedkv's, step
        # for step, until the two routers' views part (vLLM's copies took blocks, so it evicted
        # what pagedkv's cache still holds), which again only a copy explains. pagedkv's own
        # events are one-copy events already.
        one_copy, views = _one_copy(reference, w.block_size)
        own, own_views = _one_copy(candidate, w.block_size)
        assert own == candidate
        parted = next(
            (i for i, (a, b) in enumerate(zip(views, own_views, strict=True)) if a != b), len(views)
        )
        difference = _first_difference(one_copy[:parted], candidate[:parted])
        assert difference is None, difference[1] if difference else ""
        if parted < len(views):
            assert duplicates_since is not None and parted > duplicates_since, parted
        assert parted >= COMPARED_STEPS.get(name, 0), parted
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
        assert {e.group_idx for e in flat if type(e).__name__ == "BlockStored"} == set(range(len(w.groups)))
