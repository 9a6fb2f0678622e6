"""Model-based test (hypothesis.stateful) of hybrid KV groups: random ``kv_groups``
(one to three groups, full attention or sliding windows of 1-9 tokens, block sizes 1-4), prefix
caching on, optionally a host tier, and every operation: admissions with hits (``extra_key``,
chunked prefill), ``advance_computed``, ``append_tokens`` (single and batch), ``fork``,
``truncate``, ``swap_out`` / ``swap_in``, ``pin_prefix`` / ``unpin_prefix``, ``match_prefix``,
``free`` / ``free_last_group_first`` / ``free_batch`` and freeing everything.

``check_invariants()`` runs after every step, and the model checks:

* released positions: in a window group exactly the leading table positions vLLM's rule
  releases are ``-1``. A pass scheduling positions ``[c, c+k)`` still reads the window of
  position ``c``, so it may release only the blocks wholly before ``c - W + 1`` (vLLM frees at
  ``allocate_slots`` from the ``num_computed_tokens`` before the pass); full-attention tables
  hold no ``-1``; released positions stay released;
* hits: ``match_prefix`` (which changes nothing) equals what ``add_sequence`` returns; a hit
  never exceeds the longest prefix some pass computed (an oracle of every block-aligned prefix
  ever scheduled, per ``extra_key``) and equals it as long as nothing was evicted, truncated or
  swapped (every computed block of every group is then still cached);
* a data plane: every write goes through the group's table or ``slot_mapping(group=)`` and
  stores (token, namespace, group); every live, computed, unreleased position of every group
  must read back exactly its own token, so a hit served from another group's block, a wrong
  copy-on-write or swap copy, or a released block reused while still in the window fails;
* blocks: a physical block belongs to one group at a time; refcounts equal the table
  references (pins add to them); ``stats()["num_blocks_in_use"]`` counts the distinct blocks of
  all groups; after freeing everything and unpinning every pin, every block is free.
"""

from __future__ import annotations

import itertools
from typing import Any

import hypothesis.strategies as st
import pagedkv
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pagedkv import InvalidArgumentError, OutOfBlocksError, SequenceSwappedOutError

NUM_BLOCKS = 30  # small: evictions happen; a prompt whose tables never fit together is refused
NUM_HOST_BLOCKS = 24
VOCAB = 3  # a tiny vocabulary makes equal prefixes (prefix-cache hits) frequent
MAX_PROMPT = 14

SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)

Cell = tuple[int, Any, int]  # (token id, namespace, group) held by one KV slot


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def released_blocks(pass_start: int, window: int | None, block_size: int) -> int:
    """Leading blocks a window group may release before a pass that schedules from
    ``pass_start``: those wholly before ``pass_start - window + 1`` (vLLM's
    ``get_num_skipped_tokens`` on the tokens computed before the pass)."""
    if window is None:
        return 0
    return max(0, pass_start - window + 1) // block_size


