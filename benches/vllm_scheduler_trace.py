"""What one run of vLLM's scheduler decided (``Trace``, filled by benches/vllm_scheduler.py's
``run``), and how two runs' decisions compare: where they first differ, and whether a difference is
the one explained by vLLM's duplicate copies (docs/conformance.md, Duplicate copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trace:
    """What one scheduler run decided, step by step."""

    steps: list[tuple[tuple[tuple[str, int], ...], tuple[str, ...], tuple[str, ...]]] = field(
        default_factory=list
    )  # (sorted (request, scheduled tokens), preempted, finished) per step
    output_tokens: dict[str, int] = field(default_factory=dict)
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    draft_tokens: int = 0  # drafts scheduled (padding drafts excluded)
    async_loads: int = 0  # the fake connector's async loads reported finished
    accepted_drafts: int = 0
    schedule_s: float = 0.0
    update_s: float = 0.0
    # The first step after which vLLM's prefix index held two blocks of one content (a run on
    # vLLM's own manager only; None: never). pagedkv keeps one copy per content
    # (docs/conformance.md, Duplicate copies), so from there the two pools evict different
    # blocks and later hits may differ either way: a difference after it is explained.
    duplicates_since: int | None = None
    # The first step in which vLLM's manager served an admission's hit from a cached-evictable
    # copy of a content whose other copy a running request holds (vLLM's manager only; None:
    # never). That admission costs vLLM free blocks pagedkv's (one shared copy) does not: the
    # usual first consequence of duplicate copies.
    revived_copy_since: int | None = None
    # Filled by run(..., shadow_copies=True) only: the first step whose look-up (vLLM's manager;
    # None: never) hits other than it would on pagedkv's one-copy index, followed from vLLM's
    # (benches/vllm_copy_watch.py): where vLLM's allocation evicted a content while its free
    # queue held a spare copy (a cached-evictable copy pagedkv holds on its free list and hands
    # out before evicting), pagedkv's pool kept it, and a look-up reaching it hits further there.
    # The other consequence of duplicate copies.
    spared_copy_since: int | None = None
    # Filled by run(..., shadow_copies=True) only, from the same shadow: the first step whose
    # admission (vLLM's manager) takes a hit block of which pagedkv's one-copy index holds
    # another copy, one of the two held by a running request and the other cached-evictable.
    # vLLM indexes every copy and takes the first it indexed; pagedkv's index kept one (the held
    # one's twin was computed while its indexed copy was held, then that copy was evicted and a
    # third computed). The two admissions then revive different numbers of blocks, so the two
    # pools' free blocks differ with the same hits: the third consequence of duplicate copies.
    other_copy_since: int | None = None
    # Filled by an instrumented run (run(..., count_calls=True)) only: the scheduler's calls
    # into its KV-cache manager (outermost ones; a method calling another counts once) and the
    # time spent inside them.
    manager_calls: int = 0
    manager_s: float = 0.0
    # The class of the KV-cache manager the scheduler ran on (None: not run).
    manager_type: type | None = None
    # Filled by run(..., probe_hits=True) only: after every ``allocate_slots`` and
    # ``cache_blocks`` call, (the call, its request, the prefix-cache hit of a probe of the
    # request's tokens so far): what its blocks put in the index by then (decoded blocks
    # included, which no later request of the workload shares).
    probe_hits: list[tuple[str, str, int]] = field(default_factory=list)
    # Per ``probe_hits`` entry (vLLM's manager only; all False elsewhere): whether its request
    # held, then or at an earlier call, a block of which vLLM's prefix index held two copies.
    # pagedkv indexes one of them (docs/conformance.md, Duplicate copies): once that one is
    # evicted, a probe of the other copy's request stops there in pagedkv only.
    probe_copies: list[bool] = field(default_factory=list)
    # Filled by run(..., trace_zeroing=True) only: per step, the blocks the scheduler hands the
    # workers to zero (``SchedulerOutput.new_block_ids_to_zero``, a Mamba group's or mixed
    # precisions' KV-cache zeroing) as sorted (request, group, table position); the block ids
    # themselves differ between the managers.
    zeroing: list[tuple[tuple[str, int, int], ...]] = field(default_factory=list)


def first_difference(a: Trace, b: Trace, skip_copies: bool = False) -> str | None:
    """Where two traces first differ, in words; None when they are identical. `skip_copies`:
    the probe hits of requests that held a block of which vLLM (`a`) indexed two copies
    (``Trace.probe_copies``) are left out."""
    for i, (x, y) in enumerate(zip(a.steps, b.steps, strict=False)):
        if x != y:
            return f"step {i}: {x} != {y}"
    if len(a.steps) != len(b.steps):
        return f"{len(a.steps)} steps != {len(b.steps)} steps"
    for i, (x, y) in enumerate(zip(a.zeroing, b.zeroing, strict=False)):  # (where both traced)
        if x != y:
            return f"step {i}, blocks to zero (request, group, position): {x} != {y}"
    for i, (x, y) in enumerate(zip(a.probe_hits, b.probe_hits, strict=False)):
        if skip_copies and a.probe_copies[i]:
            continue
        if x != y:
            return f"probe {i} (call, request, hit): {x} != {y}"
    for what in ("output_tokens", "prefix_queries", "prefix_hits", "preemptions"):
        if getattr(a, what) != getattr(b, what):
            return f"{what}: {getattr(a, what)} != {getattr(b, what)}"
    return None


def first_different_step(a: Trace, b: Trace) -> int | None:
    """The first step whose decisions differ (the shorter length when one trace is a prefix of
    the other); None when the steps are identical."""
    for i, (x, y) in enumerate(zip(a.steps, b.steps, strict=False)):
        if x != y:
            return i
    return None if len(a.steps) == len(b.steps) else min(len(a.steps), len(b.steps))


def explained_divergence(reference: Trace, candidate: Trace) -> str | None:
    """When the traces first differ after `reference` (vLLM's manager) indexed two copies of
    one content, that in words (the explained divergence of docs/conformance.md, Duplicate
    copies); None when they are identical or differ before (a real difference)."""
    since = reference.duplicates_since
    if since is None:
        return None
    first = next(
        (i for i, (x, y) in enumerate(zip(reference.steps, candidate.steps, strict=False)) if x != y),
        min(len(reference.steps), len(candidate.steps)),
    )
    if first <= since or first_difference(reference, candidate) is None:
        return None
    return f"from step {first}, after vLLM indexed two copies of one content (step {since})"
