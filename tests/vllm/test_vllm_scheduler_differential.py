"""vLLM's real scheduler on pagedkv's drop-in manager schedules exactly as on vLLM's own.

``benches/vllm_scheduler.py`` runs vLLM 0.33's ``Scheduler`` / ``AsyncScheduler`` on the same
requests twice, with ``vllm.v1.core.kv_cache_manager.KVCacheManager`` and with
``pagedkv.integrations.vllm.KVCacheManager``: the tokens scheduled per request per step, the
preemptions, the finished sets, the prefix-cache queries and hits and the output lengths must be
identical (the harness itself is checked in test_vllm_scheduler_harness.py). Each configuration
is small and tight enough to preempt, so refusals are compared as well as hits.

Two configurations reach the explained divergence instead (docs/conformance.md, Duplicate
copies; docs/integrations/vllm.md): vLLM's index holds two copies of one content, its admission
takes the cached-evictable copy (a free block less) where pagedkv shares the one copy a running
request holds, so from there one side admits or preempts where the other does not. For those
the traces must be identical up to a step after vLLM indexed the second copy.

Runs in the vLLM stage of the test command (scripts/vllm/stage.sh); skipped elsewhere.
"""

from __future__ import annotations

from types import ModuleType

import pytest
from vllm_test_inputs import mamba_workload, window_config, window_mamba_workload

