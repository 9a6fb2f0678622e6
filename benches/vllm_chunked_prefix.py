"""Differential run of pagedkv's prefix cache against vLLM v1's real ``KVCacheManager`` under
chunked prefill: the same randomized schedules (prompts sharing prefixes admitted while others
are still prefilling in chunks of random size, decode steps, frees, preemptions on a small pool)
drive both managers, and every admission's hit and the blocks in use after every step are
compared.

    $VENV/bin/python benches/vllm_chunked_prefix.py [--schedules 200] [--steps 300] [--seed 0]

``$VENV`` is the peer venv (vLLM 0.33's block manager on a CPU torch; see benches/README.md and
the peer harness's setup script), with pagedkv importable (``PYTHONPATH=python`` and the built
extension in ``python/pagedkv``). This module imports without vLLM: only ``VllmSide`` needs it,
so ``tests/vllm/test_vllm_differential.py`` can import it anywhere (it runs in the test
command's vLLM stage).

The machinery here also drives hybrid managers (``Config.windows``: a full-attention group and
sliding-window groups on one pool); ``benches/vllm_hybrid_differential.py`` runs those
configurations and documents what is compared there.

Both managers allocate per scheduled chunk, as vLLM's scheduler drives its own (pagedkv's
contract: docs/embedding.md, Per-chunk allocation):
- admission: pagedkv ``add_sequence(rid, prompt, num_scheduled=k, reserve_prompt=False)``,
  vLLM ``get_computed_blocks`` + ``allocate_slots(req, k, hit, blocks,
  full_sequence_must_fit=True)`` (the whole-prompt admission check, with ``watermark_blocks``);
- each later chunk or decode step: ``allocate_slots`` on both sides, drafts counted in the new
  tokens and ``Config.lookahead`` slots beyond them; a refusal (pagedkv ``False``, vLLM
  ``None``) is the preemption signal, and the request is freed on both sides (the released
  positions of the refused call are compared first: both release out-of-window blocks before
  sizing the allocation, and keep them released);
- ids: synchronous decode knows the sampled id when it schedules it (pagedkv gets it through
  ``provide_token_ids`` right after ``allocate_slots``); ``Config.async_ids`` gives each id a
  step late, after the next step's allocation (one token in flight: window releases run at
  ``computed - in_flight``; vLLM's ``cache_blocks`` on what is processed);
- speculative drafts (``Config.max_drafts``): accepted left to right with probability 1/2, the
  rejected ones rolled back by the watermark alone (vLLM lowers ``num_computed_tokens``;
  pagedkv ``provide_token_ids(..., num_computed_tokens=)`` with the accepted ids).

What is compared, per admission:
- pagedkv's ``match_prefix(prompt)`` (before admission), the hit ``add_sequence`` returns, and
  vLLM's ``get_computed_blocks`` hit on the same state: all three equal;
- an oracle independent of both managers: the hit covers only full blocks some request had
  scheduled (computed) by then, i.e. no admission hits a block whose K/V do not exist;
- whether the admission fits the pool (pagedkv ``OutOfBlocksError`` against vLLM's
  ``allocate_slots`` returning ``None``);
per chunk and decode step, whether it fits on both sides; and after every step: blocks in use
(in all and per group), every running request's table length, released (out-of-window)
positions and ``num_computed_tokens``.

The moment a chunk becomes hittable is the same on both sides: vLLM caches a chunk's full
blocks in ``allocate_slots`` (when the chunk is scheduled) as far as the ids are known, pagedkv
in ``add_sequence`` / ``allocate_slots`` / ``provide_token_ids`` under the same rule.

The explained divergence: vLLM's index keeps every copy of one content, pagedkv's one
(docs/conformance.md, Duplicate copies). From the step where vLLM indexes a second copy the
pools may differ block for block, so a difference from there stops the schedule and is reported
as explained; the copy-choice cases detected at an admission stop it too. Any difference before
is a mismatch.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pagedkv


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


Windows = tuple[int | None, ...]  # one entry per KV group: None full attention, else the window


class PagedkvSide:
    """pagedkv's manager behind the calls the schedule makes, with the per-chunk contract
    (docs/embedding.md, Per-chunk allocation): ``add_sequence(..., num_scheduled=k,
    reserve_prompt=False)`` at admission, ``allocate_slots`` per chunk or decode step,
    ``provide_token_ids`` when ids arrive (with the rolled-back watermark after drafts)."""

    def __init__(
        self, num_blocks: int, block_size: int, windows: Windows = (), watermark_blocks: int = 0
    ) -> None:
        kwargs: dict[str, Any] = {}
        if windows:
            kwargs["kv_groups"] = [
                pagedkv.FullAttention() if w is None else pagedkv.SlidingWindow(window=w) for w in windows
            ]
        self.num_groups = max(len(windows), 1)
        self.kv = pagedkv.KvCacheManager(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=True,
            watermark_blocks=watermark_blocks,
            **kwargs,
        )

    def match(self, tokens: list[int]) -> int:
        return int(self.kv.match_prefix(tokens))

    def admit(self, rid: int, tokens: list[int], num_scheduled: int) -> int | None:
        try:
            hit = int(self.kv.add_sequence(rid, tokens, num_scheduled=num_scheduled, reserve_prompt=False))
        except pagedkv.OutOfBlocksError:
            return None
        return hit

    def tables(self, rid: int) -> list[list[int | None]]:
        """Each group's block table; ``None`` where a window released the position (-1)."""
        if self.num_groups == 1:
            return [[int(b) for b in self.kv.block_table(rid)]]
        return [
            [None if b < 0 else int(b) for b in self.kv.block_table(rid, group=g).tolist()]
            for g in range(self.num_groups)
        ]

    def allocate(self, rid: int, num_tokens: int, lookahead: int = 0, in_flight: int = 0) -> bool:
        """Slots for a chunk or decode step (+ draft slots); False: refused, the preemption signal."""
        return bool(
            self.kv.allocate_slots(
                rid, num_tokens, num_lookahead_tokens=lookahead, num_in_flight_tokens=in_flight
            )
        )

    def provide(self, rid: int, token_ids: list[int], num_computed: int | None = None) -> None:
        """Ids of tokens after the known ones; ``num_computed``: the watermark after rejected drafts."""
        self.kv.provide_token_ids(rid, token_ids, num_computed_tokens=num_computed)

    def free(self, rid: int) -> None:
        self.kv.free(rid)

    def num_computed(self, rid: int) -> int:
        return int(self.kv.num_computed_tokens(rid))

    def in_use(self) -> int:
        return int(self.kv.num_blocks - self.kv.num_free_blocks)

    def check(self) -> None:
        self.kv.check_invariants()