def snapshot(kv: pagedkv.KvCacheManager, seq_ids: list[int], num_groups: int) -> dict[str, Any]:
    """Everything observable about ``kv`` and the sequences, every group's table included."""
    tables = {}
    for seq_id in seq_ids:
        if seq_id in kv:
            swapped = kv.num_host_blocks > 0 and kv.is_swapped_out(seq_id)
            groups = (
                None if swapped else [kv.block_table(seq_id, group=g).tolist() for g in range(num_groups)]
            )
            tables[seq_id] = (groups, kv.num_tokens(seq_id), kv.num_computed_tokens(seq_id))
    return {
        "tables": tables,
        "refcounts": [kv.refcount(b) for b in range(kv.num_blocks)],
        "num_free_blocks": kv.num_free_blocks,
        "stats": kv.stats(),
    }


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: pagedkv.KvCacheManager
        self.block_size = 1
        self.windows: list[int | None] = [None]
        self.host = False
        self.next_id = itertools.count(100)
        self.tokens: dict[int, list[int]] = {}  # live seq -> its tokens
        self.computed: dict[int, int] = {}
        self.namespace: dict[int, Any] = {}
        self.released: dict[int, list[int]] = {}  # seq -> per group, leading released blocks
        self.swapped: set[int] = set()
        self.content: dict[int, list[Cell | None]] = {}  # device block -> slots
        self.host_content: dict[int, list[Cell | None]] = {}
        self.host_of: dict[int, dict[tuple[int, int], int]] = {}  # swapped seq -> (g, i) -> host block
        self.computed_prefixes: set[tuple[Any, tuple[int, ...]]] = set()
        self.exact = True  # nothing evicted, truncated or swapped yet: hits equal the oracle
        self.history: list[list[int]] = []
        self.pins: list[tuple[list[int], Any, int]] = []

    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4]),
        windows=st.lists(st.one_of(st.none(), st.integers(1, 9)), min_size=1, max_size=3),
        host=st.booleans(),
    )
    def setup(self, block_size: int, windows: list[int | None], host: bool) -> None:
        self.block_size = block_size
        self.windows = windows
        self.host = host
        groups = [pagedkv.FullAttention() if w is None else pagedkv.SlidingWindow(window=w) for w in windows]
        self.kv = pagedkv.KvCacheManager(
            num_blocks=NUM_BLOCKS,
            block_size=block_size,
            enable_prefix_caching=True,
            num_host_blocks=NUM_HOST_BLOCKS if host else 0,
            kv_groups=groups,
        )
        event(f"{len(windows)} groups, {sum(w is not None for w in windows)} windowed")

    # ------------------------------------------------------------------ model helpers
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def live(self) -> list[int]:
        return sorted(self.tokens)

    def resident(self) -> list[int]:
        return [s for s in self.live() if s not in self.swapped]

    def ready(self) -> list[int]:
        return [s for s in self.resident() if self.computed[s] == len(self.tokens[s])]

    def prefilling(self) -> list[int]:
        return [s for s in self.resident() if self.computed[s] < len(self.tokens[s])]

    def never_fits(self, num_tokens: int) -> bool:
        """A sequence whose tables, one per group, could never fit the pool together is
        refused (InvalidArgumentError), windows or not."""
        return ceil_div(num_tokens, self.block_size) * self.num_groups > NUM_BLOCKS

    def tables(self, seq_id: int) -> list[list[int]]:
        return [self.kv.block_table(seq_id, group=g).tolist() for g in range(self.num_groups)]

    def has_one_token_window(self) -> bool:
        """Some group is a window of one token: it caches no block and so serves no hit (as in
        vLLM, whose reachability mask caches none and whose scan hits only at a cached block)."""
        return any(w == 1 for w in self.windows)

    def oracle_hit(self, prompt: list[int], extra_key: Any) -> int:
        """The longest block-aligned prefix (at most len - 1 tokens) some pass computed: a hit
        at L needs the full groups' blocks before L and each window group's blocks covering
        ``[L - W + 1, L)``, the last of which is the block ending at L, and a
        computed block implies every block before it was computed. A window of one token
        caches nothing, so with one there is no hit."""
        if self.has_one_token_window():
            return 0
        best = 0
        for end in range(self.block_size, len(prompt), self.block_size):
            if (extra_key, tuple(prompt[:end])) in self.computed_prefixes:
                best = end
        return best

    def note_computed(self, seq_id: int) -> None:
        tokens, upto = self.tokens[seq_id], self.computed[seq_id]
        for end in range(self.block_size, upto - upto % self.block_size + 1, self.block_size):
            self.computed_prefixes.add((self.namespace[seq_id], tuple(tokens[:end])))

    def start_pass(self, seq_id: int) -> None:
        """The sequence's next pass starts at its watermark: release what the rule allows."""
        for g, window in enumerate(self.windows):
            rel = released_blocks(self.computed[seq_id], window, self.block_size)
            self.released[seq_id][g] = max(self.released[seq_id][g], rel)

    def write(self, seq_id: int, first: int, end: int) -> None:
        """Writes positions ``[first, end)`` of every group through its block table, checking
        each written block is unshared and not released."""
        self.run_copy_ops()
        tokens = self.tokens[seq_id]
        for g, table in enumerate(self.tables(seq_id)):
            for position in range(first, end):
                block = table[position // self.block_size]
                assert block >= 0, f"write into released position {position} of group {g}"
                assert self.kv.refcount(block) == 1, f"write into shared block {block}"
                cells = self.content.setdefault(block, [None] * self.block_size)
                cells[position % self.block_size] = (tokens[position], self.namespace[seq_id], g)

    def write_appended(self, seq_ids: list[int], count: int) -> None:
        """Writes the last ``count`` tokens of each sequence through ``slot_mapping(group=)``."""
        self.run_copy_ops()
        for g in range(self.num_groups):
            slots = self.kv.slot_mapping(seq_ids, count, group=g).tolist()
            assert len(slots) == count * len(seq_ids)
            for index, seq_id in enumerate(seq_ids):
                tokens = self.tokens[seq_id]
                for k, slot in enumerate(slots[index * count : (index + 1) * count]):
                    position = len(tokens) - count + k
                    block, offset = divmod(slot, self.block_size)
                    assert self.kv.block_table(seq_id, group=g)[position // self.block_size] == block
                    assert self.kv.refcount(block) == 1, f"write into shared block {block}"
                    cells = self.content.setdefault(block, [None] * self.block_size)
                    cells[offset] = (tokens[position], self.namespace[seq_id], g)

    def run_copy_ops(self) -> None:
        for src, dst in self.kv.take_copy_ops().tolist():
            self.content[dst] = list(self.content.get(src, [None] * self.block_size))

    def failed_cleanly(self, errors: Any, op: Any) -> Any:
        """Runs ``op``; if it raises one of ``errors``, asserts nothing changed and returns the
        exception, else returns ("ok", result)."""
        seqs = self.live()
        before = snapshot(self.kv, seqs, self.num_groups)
        try:
            return ("ok", op())
        except errors as err:
            assert snapshot(self.kv, seqs, self.num_groups) == before
            event(f"failed cleanly: {type(err).__name__}")
            return err

    def failed_growth(self, op: Any, seqs: list[int]) -> Any:
        """Runs a growth (``append_tokens``, ``append_tokens_batch``); if it raises
        OutOfBlocksError nothing changed: pagedkv's appends fail all or nothing with any number
        of groups (docs/design.md; vLLM's release-before-sizing applies to ``allocate_slots``
        only, tests/python/test_per_chunk.py). Returns as ``failed_cleanly``."""
        return self.failed_cleanly((OutOfBlocksError,), op)

    def note_evictions(self, before: int) -> None:
        if self.kv.stats()["evictions"] > before:
            event("eviction")
            self.exact = False

    def forget(self, seq_id: int) -> None:
        for table in (self.tokens, self.computed, self.namespace, self.released, self.host_of):
            table.pop(seq_id, None)  # type: ignore[attr-defined]
        self.swapped.discard(seq_id)

    # ------------------------------------------------------------------ rules
    @rule(
        num_tokens=st.integers(0, MAX_PROMPT),
        with_ids=st.booleans(),
        extra_key=st.sampled_from([None, None, "a"]),
        num_scheduled=st.one_of(st.none(), st.integers(0, 8)),
        data=st.data(),
    )
    def add(
        self, num_tokens: int, with_ids: bool, extra_key: Any, num_scheduled: int | None, data: st.DataObject
    ) -> None:
        seq_id = next(self.next_id)
        prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=num_tokens, max_size=num_tokens))
        if self.history and data.draw(st.integers(0, 3)) > 0:
            base = data.draw(st.sampled_from(self.history[-6:]))
            keep = min(len(base), num_tokens)
            prompt = base[:keep] + prompt[keep:]
        if not with_ids:
            extra_key = None
        if with_ids:
            before = snapshot(self.kv, self.live(), self.num_groups)
            matched = self.kv.match_prefix(prompt, extra_key=extra_key)
            assert snapshot(self.kv, self.live(), self.num_groups) == before
            call = lambda: self.kv.add_sequence(  # noqa: E731
                seq_id, prompt, extra_key=extra_key, num_scheduled=num_scheduled
            )
        else:
            call = lambda: self.kv.add_sequence(  # noqa: E731
                seq_id, num_tokens=num_tokens, num_scheduled=num_scheduled
            )
        evictions = self.kv.stats()["evictions"]
        if self.never_fits(num_tokens):
            assert not isinstance(self.failed_cleanly(InvalidArgumentError, call), tuple)
            return
        outcome = self.failed_cleanly(OutOfBlocksError, call)
        if not isinstance(outcome, tuple):
            return
        self.note_evictions(evictions)
        hit = outcome[1]
        assert hit % self.block_size == 0 and 0 <= hit <= max(num_tokens - 1, 0)
        if with_ids:
            assert hit == matched
            assert hit <= self.oracle_hit(prompt, extra_key)
            if self.exact:
                assert hit == self.oracle_hit(prompt, extra_key)
            self.history.append(list(prompt))
        else:
            assert hit == 0
        if hit:
            event("prefix hit")
            if any(w is not None and released_blocks(hit, w, self.block_size) for w in self.windows):
                event("prefix hit past a window")
        self.tokens[seq_id] = list(prompt) if with_ids else [0] * num_tokens
        self.namespace[seq_id] = extra_key if with_ids else ("bare", seq_id)
        self.computed[seq_id] = hit
        self.released[seq_id] = [0] * self.num_groups
        self.start_pass(seq_id)  # the admission pass starts at the hit
        computed = num_tokens if num_scheduled is None else hit + min(num_scheduled, num_tokens - hit)
        self.computed[seq_id] = computed
        assert self.kv.num_computed_tokens(seq_id) == computed
        # The hit serves this prompt's own keys in every group, wherever the window still
        # needs them (the released positions are checked by the invariant).
        for g, table in enumerate(self.tables(seq_id)):
            for position in range(self.released[seq_id][g] * self.block_size, hit):
                cell = self.content[table[position // self.block_size]][position % self.block_size]
                assert cell == (prompt[position], extra_key, g), (g, position)
        self.write(seq_id, hit, computed)
        if with_ids:
            self.note_computed(seq_id)

    @precondition(lambda self: self.prefilling())
    @rule(data=st.data())
    def advance_computed(self, data: st.DataObject) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.prefilling()), min_size=1, max_size=3, unique=True))
        left = min(len(self.tokens[s]) - self.computed[s] for s in seqs)
        count = data.draw(st.integers(1, left))  # (a pass of no tokens is no pass)
        self.kv.advance_computed(seqs, count)
        for seq_id in seqs:
            self.start_pass(seq_id)
            first = self.computed[seq_id]
            self.computed[seq_id] += count
            self.write(seq_id, first, self.computed[seq_id])
            if not isinstance(self.namespace[seq_id], tuple):
                self.note_computed(seq_id)

    @precondition(lambda self: self.ready())
    @rule(data=st.data(), count=st.integers(1, 5))
    def append(self, data: st.DataObject, count: int) -> None:
        seq_id = data.draw(st.sampled_from(self.ready()))
        new = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=count, max_size=count))
        evictions = self.kv.stats()["evictions"]
        call = lambda: self.kv.append_tokens(seq_id, new)  # noqa: E731
        if self.never_fits(len(self.tokens[seq_id]) + count):
            assert not isinstance(self.failed_cleanly(InvalidArgumentError, call), tuple)
            return
        outcome = self.failed_growth(call, [seq_id])
        if not isinstance(outcome, tuple):
            return
        self.note_evictions(evictions)
        self.start_pass(seq_id)
        self.tokens[seq_id].extend(new)
        self.computed[seq_id] = len(self.tokens[seq_id])
        if count:
            self.write_appended([seq_id], count)
        if not isinstance(self.namespace[seq_id], tuple):
            self.note_computed(seq_id)

    @precondition(lambda self: self.ready())
    @rule(data=st.data(), count=st.integers(1, 2))
    def append_batch(self, data: st.DataObject, count: int) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.ready()), min_size=1, max_size=3, unique=True))
        new = data.draw(
            st.lists(st.integers(0, VOCAB - 1), min_size=count * len(seqs), max_size=count * len(seqs))
        )
        evictions = self.kv.stats()["evictions"]
        call = lambda: self.kv.append_tokens_batch(seqs, new, num_tokens=count)  # noqa: E731
        if any(self.never_fits(len(self.tokens[s]) + count) for s in seqs):
            assert not isinstance(self.failed_cleanly(InvalidArgumentError, call), tuple)
            return
        outcome = self.failed_growth(call, seqs)
        if not isinstance(outcome, tuple):
            return
        self.note_evictions(evictions)
        for index, seq_id in enumerate(seqs):
            self.start_pass(seq_id)
            self.tokens[seq_id].extend(new[index * count : (index + 1) * count])
            self.computed[seq_id] = len(self.tokens[seq_id])
            if not isinstance(self.namespace[seq_id], tuple):
                self.note_computed(seq_id)
        self.write_appended(seqs, count)

    @precondition(lambda self: self.ready())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.ready()))
        child = next(self.next_id)
        self.kv.fork(parent, child)
        assert self.tables(child) == self.tables(parent)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        self.namespace[child] = self.namespace[parent]
        self.released[child] = list(self.released[parent])
        assert self.kv.num_computed_tokens(child) == self.computed[child]

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.resident()))
        n = len(self.tokens[seq_id])
        keep = data.draw(st.integers(0, n))
        # A rollback behind a window's released positions is refused, and only that: the
        # next pass (at ``keep``; a prefilling sequence's watermark is already lower, and
        # released nothing it would read) reads the window blocks before ``keep`` and writes
        # into the kept partial block, which must all still be there.
        kept_blocks = ceil_div(keep, self.block_size)
        needs_released = any(
            w is not None
            and min(self.released[seq_id][g], kept_blocks) > released_blocks(keep, w, self.block_size)
            for g, w in enumerate(self.windows)
        )
        outcome = self.failed_cleanly(InvalidArgumentError, lambda: self.kv.truncate(seq_id, keep))
        assert isinstance(outcome, tuple) != needs_released, (keep, self.released[seq_id])
        if not isinstance(outcome, tuple):
            return
        event("truncate")
        self.exact = False
        del self.tokens[seq_id][keep:]
        self.computed[seq_id] = min(self.computed[seq_id], keep)
        num_blocks = ceil_div(keep, self.block_size)
        self.released[seq_id] = [min(r, num_blocks) for r in self.released[seq_id]]
        assert self.kv.num_computed_tokens(seq_id) == self.computed[seq_id]

    @precondition(lambda self: self.history)
    @rule(data=st.data(), extra_key=st.sampled_from([None, None, "a"]))
    def match_prefix(self, data: st.DataObject, extra_key: Any) -> None:
        base = data.draw(st.sampled_from(self.history[-6:]))
        prompt = base[: data.draw(st.integers(0, len(base)))] + data.draw(
            st.lists(st.integers(0, VOCAB - 1), max_size=3)
        )
        before = snapshot(self.kv, self.live(), self.num_groups)
        hit = self.kv.match_prefix(prompt, extra_key=extra_key)
        assert snapshot(self.kv, self.live(), self.num_groups) == before
        assert hit % self.block_size == 0 and hit <= self.oracle_hit(prompt, extra_key)
        if self.exact:
            assert hit == self.oracle_hit(prompt, extra_key)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), extra_key=st.sampled_from([None, None, "a"]))
    def pin_prefix(self, data: st.DataObject, extra_key: Any) -> None:
        base = data.draw(st.sampled_from(self.history[-6:]))
        prompt = base[: data.draw(st.integers(0, len(base)))]
        pinned = self.kv.pin_prefix(prompt, extra_key=extra_key)
        assert pinned % self.block_size == 0 and pinned <= len(prompt)
        assert pinned >= self.kv.match_prefix(prompt, extra_key=extra_key)
        if pinned:
            event("pinned")
            self.pins.append((prompt, extra_key, pinned))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin_prefix(self, data: st.DataObject) -> None:
        prompt, extra_key, _ = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.kv.unpin_prefix(prompt, extra_key=extra_key)

    @precondition(lambda self: self.host and self.resident())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.resident()))
        tables = self.tables(seq_id)
        outcome = self.failed_cleanly(
            (OutOfBlocksError, InvalidArgumentError), lambda: self.kv.swap_out(seq_id)
        )
        if not isinstance(outcome, tuple):
            return
        event("swap_out")
        self.exact = False
        ops = outcome[1]
        live_blocks = {b for table in tables for b in table if b >= 0}
        assert ops.shape == (len(live_blocks), 2)
        host_of_device = dict(ops.tolist())
        assert set(host_of_device) == live_blocks
        for device, host in host_of_device.items():
            self.host_content[host] = list(self.content.get(device, [None] * self.block_size))
        self.host_of[seq_id] = {
            (g, i): host_of_device[b] for g, table in enumerate(tables) for i, b in enumerate(table) if b >= 0
        }
        self.swapped.add(seq_id)
        assert self.kv.is_swapped_out(seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        self.failed_cleanly(SequenceSwappedOutError, lambda: self.kv.append_tokens(seq_id, [0]))
        outcome = self.failed_cleanly(OutOfBlocksError, lambda: self.kv.swap_in(seq_id))
        if not isinstance(outcome, tuple):
            return
        event("swap_in")
        ops = outcome[1]
        device_of_host = dict(ops.tolist())
        assert set(device_of_host) == set(self.host_of[seq_id].values())
        for host, device in device_of_host.items():
            self.content[device] = list(self.host_content[host])
        self.swapped.discard(seq_id)
        tables = self.tables(seq_id)
        for (g, i), host in self.host_of.pop(seq_id).items():
            assert tables[g][i] == device_of_host[host]

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        self.kv.free(seq_id)
        self.forget(seq_id)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def free_last_group_first(self, data: st.DataObject) -> None:
        """``free`` in a deferred free's eviction order (the last group's cached blocks first):
        the same references dropped, the same blocks freed or cached."""
        seq_id = data.draw(st.sampled_from(self.live()))
        self.kv.free_last_group_first(seq_id)
        self.forget(seq_id)

    @precondition(lambda self: len(self.live()) >= 2)
    @rule(data=st.data())
    def free_batch(self, data: st.DataObject) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=3, unique=True))
        self.kv.free_batch(seqs)
        for seq_id in seqs:
            self.forget(seq_id)

    @rule()
    def free_everything(self) -> None:
        """Freeing every sequence and unpinning every pin leaves every block allocatable."""
        self.kv.free_batch(self.live())
        for seq_id in self.live():
            self.forget(seq_id)
        while self.pins:
            prompt, extra_key, _ = self.pins.pop()
            self.kv.unpin_prefix(prompt, extra_key=extra_key)
        stats = self.kv.stats()
        assert stats["num_blocks_in_use"] == 0 and stats["num_pinned_blocks"] == 0
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(self.kv.refcount(b) == 0 for b in range(NUM_BLOCKS))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()
        assert len(self.kv) == len(self.live())
        group_of: dict[int, int] = {}
        references: dict[int, int] = {}
        for seq_id in self.resident():
            tokens = self.tokens[seq_id]
            assert self.kv.num_tokens(seq_id) == len(tokens)
            assert self.kv.num_computed_tokens(seq_id) == self.computed[seq_id]
            for g, table in enumerate(self.tables(seq_id)):
                assert len(table) == ceil_div(len(tokens), self.block_size)
                released = [i for i, b in enumerate(table) if b < 0]
                assert released == list(range(self.released[seq_id][g])), (seq_id, g, released)
                if released:
                    event("released positions")
                for block in table:
                    if block < 0:
                        continue
                    assert group_of.setdefault(block, g) == g, f"block {block} in two groups"
                    references[block] = references.get(block, 0) + 1
                for position in range(self.released[seq_id][g] * self.block_size, self.computed[seq_id]):
                    cell = self.content[table[position // self.block_size]][position % self.block_size]
                    assert cell == (tokens[position], self.namespace[seq_id], g), (seq_id, g, position)
        stats = self.kv.stats()
        for block, count in references.items():
            if self.pins:
                assert self.kv.refcount(block) >= count
            else:
                assert self.kv.refcount(block) == count
        if self.pins:
            assert stats["num_pinned_blocks"] > 0
            assert stats["num_blocks_in_use"] >= len(references)
        else:
            assert stats["num_pinned_blocks"] == 0
            assert stats["num_blocks_in_use"] == len(references)
        for prompt, extra_key, pinned in self.pins:
            assert self.kv.match_prefix(prompt[:pinned] + [0], extra_key=extra_key) >= pinned
        for seq_id in self.swapped:
            for (g, i), host in self.host_of[seq_id].items():
                for offset, cell in enumerate(self.host_content[host]):
                    position = i * self.block_size + offset
                    if position < self.computed[seq_id]:
                        assert cell == (self.tokens[seq_id][position], self.namespace[seq_id], g)


TestHybridStateMachine = HybridMachine.TestCase
TestHybridStateMachine.settings = SETTINGS