# name -> (Workload overrides, whether the traces must be identical to the end); every
# configuration preempts at least once (checked below).
CONFIGS: dict[str, tuple[dict[str, object], bool]] = {
    "full": (dict(requests=24, num_blocks=60, max_num_batched_tokens=128), True),
    "full-big-chunks": (dict(requests=24, num_blocks=90, max_num_batched_tokens=512), True),
    "full-no-prefix-caching": (
        dict(requests=24, num_blocks=40, max_num_batched_tokens=128, prefix_caching=False),
        True,
    ),
    "full+swa": (dict(requests=24, num_blocks=80, groups=("full", "swa"), window=48), True),
    "async": (dict(requests=30, num_blocks=60, async_scheduling=True), True),
    # 24 requests on 60 blocks: it differed when first tried; identical on the current manager
    # (which change fixed it was not bisected)
    "async-24-on-60": (
        dict(requests=24, num_blocks=60, async_scheduling=True, max_num_batched_tokens=128),
        True,
    ),
    "async-full+swa": (
        dict(requests=24, num_blocks=80, groups=("full", "swa"), async_scheduling=True),
        True,
    ),
    # a window of exactly one block (16 tokens)
    "full+swa-one-block": (
        dict(requests=24, num_blocks=80, groups=("full", "swa"), window=16),
        True,
    ),
    # n-gram speculative decoding: up to 3 drafts per step, random acceptance, rollback
    "spec": (dict(requests=24, num_blocks=40, max_num_batched_tokens=128, num_spec_tokens=3), True),
    # the explained divergence: at step 62 vLLM's admission of request 16 takes 3 cached-
    # evictable copies of blocks a running request holds (3 free blocks more than pagedkv's),
    # so vLLM refuses it and pagedkv admits it
    "full+swa-one-block-tight": (
        dict(requests=24, num_blocks=60, groups=("full", "swa"), window=16),
        False,
    ),
    # the same with drafts: an admission revives such copies at step 35; vLLM preempts a
    # request at step 38 that pagedkv keeps
    "spec-full+swa": (
        dict(requests=24, num_blocks=80, groups=("full", "swa"), window=48, num_spec_tokens=2),
        False,
    ),
    # Admission checks the scheduled chunk only (vLLM's scheduler_reserve_full_isl=False); each
    # schedules differently from the same workload with it (checked below).
    "chunk-admission": (
        dict(requests=24, num_blocks=50, max_num_batched_tokens=128, reserve_full_isl=False),
        True,
    ),
    "chunk-admission-no-prefix-caching": (
        dict(
            requests=24,
            num_blocks=40,
            max_num_batched_tokens=128,
            prefix_caching=False,
            reserve_full_isl=False,
        ),
        True,
    ),
    "chunk-admission-full+swa": (window_config(48, reserve_full_isl=False), True),
    "chunk-admission-async": (
        dict(
            requests=30,
            num_blocks=50,
            max_num_batched_tokens=128,
            async_scheduling=True,
            reserve_full_isl=False,
        ),
        True,
    ),
    # A fake KV connector (benches/vllm_fake_connector.py): external hits loaded in
    # the step ("sync"), and those, asynchronous loads and requests without external hits
    # ("mixed"; async loads exercise reserved_blocks, delayed caching, the resume).
    "connector-sync": (dict(requests=24, num_blocks=40, max_num_batched_tokens=128, connector="sync"), True),
    "connector-mixed": (
        dict(requests=24, num_blocks=40, max_num_batched_tokens=128, connector="mixed"),
        True,
    ),
    "connector-mixed-async": (
        dict(
            requests=30, num_blocks=40, max_num_batched_tokens=128, async_scheduling=True, connector="mixed"
        ),
        True,
    ),
    "connector-mixed-chunk-admission": (
        dict(
            requests=24, num_blocks=40, max_num_batched_tokens=128, reserve_full_isl=False, connector="mixed"
        ),
        True,
    ),
    # with drafts, async loads reserve the spec step's blocks (reserved_blocks)
    "connector-mixed-spec": (
        dict(requests=24, num_blocks=40, max_num_batched_tokens=128, num_spec_tokens=3, connector="mixed"),
        True,
    ),
    # The fake connector beside a sliding-window group (48 tokens, one block, 2 tokens): the
    # window skips a connector's out-of-window tokens at admission (null blocks, not counted),
    # as vLLM's does; sync loads, mixed (async loads resuming, reservations), async scheduling.
    "connector-sync-full+swa": (window_config(48, connector="sync"), True),
    "connector-sync-full+swa-one-block": (window_config(16, connector="sync"), True),
    "connector-sync-full+swa-two-tokens": (window_config(2, connector="sync"), True),
    "connector-sync-chunk-admission-full+swa-two-tokens": (
        window_config(2, connector="sync", reserve_full_isl=False),
        True,
    ),
    "connector-mixed-full+swa": (window_config(48, connector="mixed"), True),
    "connector-mixed-full+swa-one-block": (window_config(16, connector="mixed"), True),
    "connector-mixed-async-full+swa": (window_config(48, async_scheduling=True, connector="mixed"), True),
    # the explained divergence with chunk-only admission: at step 10 vLLM's admission of
    # request 3 revives cached-evictable copies (vLLM indexed two copies from step 3, an async
    # load's and a running request's) where pagedkv shares the held one, and refuses it
    "connector-mixed-chunk-admission-full+swa": (
        window_config(48, connector="mixed", reserve_full_isl=False),
        False,
    ),
    # Two more beside a window group part at the other consequence of duplicate copies
    # (TRACED_AT: spared_copy_since): vLLM's allocations evicted a content while its free queue held a
    # spare copy (cached-evictable; pagedkv holds it on its free list and hands it out first),
    # so pagedkv's pool kept that content. Sync loads with chunk-only admission: at step 118
    # request 22's hit is 48 tokens on vLLM's manager and 64 on pagedkv's (the window block
    # of its 4th block is kept); vLLM's refuses its admission, pagedkv's admits it. Mixed loads
    # with a 2-token window: request 1, preempted at step 14, hits 160 tokens at step 15 on
    # pagedkv's manager (its last 3 blocks and the window block of the 10th kept) and none on
    # vLLM's (which would load them asynchronously again); both refuse it there, and at step
    # 16 pagedkv's admits it.
    "connector-sync-chunk-admission-full+swa": (
        window_config(48, connector="sync", reserve_full_isl=False),
        False,
    ),
    "connector-mixed-full+swa-two-tokens": (window_config(2, connector="mixed"), False),
    # Drafters with a KV cache (benches/vllm_scheduler.py, DRAFTERS; docs/integrations/vllm.md,
    # Draft models): EAGLE with lookahead hashes (one token), 3-module MTP (hashes and
    # re-prefills 3 tokens), DFlash (a block of draft slots per request)
    "eagle": (
        dict(requests=24, num_blocks=40, max_num_batched_tokens=128, num_spec_tokens=2, drafter="eagle"),
        True,
    ),
    "mtp3": (
        dict(requests=24, num_blocks=40, max_num_batched_tokens=128, num_spec_tokens=3, drafter="mtp3"),
        True,
    ),
    "dflash": (
        dict(requests=24, num_blocks=40, max_num_batched_tokens=128, num_spec_tokens=3, drafter="dflash"),
        True,
    ),
    # EAGLE's dropped hit block: the dropped block is recomputed, a second copy in vLLM's index
    # from step 1 (pagedkv keeps one); traced: vLLM's admissions revive cached-evictable copies
    # from step 6 (7 with MTP), and at step 27 (28) request 6's hit differs (the pools evicted
    # different blocks), the explained divergence checked below
    "eagle-drop": (
        dict(requests=24, num_blocks=40, max_num_batched_tokens=128, num_spec_tokens=2, drafter="eagle-drop"),
        False,
    ),
    "mtp3-drop": (
        dict(requests=24, num_blocks=40, max_num_batched_tokens=128, num_spec_tokens=3, drafter="mtp3-drop"),
        False,
    ),
    # The same drafters on full attention beside a window group (vLLM's hybrid coordinator:
    # EAGLE's drop looks one block past the hit in each group; without the drop the
    # re-prefilled tokens are cached). With the drop they part: requests 1 and 3 compute the
    # same system prompt in step 0 (two copies in vLLM's index, one in pagedkv's); in step 1
    # vLLM evicts the first copy's window block and keeps the second's, pagedkv first spends
    # its free copy and then evicts its one indexed copy, so request 6's look-up hits a block
    # less on pagedkv (traced at step 1: the shadow's lost content; the schedules part at step
    # 9, where request 6 is admitted). MTP's on 70 blocks stays identical (2 preemptions).
    "eagle-full+swa": (
        dict(
            requests=24, num_blocks=80, groups=("full", "swa"), window=48, num_spec_tokens=2, drafter="eagle"
        ),
        True,
    ),
    "mtp3-full+swa": (
        dict(
            requests=24, num_blocks=80, groups=("full", "swa"), window=48, num_spec_tokens=3, drafter="mtp3"
        ),
        True,
    ),
    "eagle-drop-full+swa": (
        dict(
            requests=24,
            num_blocks=80,
            groups=("full", "swa"),
            window=48,
            num_spec_tokens=2,
            drafter="eagle-drop",
        ),
        False,
    ),
    "mtp3-drop-full+swa": (
        dict(
            requests=24,
            num_blocks=70,
            groups=("full", "swa"),
            window=48,
            num_spec_tokens=3,
            drafter="mtp3-drop",
        ),
        True,
    ),
    # A KV connector with EAGLE's drop (vLLM turns lookahead hashing off with a connector) or
    # MTP's drop: the local hit drops a block under the connector's tokens. Parted after
    # vLLM's revived copies (steps 8 and 6; the schedules part at 24 and 34; beside a window,
    # on 72 blocks, 66 and 68). EAGLE's drop with mixed
    # loads on full attention alone stops vLLM's own scheduler (its assertion in
    # _update_from_kv_xfer_finished), so it is not compared.
    "connector-sync-eagle-drop": (
        dict(
            requests=24,
            num_blocks=40,
            max_num_batched_tokens=128,
            num_spec_tokens=2,
            drafter="eagle-drop",
            connector="sync",
        ),
        False,
    ),
    "connector-mixed-mtp3-drop": (
        dict(
            requests=24,
            num_blocks=40,
            max_num_batched_tokens=128,
            num_spec_tokens=3,
            drafter="mtp3-drop",
            connector="mixed",
        ),
        False,
    ),
    "connector-mixed-eagle-drop-full+swa": (
        dict(
            requests=24,
            num_blocks=72,
            groups=("full", "swa"),
            window=48,
            num_spec_tokens=2,
            drafter="eagle-drop",
            connector="mixed",
        ),
        False,
    ),
    # Mamba prefill check-points (vLLM's Mamba2 layers: num_prefill_checkpoint_blocks=1,
    # alignment 1): the scheduler stops ending chunks at block boundaries where the check-point
    # serves, and each chunk spanning a block boundary past its first also reserves the state
    # block of its last boundary. Identical to the end (1 and 2 preemptions); async scheduling
    # parts at step 38 after a spared copy (37). Full + window + Mamba on 150 to 160 blocks
    # parts after vLLM's duplicate copies of step 2 at an eviction none of the traced
    # mechanisms names (an eviction-order difference, as EAGLE's drop shows on tight pools).
    "full+mamba-checkpoints": (mamba_workload(140, mamba_checkpoint_alignment=1), True),
    "full+swa+mamba-checkpoints": (window_mamba_workload(164, mamba_checkpoint_alignment=1), True),
    "async-full+mamba-checkpoints": (
        dict(
            requests=30,
            num_blocks=140,
            groups=("full", "mamba"),
            mamba_checkpoint_alignment=1,
            async_scheduling=True,
        ),
        False,
    ),
    # Full attention beside an align-mode Mamba group (MambaSpec; the scheduler ends prefill
    # chunks at block boundaries and at the shared-prefix boundary get_computed_blocks reports):
    # whole-prompt and chunk-only admission, async scheduling. Each preempts and hits.
    "full+mamba": (
        mamba_workload(),
        True,
    ),
    "full+mamba-chunk-admission": (
        mamba_workload(reserve_full_isl=False),
        True,
    ),
    "async-full+mamba": (
        mamba_workload(async_scheduling=True),
        True,
    ),
    # The fake connector's synchronous loads on a Mamba config: 23 admissions with external
    # tokens, identical. With chunk-only admission the schedules part at step 11, where a
    # look-up reports another shared-prefix boundary on pagedkv's one-copy index (vLLM indexed
    # two copies of one content at step 1) and vLLM's scheduler ends request 15's chunk there
    # (48 tokens against 12).
    "connector-sync-full+mamba": (
        mamba_workload(connector="sync"),
        True,
    ),
    "connector-sync-chunk-admission-full+mamba": (
        mamba_workload(connector="sync", reserve_full_isl=False),
        False,
    ),
    # Its async loads (one admission in three): 8 loads, identical schedules, and the blocks
    # each step zeroes equal (the loads' blocks left out of the list, as vLLM leaves them), with
    # plain and async scheduling. On 140 blocks they part at step 15, where a look-up hits
    # further on pagedkv's one-copy index (vLLM indexed two copies of one content at step 2).
    # (On 160 blocks vLLM's own manager fails: its block pool cannot give a block its
    # reservation counted, so no configuration there.)
    # Every third request skips reading the prefix cache (prompt logprobs): it hits nothing and
    # its blocks are cached for later requests, as vLLM caches them; with async scheduling the
    # schedules part at step 43, after vLLM's admission revived a cached-evictable copy of a
    # held content (step 42).
    "full-skip-reading": (
        dict(requests=24, num_blocks=60, max_num_batched_tokens=128, skip_reading_every=3),
        True,
    ),
    "full+swa-skip-reading": (
        dict(requests=24, num_blocks=80, groups=("full", "swa"), window=48, skip_reading_every=3),
        True,
    ),
    "full+mamba-skip-reading": (mamba_workload(skip_reading_every=3), True),
    "async-skip-reading": (
        dict(requests=30, num_blocks=60, async_scheduling=True, skip_reading_every=3),
        False,
    ),
    "connector-mixed-full+mamba": (
        mamba_workload(155, connector="mixed"),
        True,
    ),
    "connector-mixed-async-full+mamba": (
        mamba_workload(155, connector="mixed", async_scheduling=True),
        True,
    ),
    "connector-mixed-full+mamba-tight": (
        mamba_workload(140, connector="mixed"),
        False,
    ),
    # On tighter pools the duplicate copies part them. 80 blocks: vLLM's allocation at step 22
    # evicts one copy of the shared prefix's 3rd and 4th blocks and keeps another that a running
    # request holds; pagedkv's one copy is evicted, so at step 24 request 12's look-up reports a
    # shared-prefix boundary of 64 on vLLM's manager and 0 on pagedkv's (both hits 0: its Mamba
    # state is not cached), and at step 33 vLLM's scheduler ends its chunk there (64 tokens
    # against 112). 100 blocks: request 12, preempted and readmitted with a 176-token hit at
    # step 19, takes on vLLM's manager the first-indexed copy of its first 4 blocks, which
    # request 3 holds; pagedkv's index kept a later copy (request 12's own, cached-evictable),
    # which it revives, so it has 4 free blocks fewer and preempts request 12 at step 20.
    "full+mamba-tight": (
        mamba_workload(80),
        False,
    ),
    "full+mamba-other-copy": (
        mamba_workload(100),
        False,
    ),
    # Mamba beside a sliding-window group (48 tokens): identical with chunk-only admission and
    # with a connector's mixed loads under async scheduling (7 async loads); on 140 blocks vLLM's
    # duplicate copies part them at step 37 (an admission of vLLM's revives a cached-evictable
    # copy of a content a running request holds at step 3), with the connector's sync loads at
    # step 36, without a full-attention group at step 32, and with two full-attention groups
    # (260 blocks) at step 20 (look-ups that hit further on pagedkv's one-copy index from
    # steps 31, 31 and 18).
    "full+swa+mamba-chunk-admission": (
        window_mamba_workload(200, reserve_full_isl=False),
        True,
    ),
    "connector-mixed-async-full+swa+mamba": (
        window_mamba_workload(200, connector="mixed", async_scheduling=True),
        True,
    ),
    "full+swa+mamba-tight": (
        window_mamba_workload(140),
        False,
    ),
    "connector-sync-full+swa+mamba-tight": (
        window_mamba_workload(140, connector="sync"),
        False,
    ),
    "swa+mamba-tight": (
        window_mamba_workload(60, groups=("swa", "mamba")),
        False,
    ),
    "2full+swa+mamba-tight": (
        window_mamba_workload(260, groups=("full", "full", "swa", "mamba")),
        False,
    ),
}


