"""Model-based tests (hypothesis.stateful), mirroring the Rust proptest model test.

Random add / append / batch append / fork / free / batch free sequences (with copy-on-write),
then prefix-cache hits and evictions, then swap_out / swap_in, run against two references:

* a block model: every sequence's table as abstract block ids with refcounts, predicting the
  exact number of device blocks in use, which operations fail (and with which error), and the
  sharing structure of the physical tables (same abstract block <=> same physical block);
* a data plane: the content of every physical (and host) block slot, written through the
  manager's slot mapping, with copy-on-write and swap copies executed as the data plane would.
  Every sequence must read back exactly its own tokens; a prefix hit must serve exactly the
  prompt's tokens; no write may land in a block with refcount > 1.

``check_invariants()`` runs after every step, and a failed operation must change nothing.
"""

from __future__ import annotations

import itertools
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv
from pagedkv import InvalidArgumentError, OutOfBlocksError, SequenceSwappedOutError

from conftest import snapshot

NUM_BLOCKS = 24
NUM_HOST_BLOCKS = 12
VOCAB = 3  # a tiny vocabulary makes equal prefixes (prefix-cache hits) frequent

SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ManagerMachine(RuleBasedStateMachine):
    """No prefix caching, no host tier: the block model predicts everything exactly."""

    prefix_caching = False
    host_blocks = 0

    def __init__(self) -> None:
        super().__init__()
        self.kv: pagedkv.KvCacheManager
        self.block_size = 1
        self.next_id = itertools.count(100)
        self.next_abstract = itertools.count()
        self.tokens: dict[int, list[int]] = {}  # seq -> its tokens (data-plane truth)
        self.abstract: dict[int, list[int]] = {}  # seq -> abstract block ids (resident seqs)
        self.abstract_refs: dict[int, int] = {}
        self.swapped: dict[int, list[int]] = {}  # seq -> abstract host block ids
        self.host_refs: dict[int, int] = {}
        self.content: dict[int, list[int | None]] = {}  # physical block -> slot contents
        self.host_content: dict[int, list[int | None]] = {}
        self.hit_tokens_total = 0

    @initialize(block_size=st.sampled_from([1, 2, 3, 4]))
    def setup(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv = pagedkv.KvCacheManager(
            num_blocks=NUM_BLOCKS, block_size=block_size,
            enable_prefix_caching=self.prefix_caching, num_host_blocks=self.host_blocks,
        )

    # ------------------------------------------------------------------ model helpers
    def resident(self) -> list[int]:
        return sorted(self.abstract)

    def live(self) -> list[int]:
        return sorted(set(self.abstract) | set(self.swapped))

    def device_in_use(self) -> int:
        return sum(1 for refs in self.abstract_refs.values() if refs > 0)

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

    def append_need(self, seq_id: int, count: int) -> int:
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

    def write(self, seq_id: int, first: int) -> None:
        """Runs pending copies, then writes the sequence's tokens from position `first` on
        through the manager's slot mapping, checking each written block is unshared."""
        self.run_copy_ops()
        tokens = self.tokens[seq_id]
        count = len(tokens) - first
        if count == 0:
            return
        slots = self.kv.slot_mapping([seq_id], count).tolist()
        for position, slot in zip(range(first, len(tokens)), slots):
            block, offset = divmod(slot, self.block_size)
            assert self.kv.refcount(block) == 1, f"write into shared block {block}"
            cells = self.content.setdefault(block, [None] * self.block_size)
            cells[offset] = tokens[position]

    def run_copy_ops(self) -> None:
        ops = self.kv.take_copy_ops()
        assert ops.shape[1:] == (2,)
        for src, dst in ops.tolist():
            self.content[dst] = list(self.content[src])

    def expect_failure(self, error: type[BaseException], op: Any, seqs: list[int]) -> None:
        before = snapshot(self.kv, seqs + [10**9])
        try:
            op()
        except error:
            pass
        else:
            raise AssertionError(f"expected {error.__name__}")
        assert snapshot(self.kv, seqs + [10**9]) == before

    # ------------------------------------------------------------------ rules
    @rule(num_tokens=st.integers(0, 3 * 4 + 2), with_ids=st.booleans(),
          data=st.data())
    def add(self, num_tokens: int, with_ids: bool, data: st.DataObject) -> None:
        seq_id = next(self.next_id)
        prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=num_tokens,
                                    max_size=num_tokens))
        needed = ceil_div(num_tokens, self.block_size)
        free = self.model_free()
        call = (lambda: self.kv.add_sequence(seq_id, prompt)) if with_ids else (
            lambda: self.kv.add_sequence(seq_id, num_tokens=num_tokens))
        if needed > NUM_BLOCKS:
            self.expect_failure(InvalidArgumentError, call, self.live())
            return
        if free is not None and needed > free:
            self.expect_failure(OutOfBlocksError, call, self.live())
            return
        try:
            hit = call()
        except OutOfBlocksError:
            assert free is None  # only a cache-aware model leaves this unpredicted
            return
        assert hit % self.block_size == 0 and 0 <= hit <= max(num_tokens - 1, 0)
        if not (self.prefix_caching and with_ids):
            assert hit == 0
        table = self.kv.block_table(seq_id).tolist()
        for position in range(hit):  # a hit serves exactly this prompt's keys
            block, offset = divmod(position, self.block_size)
            assert self.content[table[block]][offset] == prompt[position]
        self.hit_tokens_total += hit
        self.tokens[seq_id] = list(prompt)
        # Hit blocks are shared with whoever holds them (or revived): model them by physical id.
        self.abstract[seq_id] = [
            self.abstract_of_physical(table[index]) if index < hit // self.block_size
            else self.new_abstract()
            for index in range(needed)
        ]
        self.write(seq_id, hit)

    def abstract_of_physical(self, block: int) -> int:
        """The abstract id of a resident physical block (a revived cached block gets a new one)."""
        for seq_id, table in self.abstract.items():
            physical = self.kv.block_table(seq_id).tolist()
            if block in physical:
                abstract = table[physical.index(block)]
                self.abstract_refs[abstract] += 1
                return abstract
        return self.new_abstract()

    @precondition(lambda self: self.abstract)
    @rule(data=st.data(), count=st.integers(0, 6), with_ids=st.booleans())
    def append(self, data: st.DataObject, count: int, with_ids: bool) -> None:
        seq_id = data.draw(st.sampled_from(self.resident()))
        new = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=count, max_size=count))
        call = (lambda: self.kv.append_tokens(seq_id, new)) if with_ids else (
            lambda: self.kv.append_tokens(seq_id, num_tokens=count))
        need = self.append_need(seq_id, count)
        free = self.model_free()
        if ceil_div(len(self.tokens[seq_id]) + count, self.block_size) > NUM_BLOCKS:
            self.expect_failure(InvalidArgumentError, call, self.live())
            return
        if free is not None and need > free:
            assert not self.kv.can_append(seq_id, count)
            self.expect_failure(OutOfBlocksError, call, self.live())
            return
        if free is not None:
            assert self.kv.can_append(seq_id, count)
        try:
            call()
        except OutOfBlocksError:
            assert free is None
            return
        first = len(self.tokens[seq_id])
        self.model_append(seq_id, count)
        self.tokens[seq_id].extend(new)
        self.write(seq_id, first)

    @precondition(lambda self: self.abstract)
    @rule(data=st.data(), count=st.integers(1, 3))
    def append_batch(self, data: st.DataObject, count: int) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, max_size=4,
                                  unique=True))
        new = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=count * len(seqs),
                                 max_size=count * len(seqs)))
        call = lambda: self.kv.append_tokens_batch(seqs, new, num_tokens=count)  # noqa: E731
        if any(ceil_div(len(self.tokens[s]) + count, self.block_size) > NUM_BLOCKS for s in seqs):
            self.expect_failure(InvalidArgumentError, call, self.live())
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
            self.expect_failure(OutOfBlocksError, call, self.live())
            return
        try:
            call()
        except OutOfBlocksError:
            assert free is None
            self.abstract, self.abstract_refs = saved
            return
        firsts = {s: len(self.tokens[s]) for s in seqs}
        for index, seq_id in enumerate(seqs):
            self.tokens[seq_id].extend(new[index * count : (index + 1) * count])
        self.run_copy_ops()
        for seq_id in seqs:
            self.write(seq_id, firsts[seq_id])

    @precondition(lambda self: self.abstract)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.resident()))
        child = next(self.next_id)
        self.kv.fork(parent, child)
        assert self.kv.block_table(child).tolist() == self.kv.block_table(parent).tolist()
        self.tokens[child] = list(self.tokens[parent])
        self.abstract[child] = list(self.abstract[parent])
        for block in self.abstract[child]:
            self.abstract_refs[block] += 1

    @precondition(lambda self: self.abstract)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        self.kv.free(seq_id)
        self.forget(seq_id)

    def forget(self, seq_id: int) -> None:
        for block in self.abstract.pop(seq_id, []):
            self.drop_abstract(block)
        for block in self.swapped.pop(seq_id, []):
            self.host_refs[block] -= 1
            if self.host_refs[block] == 0:
                del self.host_refs[block]
        del self.tokens[seq_id]

    @precondition(lambda self: len(self.live()) >= 2)
    @rule(data=st.data())
    def free_batch(self, data: st.DataObject) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=3,
                                  unique=True))
        self.kv.free_batch(seqs)
        for seq_id in seqs:
            self.forget(seq_id)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def bad_calls_change_nothing(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        unknown = 10**9
        self.expect_failure(pagedkv.SequenceExistsError,
                            lambda: self.kv.add_sequence(seq_id, num_tokens=1), self.live())
        self.expect_failure(pagedkv.UnknownSequenceError,
                            lambda: self.kv.append_tokens(unknown, [1]), self.live())
        self.expect_failure(pagedkv.UnknownSequenceError,
                            lambda: self.kv.free_batch([seq_id, unknown]), self.live())
        self.expect_failure(InvalidArgumentError,
                            lambda: self.kv.append_tokens(seq_id, [1.5]), self.live())

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
            assert len(table) == ceil_div(len(tokens), self.block_size)
            for abstract, block in zip(self.abstract[seq_id], table):
                # Same abstract block <=> same physical block.
                assert physical_of.setdefault(abstract, block) == block
            for position, token in enumerate(tokens):
                block, offset = divmod(position, self.block_size)
                assert self.content[table[block]][offset] == token, (seq_id, position)
        assert len(set(physical_of.values())) == len(physical_of)
        for abstract, block in physical_of.items():
            assert self.kv.refcount(block) == self.abstract_refs[abstract]
        assert stats["num_blocks_in_use"] == self.device_in_use()
        if not self.prefix_caching:
            assert self.kv.num_free_blocks == NUM_BLOCKS - self.device_in_use()
            assert stats["num_cached_blocks"] == 0


TestManagerModel = ManagerMachine.TestCase
TestManagerModel.settings = SETTINGS