class VllmSide:
    """vLLM v1's ``KVCacheManager`` (one full-attention group, or the hybrid coordinator over a
    full-attention group and sliding-window groups; its ``BlockPool``), driven the way its
    scheduler drives it: ``get_computed_blocks`` + ``allocate_slots(...,
    full_sequence_must_fit=True)`` at admission, ``allocate_slots(req, n,
    num_lookahead_tokens=k)`` per later chunk or decode step (``None``: preempt),
    ``num_computed_tokens`` moved by the caller after each pass (and lowered for rejected
    drafts), ``cache_blocks`` when async or speculative output arrives, ``free`` on finish or
    preemption."""

    def __init__(
        self, num_blocks: int, block_size: int, windows: Windows = (), watermark_blocks: int = 0
    ) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request, RequestStatus

        def spec(window: int | None) -> Any:
            shape = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16)
            if window is None:
                return FullAttentionSpec(**shape)
            return SlidingWindowSpec(**shape, sliding_window=window)

        config = KVCacheConfig(
            num_blocks=num_blocks + 1,  # block 0 is vLLM's null block
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"layer.{g}"], spec(w)) for g, w in enumerate(windows or (None,))
            ],
        )
        self.num_groups = len(config.kv_cache_groups)
        self.max_model_len = 1 << 20
        self.mgr = KVCacheManager(
            config,
            max_model_len=self.max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
        )
        # vLLM sizes its watermark as a fraction of the pool; set the block count directly so
        # both sides hold back the same number.
        self.mgr.watermark_blocks = watermark_blocks
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(block_size, hash_fn)
        self.params = SamplingParams(max_tokens=self.max_model_len)
        self.request_cls = Request
        self.running_status = RequestStatus.RUNNING
        self.num_blocks = num_blocks
        self.reqs: dict[int, Any] = {}
        self.revived = 0  # cached-evictable hit blocks the last admission took back
        self.evictable_copies = 0  # of its hit blocks, those with two evictable copies

    def match(self, tokens: list[int]) -> int:
        req = self.request_cls("probe", tokens, self.params, None, block_hasher=self.hasher)
        return int(self.mgr.get_computed_blocks(req)[1])

    def admit(self, rid: int, tokens: list[int], num_scheduled: int) -> int | None:
        req = self.request_cls(str(rid), tokens, self.params, None, block_hasher=self.hasher)
        blocks, hit, _ = self.mgr.get_computed_blocks(req)
        # hit blocks no request holds are cached-evictable: admitting takes them back
        hit_blocks = [b for group in blocks.blocks for b in group if not b.is_null]
        self.revived = sum(b.ref_cnt == 0 for b in hit_blocks)
        self.evictable_copies = self._evictable_copies(hit_blocks)
        chunk = min(num_scheduled, len(tokens) - hit)
        out = self.mgr.allocate_slots(req, chunk, hit, blocks, full_sequence_must_fit=True)
        if out is None:
            return None
        req.num_computed_tokens = hit + chunk  # the pass ran
        req.status = self.running_status  # the watermark applies to waiting requests only
        self.reqs[rid] = req
        return int(hit)

    def _evictable_copies(self, hit_blocks: list[Any]) -> int:
        """Hit blocks whose content also sits on another cached-evictable block: which copy
        a manager revives decides which one keeps its place in the eviction order."""
        index = self.mgr.block_pool.cached_block_hash_to_block._cache
        count = 0
        for b in hit_blocks:
            copies = index.get(b.block_hash)
            if isinstance(copies, dict):
                count += sum(c.ref_cnt == 0 for c in copies.values()) >= 2
        return count

    def has_duplicate_copies(self) -> bool:
        """Whether vLLM's index holds two blocks of one content (it indexes every copy)."""
        index = self.mgr.block_pool.cached_block_hash_to_block._cache
        return any(isinstance(copies, dict) and len(copies) >= 2 for copies in index.values())

    def tables(self, rid: int) -> list[list[int | None]]:
        """Each group's block table; ``None`` for the null block (a released position)."""
        null = self.mgr.block_pool.null_block.block_id
        return [[None if b == null else b for b in t] for t in self.mgr.get_block_ids(str(rid))]

    def allocate(self, rid: int, num_tokens: int, lookahead: int = 0, in_flight: int = 0) -> bool:
        """The scheduler's ``allocate_slots`` for a running request; on success the pass runs
        (``num_computed_tokens`` moves by ``num_tokens``, drafts included)."""
        req = self.reqs[rid]
        req.num_in_flight_tokens = in_flight
        if self.mgr.allocate_slots(req, num_tokens, num_lookahead_tokens=lookahead) is None:
            return False
        req.num_computed_tokens += num_tokens
        return True

    def provide(
        self, rid: int, token_ids: list[int], num_computed: int | None = None, in_flight: int = 0
    ) -> None:
        """Sampled (or accepted draft) ids arrive: the scheduler appends them, lowers
        ``num_computed_tokens`` for rejected drafts and calls ``cache_blocks`` on what is
        processed (its ``update_from_output`` under async scheduling or spec decoding);
        ``in_flight``: tokens of a later step still in flight."""
        req = self.reqs[rid]
        if token_ids:
            req.append_output_token_ids(token_ids)
        if num_computed is not None:
            req.num_computed_tokens = num_computed
        req.num_in_flight_tokens = in_flight
        self.mgr.cache_blocks(req, req.num_computed_tokens - req.num_in_flight_tokens)

    def append_known(self, rid: int, token: int) -> None:
        """A sampled id the scheduler knows before it schedules the token (synchronous)."""
        self.reqs[rid].append_output_token_ids(token)

    def free(self, rid: int) -> None:
        self.mgr.free(self.reqs.pop(rid))

    def num_computed(self, rid: int) -> int:
        return int(self.reqs[rid].num_computed_tokens)

    def in_use(self) -> int:
        return int(self.num_blocks - self.mgr.block_pool.get_num_free_blocks())