# The mechanism each configuration that parts is traced to (benches/vllm_scheduler_trace.py):
# a look-up that hits further (or, with a Mamba group, reports another shared-prefix boundary)
# on pagedkv's one-copy index (``spared_copy_since``, benches/vllm_copy_watch.py); an admission
# whose hit block pagedkv indexes in another copy, one held and one cached-evictable
# (``other_copy_since``); the others, an admission of vLLM's that revives a cached-evictable
# copy of a held content (``revived_copy_since``).
TRACED_AT = {
    "connector-sync-chunk-admission-full+swa": "spared_copy_since",
    "connector-mixed-full+swa-two-tokens": "spared_copy_since",
    "connector-sync-chunk-admission-full+mamba": "spared_copy_since",
    "connector-mixed-full+mamba-tight": "spared_copy_since",
    "full+mamba-tight": "spared_copy_since",
    "full+mamba-other-copy": "other_copy_since",
    "connector-sync-full+swa+mamba-tight": "spared_copy_since",
    "swa+mamba-tight": "spared_copy_since",
    "2full+swa+mamba-tight": "spared_copy_since",
    "async-full+mamba-checkpoints": "spared_copy_since",
    "eagle-drop-full+swa": "spared_copy_since",
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_schedule_as_vllms_manager(vllm_scheduler: ModuleType, name: str) -> None:
    module = vllm_scheduler
    overrides, identical = CONFIGS[name]
    w = module.Workload(**overrides)
    # pagedkv's invariants after every step (the core's, and the manager's record of each
    # request's core state, deferred watermark advances included), and, full attention only,
    # after every allocate_slots / cache_blocks call, what the request's blocks put in the
    # prefix index by then (a probe of its tokens; decoded blocks no later request shares
    # included). With a window group the probes can differ where the traces do not (the hit
    # over positions a running request's window released), and a Mamba group's hit needs a
    # cached state, not a probe's tokens: probes on full attention alone.
    # Requests that skip reading the cache recompute cached contents by design: both pools then
    # hold two copies of a content, which the two indexes keep and evict differently, and a
    # probe can hit further on either side (the schedules, hits and outputs stay compared).
    probe = identical and w.groups == ("full",) and not w.skip_reading_every
    # A Mamba group's configs zero new blocks (vLLM's needs_kv_cache_zeroing): the blocks each
    # step hands the workers to zero are compared by (request, group, position), step by step.
    zeroing = "mamba" in w.groups
    reference = module.run(
        w, module.manager_class("vllm"), probe_hits=probe, shadow_copies=True, trace_zeroing=zeroing
    )
    ours = module.run(
        w, module.manager_class("pagedkv"), check_invariants=True, probe_hits=probe, trace_zeroing=zeroing
    )
    if zeroing:
        assert sum(map(len, reference.zeroing)) > 100
        parted = module.first_different_step(reference, ours)
        assert reference.zeroing[:parted] == ours.zeroing[:parted]
    if probe and w.prefix_caching:
        # the probes see decoded blocks: many hits pass their request's prompt
        prompts = {r.request_id: r.num_prompt_tokens for r in module.make_requests(w)}
        decoded = [hit for _, rid, hit in ours.probe_hits if hit > prompts[rid]]
        assert len(decoded) > 100
    # With a connector's async loads, a load that finishes indexes blocks whose content a
    # running request computed meanwhile: vLLM indexes both copies, pagedkv keeps the running
    # request's (docs/conformance.md, Duplicate copies); once that copy is freed and evicted, a
    # probe of the loaded request's tokens stops there in pagedkv only, the schedules staying
    # identical (docs/integrations/vllm.md, KV connectors). Those requests' probes are compared
    # as at most vLLM's; every other probe exactly.
    skip_copies = probe and w.connector == "mixed"
    if skip_copies:
        pairs = zip(reference.probe_hits, ours.probe_hits, reference.probe_copies, strict=True)
        held = [(x, y) for x, y, copies in pairs if copies]
        assert held and all(y[:2] == x[:2] and y[2] <= x[2] for x, y in held)
        assert len(held) < len(reference.probe_hits) // 2
    difference = module.first_difference(reference, ours, skip_copies)
    if identical:
        assert difference is None
        # the shadow of pagedkv's index gives every look-up vLLM's hit where the traces agree
        assert reference.spared_copy_since is None, reference.spared_copy_since
    else:
        # A difference only after vLLM indexed two copies of one content (never before), and
        # not before the step of the mechanism traced for the configuration: vLLM's first
        # admission that revived a cached-evictable copy of content a running request holds,
        # or its first look-up whose hit pagedkv's index (kept contents) makes longer.
        assert difference is None or module.explained_divergence(reference, ours) is not None, difference
        step = module.first_different_step(reference, ours)
        if step is not None:
            traced = TRACED_AT.get(name, "revived_copy_since")
            since = getattr(reference, traced)
            assert since is not None and step >= since, (traced, step, since)
    assert reference.preemptions > 0
    if w.prefix_caching:
        assert reference.prefix_hits > 0
    if w.num_spec_tokens:
        assert 0 < reference.accepted_drafts < reference.draft_tokens
    if w.connector == "mixed":
        assert reference.async_loads > 0
    if w.mamba_checkpoint_alignment:
        # The check-points change vLLM's own schedule (its chunks and its free blocks).
        plain = module.Workload(**{**overrides, "mamba_checkpoint_alignment": 0})
        assert module.run(plain, module.manager_class("vllm")).steps != reference.steps
    if not w.reserve_full_isl:
        # The configuration exercises the chunk-only admission: vLLM's own schedule changes.
        whole = module.Workload(**{**overrides, "reserve_full_isl": True})
        assert module.run(whole, module.manager_class("vllm")).steps != reference.steps


def test_the_scheduler_class_on_mamba_beside_a_window(vllm_scheduler: ModuleType) -> None:
    """``PagedkvScheduler`` (the one-line switch) on full attention + a window + Mamba, chunk-only
    admission: the trace and the zeroing lists of vLLM's scheduler on its own manager."""
    from pagedkv.integrations.vllm import KVCacheManager, PagedkvScheduler

    module = vllm_scheduler
    w = module.Workload(**window_mamba_workload(200, reserve_full_isl=False))
    ours = module.run(
        w, None, check_invariants=True, watch_copies=False, trace_zeroing=True, scheduler_cls=PagedkvScheduler
    )
    assert ours.manager_type is not None and issubclass(ours.manager_type, KVCacheManager)
    reference = module.run(w, module.manager_class("vllm"), trace_zeroing=True)
    assert module.first_difference(reference, ours) is None
    assert reference.zeroing == ours.zeroing and sum(map(len, reference.zeroing)) > 100
    assert reference.preemptions > 0 and reference.prefix_hits > 0
