"""Model-based tests (hypothesis.stateful), mirroring the Rust proptest model test.

Random add / append / batch append / fork / free / batch free sequences (with copy-on-write),
chunked prefill (``num_scheduled`` / ``advance_computed``), ``truncate``, ``match_prefix`` and
pinned prefixes, then prefix-cache hits and evictions, then swap_out / swap_in, run against two
references:

* a block model: every sequence's table as abstract block ids with refcounts, predicting the
  exact number of device (and host) blocks in use, which operations fail and with which error,
  and the sharing structure of the physical tables (same abstract block <=> same physical one);
* a data plane: the content of every physical device and host block slot, written through the
  manager's slot mapping, with copy-on-write and swap copies executed as a data plane would.
  Every sequence must read back exactly its own computed tokens (a pass writes a chunk's K/V
  when it is scheduled); a prefix hit must serve exactly the prompt's tokens from the same
  namespace (extra_key), so a hit on a block not yet computed fails; no write may land in a
  shared block.

``check_invariants()`` runs after every step, and a failed operation must change nothing. With
prefix caching, a third reference: an index rebuilt only from the KV events (each hash stored at
most once, one copy per content) must predict ``match_prefix`` for every prompt seen, in every
namespace, after every step (a hit once fell short of what the events said was stored).
"""

from __future__ import annotations

import itertools
from typing import Any

import hypothesis.strategies as st
import pagedkv
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_test_helpers import snapshot
from pagedkv import (
    InvalidArgumentError,
    OutOfBlocksError,
    SequenceSwappedOutError,
    UnknownSequenceError,
)

NUM_BLOCKS = 24
NUM_HOST_BLOCKS = 12
VOCAB = 3  # a tiny vocabulary makes equal prefixes (prefix-cache hits) frequent
UNKNOWN = 10**9

SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None)