@dataclass
class Config:
    """One schedule family: pool, block size, prompt shapes."""

    num_blocks: int = 48
    block_size: int = 4
    steps: int = 200
    num_prefixes: int = 3
    prefix_tokens: int = 40
    max_suffix: int = 24
    vocab: int = 6  # small: decode tokens and suffixes collide, so generated blocks hit too
    windows: Windows = ()  # KV groups (None: full attention); empty: one full-attention group
    watermark_blocks: int = 0  # blocks an admission must leave free (vLLM's watermark)
    # Async scheduling: a decode step's slot is allocated before its id is known; the id
    # arrives at the request's next decode step, after that step's allocation (one token in
    # flight meanwhile, so window releases run at computed - 1).
    async_ids: bool = False
    # Speculative decoding: up to this many draft tokens per decode step (0: none), each
    # accepted with probability 1/2; the rejected ones are rolled back by the watermark.
    max_drafts: int = 0
    lookahead: int = 0  # draft slots beyond the scheduled tokens (EAGLE-style), never hashed


@dataclass
class Outcome:
    admissions: int = 0
    hits: int = 0
    hit_tokens: int = 0
    ooms: int = 0
    preemptions: int = 0
    drafts: int = 0  # draft tokens scheduled
    rejected: int = 0  # of them, rolled back
    async_ids: int = 0  # ids given after their slots (and a later step's allocation)
    steps: int = 0
    released_positions: int = 0  # hybrid: out-of-window table positions, summed over steps
    mismatches: list[str] = field(default_factory=list)
    # the first explained divergence, after which the schedule stops (see run_schedule)
    diverged: str = ""


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


