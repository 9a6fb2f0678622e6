"""One randomized schedule of the vLLM differential, driven through both managers and compared
after every step (``benches/vllm_chunked_prefix.py`` documents what is compared)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from vllm_diff_config import Config, Outcome
from vllm_diff_pagedkv_side import PagedkvSide
from vllm_diff_vllm_side import VllmSide


@dataclass
class _Running:
    tokens: list[int]  # the ids known so far
    scheduled: int  # tokens scheduled so far (the computed watermark after the pass)
    pending: list[int] = field(default_factory=list)  # async: ids sampled, not given yet


def _hit_sharing(
    side: Any, rid: int, num_hit_blocks: int, running: dict[int, _Running]
) -> list[list[list[int] | None]]:
    """Per group, for each hit block of ``rid``, the other running requests holding that
    physical block in that group (empty: the block was cached-evictable; ``None``: the
    position is out of the window, no block). Independent of block ids, so comparable across
    managers."""
    out: list[list[list[int] | None]] = []
    others = {o: side.tables(o) for o in running if o != rid}
    for g, table in enumerate(side.tables(rid)):
        held = {o: set(t[g]) for o, t in others.items()}
        out.append(
            [
                None if b is None else sorted(o for o, t in held.items() if b in t)
                for b in table[:num_hit_blocks]
            ]
        )
    return out


def _revived(side: Any, rid: int, num_hit_blocks: int, running: dict[int, _Running]) -> int:
    """Hit blocks of ``rid`` no other running request holds: they were cached-evictable."""
    return sum(others == [] for group in _hit_sharing(side, rid, num_hit_blocks, running) for others in group)


def _group_state(side: Any, running: dict[int, _Running]) -> tuple[list[int], dict[int, list[list[bool]]]]:
    """Per group the distinct blocks the running requests hold, and per request and group
    which table positions are released (out of the window)."""
    tables = {rid: side.tables(rid) for rid in running}
    in_use = [
        len({b for t in tables.values() for b in t[g] if b is not None}) for g in range(side.num_groups)
    ]
    released = {rid: [[b is None for b in t] for t in ts] for rid, ts in tables.items()}
    return in_use, released


def run_schedule(seed: int, cfg: Config, vllm_side: Any = None, log: list[str] | None = None) -> Outcome:
    """Drives one randomized schedule through pagedkv and ``vllm_side`` (a ``VllmSide``; built
    here when ``None``). Returns the counts and every mismatch, described. Stops at the first
    divergence that makes the two states incomparable (one side out of blocks, the other not)."""
    rng = random.Random(seed)
    ours = PagedkvSide(cfg.num_blocks, cfg.block_size, cfg.windows, cfg.watermark_blocks)
    theirs = vllm_side or VllmSide(cfg.num_blocks, cfg.block_size, cfg.windows, cfg.watermark_blocks)
    bs = cfg.block_size
    prefixes = [[rng.randrange(cfg.vocab) for _ in range(cfg.prefix_tokens)] for _ in range(cfg.num_prefixes)]
    computed: set[tuple[int, ...]] = set()  # every block-aligned prefix some pass computed
    running: dict[int, _Running] = {}
    past_prompts: list[list[int]] = []
    out = Outcome()
    next_rid = 0

    def note_computed(tokens: list[int], upto: int) -> None:
        upto = min(upto, len(tokens))  # async: a computed token whose id is unknown yet
        for end in range(bs, upto - upto % bs + 1, bs):
            computed.add(tuple(tokens[:end]))

    def preempt(step: int, rid: int, what: str) -> None:
        """A refused ``allocate_slots``: vLLM's scheduler preempts (frees) the request. Both
        managers release the out-of-window blocks due at the watermark before they size the
        allocation, and keep them released when it fails: compared before the free."""
        out.preemptions += 1
        masks = [[[b is None for b in t] for t in side.tables(rid)] for side in (ours, theirs)]
        if masks[0] != masks[1]:
            fail(step, f"{what} of {rid} refused: released positions pagedkv {masks[0]}, vLLM {masks[1]}")
        ours.free(rid)
        theirs.free(rid)
        del running[rid]

    # The step from which vLLM's index holds two blocks of one content. pagedkv's index keeps
    # one, with any number of KV groups (docs/conformance.md, Duplicate copies): it hands the
    # private copy back to the pool when the indexed one is freed, where vLLM keeps both cached,
    # so from there the two pools evict different blocks and later hits may differ either way. A
    # difference after that step stops the schedule as an explained divergence; any difference
    # before it fails.
    duplicates_since: int | None = None

    def fail(step: int, what: str) -> None:
        if duplicates_since is not None:
            if not out.diverged:
                out.diverged = (
                    f"seed {seed} step {step}: {what}, after vLLM indexed two copies of one "
                    f"content (step {duplicates_since})"
                )
            return
        out.mismatches.append(f"seed {seed} step {step}: {what}")

    for step in range(cfg.steps):
        out.steps = step + 1
        detail = ""
        prefilling = [rid for rid, r in running.items() if r.scheduled < len(r.tokens)]
        decoding = [rid for rid, r in running.items() if r.scheduled >= len(r.tokens)]
        action = rng.choices(
            ["admit", "chunk", "decode", "free"],
            weights=[4, 4 if prefilling else 0, 3 if decoding else 0, 2 if running else 0],
        )[0]
        if action == "admit":
            if past_prompts and rng.random() < 0.15:
                prompt = list(rng.choice(past_prompts))  # exact repeat: the num_tokens-1 cap
            else:
                head = rng.choice(prefixes)[: rng.randrange(cfg.prefix_tokens + 1)]
                suffix_len = rng.randrange(cfg.max_suffix + 1)
                if rng.random() < 0.3:  # block-aligned prompt
                    suffix_len += (-(len(head) + suffix_len)) % bs
                prompt = head + [rng.randrange(cfg.vocab) for _ in range(suffix_len)]
            if not prompt:
                prompt = [rng.randrange(cfg.vocab)]
            num_scheduled = rng.randint(1, len(prompt))
            in_use_before = ours.in_use(), theirs.in_use()
            predicted = ours.match(prompt)
            vllm_hit = theirs.match(prompt)
            got = ours.admit(next_rid, prompt, num_scheduled)
            got_vllm = theirs.admit(next_rid, prompt, num_scheduled)
            if (got is None) != (got_vllm is None) and predicted == vllm_hit:
                # Same hit length, same free blocks, yet one side fits: the hit takes a
                # different number of cached-evictable blocks back, i.e. the two managers
                # picked different copies of the same content (see below).
                revived = ""
                if got is not None:
                    revived = f"pagedkv revives {_revived(ours, next_rid, got // bs, running)}, "
                out.diverged = (
                    f"seed {seed} step {step}: admission of {len(prompt)} tokens, hit {got} "
                    f"on both, fits pagedkv={got is not None} vLLM={got_vllm is not None}: "
                    f"{revived}vLLM revives {theirs.revived} cached-evictable hit blocks, "
                    f"blocks in use before {in_use_before[0]} / {in_use_before[1]}"
                )
                return out
            if (got is None) != (got_vllm is None):
                fail(
                    step,
                    f"admission of {len(prompt)} tokens fits pagedkv={got is not None}"
                    f" vLLM={got_vllm is not None} (hits {predicted} / {vllm_hit}, "
                    f"{num_scheduled} scheduled, blocks in use {in_use_before[0]} / "
                    f"{in_use_before[1]} before)",
                )
                return out
            if got is None:
                out.ooms += 1
                if predicted != vllm_hit:
                    fail(step, f"match_prefix {predicted} != vLLM hit {vllm_hit} (refused)")
            else:
                out.admissions += 1
                assert got_vllm is not None
                if not predicted == got == got_vllm == vllm_hit:
                    fail(
                        step,
                        f"hit of {len(prompt)} tokens: match_prefix {predicted}, "
                        f"add_sequence {got}, vLLM {got_vllm}",
                    )
                    return out  # the pools differ from here
                ours_sharing = _hit_sharing(ours, next_rid, got // bs, running)
                theirs_sharing = _hit_sharing(theirs, next_rid, got // bs, running)
                # (With KV groups too: one manager, one index, the newest copy; docs/design.md.)
                if got == got_vllm and ours_sharing == theirs_sharing and theirs.evictable_copies:
                    # The same, one level down: two cached-evictable copies of a hit block;
                    # each manager revives a different one, and the copy left behind holds a
                    # different place in the eviction order on the two sides, so later
                    # evictions (and the hits they allow) may differ. Stop here too.
                    out.diverged = (
                        f"seed {seed} step {step}: hit {got} of {len(prompt)} tokens; "
                        f"{theirs.evictable_copies} hit blocks have two cached-evictable "
                        "copies (which one is revived is each manager's choice)"
                    )
                if got == got_vllm and ours_sharing != theirs_sharing:
                    # Same hit, different physical copies: the same content sits on two
                    # blocks (two requests computed it independently, or a prompt's last
                    # full block was recomputed). vLLM's BlockHashToBlockMap hands out the
                    # oldest copy, pagedkv's index the newest, so the new request shares its
                    # hit blocks with different requests on the two sides (or takes a
                    # cached-evictable copy on one side and a held one on the other). From
                    # here the pools differ block for block; the schedule stops there.
                    out.diverged = (
                        f"seed {seed} step {step}: hit {got} of {len(prompt)} tokens on "
                        f"different copies (hit block -> requests sharing it: pagedkv "
                        f"{ours_sharing}, vLLM {theirs_sharing})"
                    )
                if got and tuple(prompt[:got]) not in computed:
                    fail(step, f"pagedkv hit {got} tokens covering uncomputed blocks")
                if got_vllm and tuple(prompt[:got_vllm]) not in computed:
                    fail(step, f"vLLM hit {got_vllm} tokens covering uncomputed blocks")
                out.hits += got > 0
                out.hit_tokens += got
                upto = got + min(num_scheduled, len(prompt) - got)
                running[next_rid] = _Running(prompt, upto)
                detail = f"{next_rid} len {len(prompt)} hit {got} sched {upto}"
                past_prompts.append(prompt)
                note_computed(prompt, upto)
            next_rid += 1
        elif action == "chunk":
            rid = rng.choice(prefilling)
            r = running[rid]
            n = rng.randint(1, len(r.tokens) - r.scheduled)
            ok, ok_vllm = ours.allocate(rid, n), theirs.allocate(rid, n)
            detail = f"{rid} +{n}"
            if ok != ok_vllm:
                fail(step, f"a chunk of {n} for {rid} fits pagedkv={ok} vLLM={ok_vllm}")
                return out
            if not ok:
                preempt(step, rid, f"a chunk of {n}")
            else:
                r.scheduled += n
                note_computed(r.tokens, r.scheduled)
        elif action == "decode":
            for rid in rng.sample(decoding, rng.randint(1, len(decoding))):
                r = running[rid]
                token = rng.randrange(cfg.vocab)  # the id this step samples
                drafts = [rng.randrange(cfg.vocab) for _ in range(rng.randint(0, cfg.max_drafts))]
                n = 1 + len(drafts)
                in_flight = len(r.pending)  # async: the previous step's token, not yet returned
                if not cfg.async_ids:
                    theirs.append_known(rid, token)  # vLLM's request holds it before scheduling
                ok = ours.allocate(rid, n, cfg.lookahead, in_flight)
                ok_vllm = theirs.allocate(rid, n, cfg.lookahead, in_flight)
                if ok != ok_vllm:
                    fail(step, f"decode of {rid} ({n} tokens) fits pagedkv={ok} vLLM={ok_vllm}")
                    return out
                if not ok:
                    preempt(step, rid, "decode")
                    continue
                r.scheduled += n
                out.drafts += len(drafts)
                if cfg.async_ids:
                    # The previous step's id arrives after this step's allocation: vLLM's
                    # update_from_output appends it and caches what is processed
                    # (computed - in flight); pagedkv gets the ids.
                    if r.pending:
                        ours.provide(rid, r.pending)
                        theirs.provide(rid, r.pending, in_flight=n)
                        r.tokens = r.tokens + r.pending
                        out.async_ids += len(r.pending)
                    r.pending = [token]
                    continue
                ours.provide(rid, [token])
                r.tokens = r.tokens + [token]
                if drafts:
                    # Drafts are accepted left to right with probability 1/2 each; the
                    # rejected ones are rolled back by the watermark alone (vLLM lowers
                    # num_computed_tokens; its manager is not called until the output's
                    # cache_blocks), their slots stay allocated.
                    accepted = 0
                    while accepted < len(drafts) and rng.random() < 0.5:
                        accepted += 1
                    rejected = len(drafts) - accepted
                    out.rejected += rejected
                    r.scheduled -= rejected
                    ours.provide(rid, drafts[:accepted], r.scheduled)
                    theirs.provide(rid, drafts[:accepted], r.scheduled)
                    r.tokens = r.tokens + drafts[:accepted]
                note_computed(r.tokens, r.scheduled)
        else:
            rid = rng.choice(sorted(running))
            detail = f"{rid}"
            ours.free(rid)
            theirs.free(rid)
            del running[rid]
        ours.check()
        if out.diverged:
            return out
        if log is not None:
            log.append(
                f"{step} {action} {detail} in use {ours.in_use()}/{theirs.in_use()} "
                + " ".join(f"{k}:{len(r.tokens)}@{r.scheduled}" for k, r in running.items())
            )
        ours_in_use, theirs_in_use = ours.in_use(), theirs.in_use()
        if ours_in_use != theirs_in_use:
            fail(step, f"after {action}: blocks in use pagedkv {ours_in_use}, vLLM {theirs_in_use}")
        diffs, released = _compare_groups(ours, theirs, running)
        out.released_positions += released
        for what in diffs:
            fail(step, f"after {action}: {what}")
        for rid, r in running.items():
            a, b = ours.num_computed(rid), theirs.num_computed(rid)
            if not a == b == r.scheduled:
                fail(step, f"num_computed_tokens of {rid}: pagedkv {a}, vLLM {b}, schedule {r.scheduled}")
        if out.diverged:
            return out
        if duplicates_since is None and theirs.has_duplicate_copies():
            duplicates_since = step
    return out


def _compare_groups(ours: Any, theirs: Any, running: dict[int, _Running]) -> tuple[list[str], int]:
    """Per group: distinct blocks in use, and for every running request its table length and
    which positions are released (pagedkv -1, vLLM's null block). Returns the differences,
    described, and the number of released positions (vLLM's side)."""
    diffs: list[str] = []
    ours_in_use, ours_released = _group_state(ours, running)
    theirs_in_use, theirs_released = _group_state(theirs, running)
    for g, (a, b) in enumerate(zip(ours_in_use, theirs_in_use, strict=True)):
        if a != b:
            diffs.append(f"group {g}: blocks in use pagedkv {a}, vLLM {b}")
    for rid in running:
        for g, (a_mask, b_mask) in enumerate(zip(ours_released[rid], theirs_released[rid], strict=True)):
            if a_mask != b_mask:
                diffs.append(
                    f"request {rid} group {g}: released positions pagedkv "
                    f"{[i for i, r in enumerate(a_mask) if r]}, vLLM {[i for i, r in enumerate(b_mask) if r]}"
                )
    released = sum(sum(mask) for masks in theirs_released.values() for mask in masks)
    return diffs, released