Cell = tuple[int, Any]  # (token id, namespace) held by one KV slot


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ManagerMachine(RuleBasedStateMachine):
    """No prefix caching, no host tier: the block model predicts everything exactly."""

    prefix_caching = False
    host_blocks = 0
    kv_events = False

    def __init__(self) -> None:
        super().__init__()
        self.kv: pagedkv.KvCacheManager
        self.block_size = 1
        self.next_id = itertools.count(100)
        self.next_abstract = itertools.count()
        self.tokens: dict[int, list[int]] = {}  # seq -> its tokens (data-plane truth)
        self.namespace: dict[int, Any] = {}  # seq -> the extra_key its blocks are hashed under
        self.abstract: dict[int, list[int]] = {}  # resident seq -> abstract device block ids
        self.abstract_refs: dict[int, int] = {}
        self.swapped: dict[int, list[int]] = {}  # swapped-out seq -> abstract host block ids
        self.host_refs: dict[int, int] = {}
        self.host_physical: dict[int, int] = {}  # abstract host block -> host block id
        self.content: dict[int, list[Cell | None]] = {}  # device block -> slots
        self.host_content: dict[int, list[Cell | None]] = {}  # host block -> slots
        self.hit_tokens_total = 0
        self.history: list[list[int]] = []  # prompts seen, reused to provoke prefix hits
        self.computed: dict[int, int] = {}  # seq -> its computed watermark
        self.pins: list[tuple[list[int], Any, int]] = []  # (prompt, extra_key, tokens pinned)
        self.stored_hashes: set[int] = set()  # what the KV events say the device index holds

    @initialize(block_size=st.sampled_from([1, 2, 3, 4]))
    def setup(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv = pagedkv.KvCacheManager(
            num_blocks=NUM_BLOCKS,
            block_size=block_size,
            enable_prefix_caching=self.prefix_caching,
            num_host_blocks=self.host_blocks,
            enable_kv_events=self.kv_events,
        )

    # ------------------------------------------------------------------ model helpers
    def resident(self) -> list[int]:
        return sorted(self.abstract)

    def ready(self) -> list[int]:
        """Resident sequences done prefilling (they may grow and fork)."""
        return [s for s in sorted(self.abstract) if self.computed[s] == len(self.tokens[s])]

    def prefilling(self) -> list[int]:
        return [s for s in sorted(self.abstract) if self.computed[s] < len(self.tokens[s])]

    def live(self) -> list[int]:
        return sorted(set(self.abstract) | set(self.swapped))

    def device_in_use(self) -> int:
        return len(self.abstract_refs)

    def model_free(self) -> int | None:
        """Free device blocks the model predicts (None when cached blocks make it unknown)."""
        return None if self.prefix_caching else NUM_BLOCKS - self.device_in_use()

    def new_abstract(self) -> int:
        block = next(self.next_abstract)
        self.abstract_refs[block] = 1
        return block

    def drop_abstract(self, block: int) -> None:
        self.abstract_refs[block] -= 1
        if self.abstract_refs[block] == 0:
            del self.abstract_refs[block]

    def drop_host(self, block: int) -> None:
        self.host_refs[block] -= 1
        if self.host_refs[block] == 0:
            del self.host_refs[block]
            del self.host_physical[block]

    def append_need(self, seq_id: int, count: int) -> int:
        # (Without prefix caching no block is indexed, so only sharing makes a copy.)
        n = len(self.tokens[seq_id])
        table = self.abstract[seq_id]
        copy = count > 0 and n % self.block_size != 0 and self.abstract_refs[table[-1]] > 1
        return ceil_div(n + count, self.block_size) - len(table) + int(copy)

    def model_append(self, seq_id: int, count: int) -> None:
        n = len(self.tokens[seq_id])
        table = self.abstract[seq_id]
        if count > 0 and n % self.block_size != 0 and self.abstract_refs[table[-1]] > 1:
            self.drop_abstract(table[-1])
            table[-1] = self.new_abstract()
        while len(table) < ceil_div(n + count, self.block_size):
            table.append(self.new_abstract())

    def abstract_of_physical(self, block: int) -> int:
        """The abstract id of a resident physical block (a revived cached block gets a new one)."""
        for seq_id, table in self.abstract.items():
            physical = self.kv.block_table(seq_id).tolist()
            if block in physical:
                abstract = table[physical.index(block)]
                self.abstract_refs[abstract] += 1
                return abstract
        return self.new_abstract()

    def write(self, seq_id: int, first: int, end: int | None = None) -> None:
        """Runs pending copies, then writes the sequence's tokens at positions `first..end`
        (default: to its end, through the manager's slot mapping; else through its block
        table), checking each written block is unshared."""
        self.run_copy_ops()
        tokens = self.tokens[seq_id]
        if end is None or end == len(tokens):
            end = len(tokens)
            count = end - first
            slots = self.kv.slot_mapping([seq_id], count).tolist() if count else []
        else:
            table = self.kv.block_table(seq_id).tolist()
            slots = [
                table[p // self.block_size] * self.block_size + p % self.block_size for p in range(first, end)
            ]
        for position, slot in zip(range(first, end), slots, strict=True):
            block, offset = divmod(slot, self.block_size)
            assert self.kv.refcount(block) == 1, f"write into shared block {block}"
            cells = self.content.setdefault(block, [None] * self.block_size)
            cells[offset] = (tokens[position], self.namespace[seq_id])

    def run_copy_ops(self) -> None:
        ops = self.kv.take_copy_ops()
        assert ops.shape[1:] == (2,)
        for src, dst in ops.tolist():
            self.content[dst] = list(self.content.get(src, [None] * self.block_size))

    def call_changing_nothing_on(self, errors: Any, op: Any) -> Any:
        """Runs `op`; if it raises one of `errors`, asserts nothing changed and returns the
        exception, else returns ("ok", result)."""
        before = snapshot(self.kv, self.live() + [UNKNOWN])
        try:
            return ("ok", op())
        except errors as err:
            assert snapshot(self.kv, self.live() + [UNKNOWN]) == before
            return err

    def expect_failure(self, error: Any, op: Any) -> None:
        outcome = self.call_changing_nothing_on(error, op)
        assert not isinstance(outcome, tuple), f"expected {error}, got {outcome}"
        event(f"failed cleanly: {type(outcome).__name__}")

    # ------------------------------------------------------------------ rules
    @rule(
        num_tokens=st.integers(0, 14),
        with_ids=st.booleans(),
        extra_key=st.sampled_from([None, None, "a", b"b"]),
        num_scheduled=st.one_of(st.none(), st.integers(0, 8)),
        data=st.data(),
    )
    def add(
        self, num_tokens: int, with_ids: bool, extra_key: Any, num_scheduled: int | None, data: st.DataObject
    ) -> None:
        seq_id = next(self.next_id)
        prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=num_tokens, max_size=num_tokens))
        if self.history and data.draw(st.integers(0, 3)) > 0:
            # Mostly reuse an earlier prompt's beginning, so prefix hits are common.
            base = data.draw(st.sampled_from(self.history[-6:]))
            limit = min(len(base), num_tokens)
            keep = data.draw(st.one_of(st.just(limit), st.integers(0, limit)))
            prompt = base[:keep] + prompt[keep:]
        if not with_ids:
            extra_key = None
        needed = ceil_div(num_tokens, self.block_size)
        free = self.model_free()
        if with_ids:
            call = lambda: self.kv.add_sequence(  # noqa: E731
                seq_id, prompt, extra_key=extra_key, num_scheduled=num_scheduled
            )
            # The hit the admission will take, read first without any side effect.
            before = snapshot(self.kv, self.live())
            matched = self.kv.match_prefix(prompt, extra_key=extra_key)
            assert snapshot(self.kv, self.live()) == before
        else:
            call = lambda: self.kv.add_sequence(  # noqa: E731
                seq_id, num_tokens=num_tokens, num_scheduled=num_scheduled
            )
        if needed > NUM_BLOCKS:
            self.expect_failure(InvalidArgumentError, call)
            return
        if free is not None and needed > free:
            self.expect_failure(OutOfBlocksError, call)
            return
        evictions = self.kv.stats()["evictions"]
        outcome = self.call_changing_nothing_on(OutOfBlocksError, call)
        if not isinstance(outcome, tuple):
            assert free is None  # only a cache-aware manager leaves this unpredicted
            event("failed cleanly: OutOfBlocksError (cache-aware)")
            return
        hit = outcome[1]
        if with_ids:
            assert hit == matched
        if hit:
            event("prefix hit")
        if self.kv.stats()["evictions"] > evictions:
            event("eviction")
        assert hit % self.block_size == 0 and 0 <= hit <= max(num_tokens - 1, 0)
        if not (self.prefix_caching and with_ids):
            assert hit == 0
        table = self.kv.block_table(seq_id).tolist()
        for position in range(hit):  # a hit serves exactly this prompt's keys, same namespace
            block, offset = divmod(position, self.block_size)
            assert self.content[table[block]][offset] == (prompt[position], extra_key)
        self.hit_tokens_total += hit
        if with_ids:
            self.history.append(list(prompt))
        self.tokens[seq_id] = list(prompt)
        self.namespace[seq_id] = extra_key
        self.abstract[seq_id] = [
            self.abstract_of_physical(table[index]) if index < hit // self.block_size else self.new_abstract()
            for index in range(needed)
        ]
        computed = num_tokens if num_scheduled is None else hit + min(num_scheduled, num_tokens - hit)
        assert self.kv.num_computed_tokens(seq_id) == computed
        if computed < num_tokens:
            event("chunked prefill")
        self.computed[seq_id] = computed
        self.write(seq_id, hit, computed)

    @precondition(lambda self: self.prefilling())
    @rule(data=st.data())
    def advance_computed(self, data: st.DataObject) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.prefilling()), min_size=1, max_size=3, unique=True))
        left = min(len(self.tokens[s]) - self.computed[s] for s in seqs)
        count = data.draw(st.integers(0, left + 1))
        call = lambda: self.kv.advance_computed(seqs, count)  # noqa: E731
        if count > left:
            self.expect_failure(InvalidArgumentError, call)
            return
        call()
        for seq_id in seqs:
            first = self.computed[seq_id]
            self.computed[seq_id] += count
            self.write(seq_id, first, self.computed[seq_id])
            assert self.kv.num_computed_tokens(seq_id) == self.computed[seq_id]

    @precondition(lambda self: self.prefilling())
    @rule(data=st.data())
    def prefilling_sequences_refuse_growth(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.prefilling()))
        self.expect_failure(InvalidArgumentError, lambda: self.kv.append_tokens(seq_id, [1]))
        self.expect_failure(InvalidArgumentError, lambda: self.kv.append_tokens_batch([seq_id]))
        self.expect_failure(InvalidArgumentError, lambda: self.kv.fork(seq_id, UNKNOWN))
        assert not self.kv.can_append(seq_id, 1)

    @precondition(lambda self: self.abstract)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.resident()))
        n = len(self.tokens[seq_id])
        keep = data.draw(st.integers(0, n + 2))
        call = lambda: self.kv.truncate(seq_id, keep)  # noqa: E731
        if keep > n:
            self.expect_failure(InvalidArgumentError, call)
            return
        call()
        event("truncate")
        # The data stay where they are: only the table, the refcounts and the watermark move.
        table = self.abstract[seq_id]
        for block in table[ceil_div(keep, self.block_size) :]:
            self.drop_abstract(block)
        del table[ceil_div(keep, self.block_size) :]
        del self.tokens[seq_id][keep:]
        self.computed[seq_id] = min(self.computed[seq_id], keep)
        assert self.kv.num_computed_tokens(seq_id) == self.computed[seq_id]

    @precondition(lambda self: self.history)
    @rule(data=st.data(), extra_key=st.sampled_from([None, None, "a"]))
    def pin_prefix(self, data: st.DataObject, extra_key: Any) -> None:
        base = data.draw(st.sampled_from(self.history[-6:]))
        prompt = base[: data.draw(st.integers(0, len(base)))]
        pinned = self.kv.pin_prefix(prompt, extra_key=extra_key)
        full = len(prompt) // self.block_size * self.block_size
        assert pinned % self.block_size == 0 and pinned <= full
        assert pinned >= self.kv.match_prefix(prompt, extra_key=extra_key)
        if not self.prefix_caching:
            assert pinned == 0
        if pinned:
            event("pinned")
            self.pins.append((prompt, extra_key, pinned))

    @rule(data=st.data())
    def unpin_prefix(self, data: st.DataObject) -> None:
        if not self.pins or data.draw(st.integers(0, 3)) == 0:
            # Something never pinned (a token outside the vocabulary): refused, no change.
            prompt = [VOCAB] * (self.block_size + 1)
            self.expect_failure(InvalidArgumentError, lambda: self.kv.unpin_prefix(prompt))
            return
        index = data.draw(st.integers(0, len(self.pins) - 1))
        prompt, extra_key, _ = self.pins.pop(index)
        self.kv.unpin_prefix(prompt, extra_key=extra_key)

    @precondition(lambda self: self.ready())
    @rule(data=st.data(), count=st.integers(0, 6), with_ids=st.booleans())
    def append(self, data: st.DataObject, count: int, with_ids: bool) -> None:
        seq_id = data.draw(st.sampled_from(self.ready()))
        new = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=count, max_size=count))
        if with_ids:
            call = lambda: self.kv.append_tokens(seq_id, new)  # noqa: E731
        else:
            call = lambda: self.kv.append_tokens(seq_id, num_tokens=count)  # noqa: E731
        need = self.append_need(seq_id, count)
        free = self.model_free()
        if ceil_div(len(self.tokens[seq_id]) + count, self.block_size) > NUM_BLOCKS:
            self.expect_failure(InvalidArgumentError, call)
            return
        if free is not None:
            assert self.kv.can_append(seq_id, count) == (need <= free)
            if need > free:
                self.expect_failure(OutOfBlocksError, call)
                return
        outcome = self.call_changing_nothing_on(OutOfBlocksError, call)
        if not isinstance(outcome, tuple):
            assert free is None
            return
        first = len(self.tokens[seq_id])
        self.model_append(seq_id, count)
        self.tokens[seq_id].extend(new)
        self.computed[seq_id] = len(self.tokens[seq_id])  # appended tokens are computed
        self.write(seq_id, first)

    @precondition(lambda self: self.ready())
    @rule(data=st.data(), count=st.integers(1, 3))
    def append_batch(self, data: st.DataObject, count: int) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.ready()), min_size=1, max_size=4, unique=True))
        new = data.draw(
            st.lists(st.integers(0, VOCAB - 1), min_size=count * len(seqs), max_size=count * len(seqs))
        )
        call = lambda: self.kv.append_tokens_batch(seqs, new, num_tokens=count)  # noqa: E731
        if any(ceil_div(len(self.tokens[s]) + count, self.block_size) > NUM_BLOCKS for s in seqs):
            self.expect_failure(InvalidArgumentError, call)
            return
        free = self.model_free()
        # Sequences of one batch may share their partial last block: the model applies the
        # appends in order, as the core does, so a later one may no longer need its copy.
        saved = ({s: list(t) for s, t in self.abstract.items()}, dict(self.abstract_refs))
        need = 0
        for seq_id in seqs:
            need += self.append_need(seq_id, count)
            self.model_append(seq_id, count)
        if free is not None and need > free:
            self.abstract, self.abstract_refs = saved
            self.expect_failure(OutOfBlocksError, call)
            return
        outcome = self.call_changing_nothing_on(OutOfBlocksError, call)
        if not isinstance(outcome, tuple):
            assert free is None
            self.abstract, self.abstract_refs = saved
            return
        firsts = {s: len(self.tokens[s]) for s in seqs}
        for index, seq_id in enumerate(seqs):
            self.tokens[seq_id].extend(new[index * count : (index + 1) * count])
            self.computed[seq_id] = len(self.tokens[seq_id])
        self.run_copy_ops()
        for seq_id in seqs:
            self.write(seq_id, firsts[seq_id])

    @precondition(lambda self: self.ready())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.ready()))
        child = next(self.next_id)
        self.kv.fork(parent, child)
        assert self.kv.block_table(child).tolist() == self.kv.block_table(parent).tolist()
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        assert self.kv.num_computed_tokens(child) == self.computed[child]
        self.namespace[child] = self.namespace[parent]
        self.abstract[child] = list(self.abstract[parent])
        for block in self.abstract[child]:
            self.abstract_refs[block] += 1

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        self.kv.free(seq_id)
        self.forget(seq_id)

    def forget(self, seq_id: int) -> None:
        for block in self.abstract.pop(seq_id, []):
            self.drop_abstract(block)
        for block in self.swapped.pop(seq_id, []):
            self.drop_host(block)
        del self.tokens[seq_id]
        del self.computed[seq_id]
        del self.namespace[seq_id]

    @precondition(lambda self: len(self.live()) >= 2)
    @rule(data=st.data())
    def free_batch(self, data: st.DataObject) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=3, unique=True))
        self.kv.free_batch(seqs)
        for seq_id in seqs:
            self.forget(seq_id)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def bad_calls_change_nothing(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        self.expect_failure(pagedkv.SequenceExistsError, lambda: self.kv.add_sequence(seq_id, num_tokens=1))
        if seq_id in self.abstract:
            self.expect_failure(pagedkv.SequenceExistsError, lambda: self.kv.fork(seq_id, seq_id))
        self.expect_failure(UnknownSequenceError, lambda: self.kv.append_tokens(UNKNOWN, [1]))
        self.expect_failure(UnknownSequenceError, lambda: self.kv.free_batch([seq_id, UNKNOWN]))
        self.expect_failure(InvalidArgumentError, lambda: self.kv.append_tokens(seq_id, [1.5]))
        self.expect_failure(InvalidArgumentError, lambda: self.kv.free_batch([seq_id, seq_id]))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()
        assert len(self.kv) == len(self.live())
        stats = self.kv.stats()
        assert stats["prefix_hit_tokens"] == self.hit_tokens_total
        physical_of: dict[int, int] = {}
        for seq_id in self.resident():
            table = self.kv.block_table(seq_id).tolist()
            tokens = self.tokens[seq_id]
            assert self.kv.num_tokens(seq_id) == len(tokens)
            assert self.kv.num_computed_tokens(seq_id) == self.computed[seq_id]
            assert len(table) == ceil_div(len(tokens), self.block_size)
            for abstract, block in zip(self.abstract[seq_id], table, strict=True):
                assert physical_of.setdefault(abstract, block) == block  # same <=> same
            for position, token in enumerate(tokens[: self.computed[seq_id]]):
                block, offset = divmod(position, self.block_size)
                cell = self.content[table[block]][offset]
                assert cell == (token, self.namespace[seq_id]), (seq_id, position)
        assert len(set(physical_of.values())) == len(physical_of)
        # Pins hold references the block model does not name (pin_prefix returns no block ids):
        # with pins the counts are bounds, without them exact.
        for abstract, block in physical_of.items():
            if self.pins:
                assert self.kv.refcount(block) >= self.abstract_refs[abstract]
            else:
                assert self.kv.refcount(block) == self.abstract_refs[abstract]
        if self.pins:
            assert stats["num_blocks_in_use"] >= self.device_in_use()
            assert stats["num_pinned_blocks"] > 0
        else:
            assert stats["num_blocks_in_use"] == self.device_in_use()
            assert stats["num_pinned_blocks"] == 0
        for prompt, extra_key, pinned in self.pins:
            # A pinned prefix is never evicted: it stays a hit.
            assert self.kv.match_prefix(prompt[:pinned] + [0], extra_key=extra_key) >= pinned
        if not self.prefix_caching:
            assert self.kv.num_free_blocks == NUM_BLOCKS - self.device_in_use()
            assert stats["num_cached_blocks"] == 0
        for seq_id, host_table in self.swapped.items():
            assert self.kv.is_swapped_out(seq_id)
            assert self.kv.num_tokens(seq_id) == len(self.tokens[seq_id])
            for position, token in enumerate(self.tokens[seq_id][: self.computed[seq_id]]):
                block, offset = divmod(position, self.block_size)
                host = self.host_physical[host_table[block]]
                assert self.host_content[host][offset] == (token, self.namespace[seq_id])
        if self.host_blocks:
            assert stats["num_host_blocks_in_use"] == len(self.host_refs)
            assert self.kv.num_free_host_blocks == self.host_blocks - len(self.host_refs)
            assert stats["num_swapped_sequences"] == len(self.swapped)

    @invariant()
    def events_predict_every_hit(self) -> None:
        """An index rebuilt from the KV events alone predicts every ``match_prefix``."""
        if not self.kv_events or not hasattr(self, "kv"):
            return
        for ev in self.kv.take_events():
            if isinstance(ev, pagedkv.BlockStored):
                for h in ev.block_hashes:
                    assert h not in self.stored_hashes, "a content stored twice"
                    self.stored_hashes.add(h)
            elif isinstance(ev, pagedkv.BlockRemoved):
                for h in ev.block_hashes:
                    self.stored_hashes.remove(h)
            else:
                assert isinstance(ev, pagedkv.AllBlocksCleared)
                self.stored_hashes.clear()
        prompts = self.history[-6:] + [self.tokens[s] for s in self.resident()]
        for prompt, extra_key in itertools.product(prompts, [None, "a", b"b"]):
            if any(t >= UNKNOWN for t in prompt):
                continue
            hashes = self.kv.prefix_block_hashes(prompt, extra_key=extra_key)
            max_blocks = max(len(prompt) - 1, 0) // self.block_size
            predicted = 0
            while predicted < min(max_blocks, len(hashes)) and hashes[predicted] in self.stored_hashes:
                predicted += 1
            got = self.kv.match_prefix(prompt, extra_key=extra_key)
            assert got == predicted * self.block_size, (prompt, extra_key, got, predicted)


class PrefixCachingMachine(ManagerMachine):
    """Prefix caching on: hits, revivals and evictions; hits must serve the prompt's own keys."""

    prefix_caching = True
    kv_events = True


class SwapMachine(ManagerMachine):
    """A host tier: swap_out / swap_in of single sequences and of (possibly partial) groups;
    a partial group is supported (shared blocks stay on the device for the others)."""

    host_blocks = NUM_HOST_BLOCKS

    @precondition(lambda self: self.abstract)
    @rule(data=st.data(), as_int=st.booleans())
    def swap_out(self, data: st.DataObject, as_int: bool) -> None:
        group = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, max_size=3, unique=True))
        group_blocks = {a for s in group for a in self.abstract[s]}
        outside = {a for s, t in self.abstract.items() if s not in group for a in t}
        partial = bool(group_blocks & outside)
        host_free = self.host_blocks - len(self.host_refs)
        arg: Any = group[0] if as_int and len(group) == 1 else group
        physical = {s: self.kv.block_table(s).tolist() for s in group}
        # Part of a group that shares blocks may be swapped out: the shared blocks keep their
        # device copy for the members left behind (the core supports partial groups).
        if len(group_blocks) > self.host_blocks:  # can never fit the host tier
            self.expect_failure(InvalidArgumentError, lambda: self.kv.swap_out(arg))
            return
        if len(group_blocks) > host_free:
            self.expect_failure(OutOfBlocksError, lambda: self.kv.swap_out(arg))
            return
        outcome = ("ok", self.kv.swap_out(arg))
        event("partial swap_out" if partial else "swap_out")
        ops = outcome[1]
        assert ops.dtype.name == "int32" and ops.shape == (len(group_blocks), 2)
        device_of = {a: physical[s][i] for s in group for i, a in enumerate(self.abstract[s])}
        assert sorted(ops[:, 0].tolist()) == sorted(device_of[a] for a in group_blocks)
        host_of_device = dict(ops.tolist())
        assert len(set(host_of_device.values())) == len(group_blocks)
        for device, host in host_of_device.items():
            # (A block not yet computed, of a prefilling sequence, was never written.)
            self.host_content[host] = list(self.content.get(device, [None] * self.block_size))
        host_abstract = {}
        for a in sorted(group_blocks):
            h = next(self.next_abstract)
            host_abstract[a] = h
            self.host_refs[h] = 0
            self.host_physical[h] = host_of_device[device_of[a]]
        for seq_id in group:
            self.swapped[seq_id] = [host_abstract[a] for a in self.abstract[seq_id]]
            for a in self.abstract.pop(seq_id):
                self.host_refs[host_abstract[a]] += 1
                self.drop_abstract(a)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        group = data.draw(
            st.lists(st.sampled_from(sorted(self.swapped)), min_size=1, max_size=3, unique=True)
        )
        group_blocks = {h for s in group for h in self.swapped[s]}
        outside = {h for s, t in self.swapped.items() if s not in group for h in t}
        partial = bool(group_blocks & outside)
        free = NUM_BLOCKS - self.device_in_use()
        if len(group_blocks) > free:
            self.expect_failure(OutOfBlocksError, lambda: self.kv.swap_in(group))
            return
        outcome = ("ok", self.kv.swap_in(group))
        event("partial swap_in" if partial else "swap_in")
        ops = outcome[1]
        assert ops.dtype.name == "int32" and ops.shape == (len(group_blocks), 2)
        device_of_host = dict(ops.tolist())
        assert sorted(device_of_host) == sorted(self.host_physical[h] for h in group_blocks)
        for host, device in device_of_host.items():
            self.content[device] = list(self.host_content[host])
        device_abstract = {h: next(self.next_abstract) for h in sorted(group_blocks)}
        for a in device_abstract.values():
            self.abstract_refs[a] = 0
        for seq_id in group:
            self.abstract[seq_id] = [device_abstract[h] for h in self.swapped[seq_id]]
            for h in self.swapped.pop(seq_id):
                self.abstract_refs[device_abstract[h]] += 1
                self.drop_host(h)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swapped_sequences_refuse_growth(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        self.expect_failure(SequenceSwappedOutError, lambda: self.kv.append_tokens(seq_id, [1]))
        self.expect_failure(SequenceSwappedOutError, lambda: self.kv.append_tokens_batch([seq_id]))
        self.expect_failure(SequenceSwappedOutError, lambda: self.kv.fork(seq_id, UNKNOWN))
        self.expect_failure(SequenceSwappedOutError, lambda: self.kv.swap_out(seq_id))


TestManagerModel = ManagerMachine.TestCase
TestManagerModel.settings = SETTINGS
TestPrefixCachingModel = PrefixCachingMachine.TestCase
TestPrefixCachingModel.settings = SETTINGS
TestSwapModel = SwapMachine.TestCase
TestSwapModel.settings = SETTINGS