CONFIGS = {
    "small-pool": Config(),
    "tiny-pool": Config(num_blocks=24, prefix_tokens=30, max_suffix=16),
    "block16": Config(num_blocks=40, block_size=16, prefix_tokens=160, max_suffix=80, vocab=50),
    # no eviction: only the per-chunk growth and the hits are exercised
    "large-pool": Config(num_blocks=4096, steps=150),
    "watermark": Config(num_blocks=32, watermark_blocks=3),
    "async": Config(async_ids=True),
    # n-gram-style drafts scheduled as new tokens, and EAGLE-style lookahead slots beyond them
    "spec": Config(max_drafts=3),
    "spec-lookahead": Config(max_drafts=2, lookahead=2),
}


def main(argv: list[str] | None = None, configs: dict[str, Config] | None = None, doc: str = __doc__) -> int:
    """Runs ``--schedules`` schedules of each configuration (``configs``: this module's
    ``CONFIGS`` unless a caller passes its own) and prints the counts; exit 1 on a mismatch."""
    configs = CONFIGS if configs is None else configs
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--schedules", type=int, default=100, help="schedules per config")
    ap.add_argument("--steps", type=int, default=None, help="override steps per schedule")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(configs))
    args = ap.parse_args(argv)
    import vllm

    print(f"pagedkv {pagedkv.__version__}, vLLM {vllm.__version__}")
    total_mismatches = 0
    for name in args.configs.split(","):
        cfg = configs[name]
        if args.steps is not None:
            cfg = Config(**{**cfg.__dict__, "steps": args.steps})
        agg = Outcome()
        diverged: list[str] = []
        to_the_end = 0
        t0 = time.perf_counter()
        for i in range(args.schedules):
            o = run_schedule(args.seed + i, cfg)
            agg.admissions += o.admissions
            agg.hits += o.hits
            agg.hit_tokens += o.hit_tokens
            agg.ooms += o.ooms
            agg.preemptions += o.preemptions
            agg.drafts += o.drafts
            agg.rejected += o.rejected
            agg.async_ids += o.async_ids
            agg.steps += o.steps
            agg.released_positions += o.released_positions
            agg.mismatches += o.mismatches
            if o.diverged:
                diverged.append(o.diverged)
            to_the_end += o.steps == cfg.steps and not o.diverged
        total_mismatches += len(agg.mismatches)
        print(
            f"{name}: {args.schedules} schedules, {agg.steps} steps, {agg.admissions} "
            f"admissions ({agg.hits} with a hit, {agg.hit_tokens} hit tokens), {agg.ooms} "
            f"refused for lack of blocks, {agg.preemptions} preemptions, "
            f"{len(agg.mismatches)} mismatches, {len(diverged)} schedules stopped at a "
            f"copy-choice divergence, {to_the_end} ran all {cfg.steps} steps "
            f"({time.perf_counter() - t0:.1f} s)"
        )
        if cfg.max_drafts or cfg.async_ids:
            print(
                f"   {agg.drafts} draft tokens scheduled ({agg.rejected} rejected, rolled back), "
                f"{cfg.lookahead} lookahead slots per decode step, {agg.async_ids} ids given a step late"
            )
        if cfg.windows:
            print(
                f"   groups {cfg.windows} (None: full attention), block {cfg.block_size}: "
                f"{agg.released_positions} out-of-window positions compared (summed over steps)"
            )
        kinds = {
            "held/evictable copy": sum("requests sharing it" in d for d in diverged),
            "fit differs": sum("fits pagedkv" in d for d in diverged),
            "two evictable copies": sum("two cached-evictable" in d for d in diverged),
            "after duplicate copies": sum("two copies of one" in d for d in diverged),
        }
        steps_to_stop = sorted(int(d.split(" step ")[1].split(":")[0]) for d in diverged)
        if diverged:
            print(f"   stops by kind {kinds}; median step of a stop {steps_to_stop[len(steps_to_stop) // 2]}")
        for d in diverged[:3]:
            print("   stopped:", d)
        for m in agg.mismatches[:20]:
            print("  ", m)
    return 1 if total_mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
