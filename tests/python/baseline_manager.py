"""The textbook paged KV-cache block manager in plain Python: the in-run benchmark baseline.

A test and benchmark helper, not part of the installed package: the Python benchmarks
(``benches/python``) measure ``pagedkv.KvCacheManager`` against it in the same run, and
``tests/python/test_baseline.py`` proves that it keeps the same rules, so the ratios compare like
with like.

A free list (a Python list used as a stack), a refcount list, and a dict of block tables, as a
course or a first serving engine would write it; optionally a dict-of-hashes prefix cache with
an LRU of cached-evictable blocks. It follows the same rules as ``pagedkv.KvCacheManager``
(copy-on-write of a shared partial last block, all-or-nothing failures, the longest cached
chain of full blocks reused but never the whole prompt, tail blocks evicted before head blocks,
one indexed block per content: a block recomputing content a block in use holds stays private,
one recomputing a cached block's content replaces it and the cached one is freed), so the two
report the same block counts for the same operations; it is correct, only slow.

Block hashes here are Python's ``hash`` of ``(parent_hash, block_token_ids, extra_key)``: 64-bit,
unkeyed and without a token comparison on a hit, as the textbook version has it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pagedkv.errors import (
    InvalidArgumentError,
    InvariantViolation,
    OutOfBlocksError,
    SequenceExistsError,
    UnknownSequenceError,
)

__all__ = ["BaselineBlockManager"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BaselineBlockManager:
    """Plain-Python paged block manager (free list + dict of tables [+ dict-of-hashes cache])."""

    def __init__(
        self, num_blocks: int = 1024, block_size: int = 16, enable_prefix_caching: bool = False
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise InvalidArgumentError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Popping from the end hands out the lowest ids first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcounts: list[int] = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}
        self._copy_ops: list[tuple[int, int]] = []
        # Prefix cache: per sequence its token ids (None once an id-less append made it
        # unhashable), its chain of full-block hashes, and its extra key.
        self._tokens: dict[int, list[int] | None] = {}
        self._hashes: dict[int, list[int]] = {}
        self._extra_keys: dict[int, object] = {}
        # block hash -> the one block holding that content
        self._index: dict[int, int] = {}
        self._hash_of_block: dict[int, int] = {}  # block id -> block hash (indexed blocks)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, LRU first
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.evictions = 0

    # ----------------------------------------------------------------- block transitions
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def _allocate(self, count: int) -> list[int]:
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._index[self._hash_of_block.pop(block)]
                self.evictions += 1
            self._refcounts[block] = 1
            blocks.append(block)
        return blocks

    def _release(self, block: int) -> None:
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            if block in self._hash_of_block:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _register_full_blocks(self, seq_id: int, first_block: int) -> None:
        """Indexes the sequence's full blocks from ``first_block`` on (chained hashes)."""
        tokens = self._tokens.get(seq_id)
        if tokens is None:
            return
        hashes = self._hashes[seq_id]
        table = self._tables[seq_id]
        size = self.block_size
        extra_key = self._extra_keys[seq_id]
        for i in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(tokens[i * size : (i + 1) * size]), extra_key)))
        for i in range(first_block, len(hashes)):
            block = table[i]
            if block in self._hash_of_block:
                continue
            holder = self._index.get(hashes[i])
            if holder is not None and self._refcounts[holder] > 0:
                continue  # the copy in use keeps the content; this one stays private
            if holder is not None:  # a cached copy: this one takes its place, it is freed
                del self._evictable[holder], self._hash_of_block[holder]
                self._free.append(holder)
            self._index[hashes[i]] = block
            self._hash_of_block[block] = hashes[i]

    def _table(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id}") from None

    # ----------------------------------------------------------------- public operations
    def add_sequence(
        self,
        seq_id: int,
        token_ids: Sequence[int] | None = None,
        *,
        num_tokens: int | None = None,
        extra_key: object = None,
    ) -> int:
        if seq_id in self._tables:
            raise SequenceExistsError(f"sequence {seq_id} exists")
        count = len(token_ids) if token_ids is not None else (num_tokens or 0)
        needed = _ceil_div(count, self.block_size)
        if needed > self.num_blocks:
            raise InvalidArgumentError(f"{count} tokens can never fit {self.num_blocks} blocks")
        hits: list[int] = []
        hashes: list[int] = []
        caching = self.enable_prefix_caching and token_ids is not None
        if caching:
            assert token_ids is not None
            size = self.block_size
            parent = None
            for i in range(count // size):
                parent = hash((parent, tuple(token_ids[i * size : (i + 1) * size]), extra_key))
                hashes.append(parent)
            for i in range(max(count - 1, 0) // size):
                block = self._index.get(hashes[i])
                if block is None:
                    break
                hits.append(block)
        revived = sum(1 for block in hits if self._refcounts[block] == 0)
        fresh = needed - len(hits)
        if fresh > self.num_free_blocks - revived:
            raise OutOfBlocksError(f"device: need {fresh} blocks, {self.num_free_blocks - revived} available")
        for block in hits:
            if self._refcounts[block] == 0:
                del self._evictable[block]
            self._refcounts[block] += 1
        self._tables[seq_id] = hits + self._allocate(fresh)
        self._num_tokens[seq_id] = count
        if self.enable_prefix_caching:
            self._tokens[seq_id] = list(token_ids) if token_ids is not None else None
            self._hashes[seq_id] = hashes if token_ids is not None else []
            self._extra_keys[seq_id] = extra_key
            if caching:
                self.prefix_query_tokens += count
                self.prefix_hit_tokens += len(hits) * self.block_size
                self._register_full_blocks(seq_id, len(hits))
        return len(hits) * self.block_size

    def _append_need(self, seq_id: int, count: int) -> int:
        table = self._table(seq_id)
        current = self._num_tokens[seq_id]
        total_blocks = _ceil_div(current + count, self.block_size)
        if total_blocks > self.num_blocks:
            raise InvalidArgumentError(f"sequence {seq_id} can never fit {self.num_blocks} blocks")
        copy = count > 0 and current % self.block_size != 0 and self._refcounts[table[-1]] > 1
        return total_blocks - len(table) + (1 if copy else 0)

    def _append_unchecked(self, seq_id: int, token_ids: Sequence[int] | None, count: int) -> None:
        table = self._tables[seq_id]
        current = self._num_tokens[seq_id]
        if count > 0 and current % self.block_size != 0 and self._refcounts[table[-1]] > 1:
            source = table[-1]
            (table[-1],) = self._allocate(1)
            self._copy_ops.append((source, table[-1]))
            self._release(source)
        table.extend(self._allocate(_ceil_div(current + count, self.block_size) - len(table)))
        self._num_tokens[seq_id] = current + count
        if self.enable_prefix_caching:
            tokens = self._tokens[seq_id]
            if tokens is not None and token_ids is not None:
                tokens.extend(token_ids)
                self._register_full_blocks(seq_id, current // self.block_size)
            else:
                self._tokens[seq_id] = None

    def append_tokens(
        self, seq_id: int, token_ids: Sequence[int] | None = None, *, num_tokens: int | None = None
    ) -> None:
        count = len(token_ids) if token_ids is not None else (1 if num_tokens is None else num_tokens)
        need = self._append_need(seq_id, count)
        if need > self.num_free_blocks:
            raise OutOfBlocksError(f"device: need {need} blocks, {self.num_free_blocks} available")
        self._append_unchecked(seq_id, token_ids, count)

    def append_tokens_batch(self, seq_ids: Iterable[int], *, num_tokens: int = 1) -> None:
        seq_ids = list(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgumentError("duplicate sequence ids in one batch")
        need = sum(self._append_need(seq_id, num_tokens) for seq_id in seq_ids)
        if need > self.num_free_blocks:
            raise OutOfBlocksError(f"device: need {need} blocks, {self.num_free_blocks} available")
        for seq_id in seq_ids:
            self._append_unchecked(seq_id, None, num_tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        table = self._table(parent_id)
        if child_id in self._tables:
            raise SequenceExistsError(f"sequence {child_id} exists")
        for block in table:
            self._refcounts[block] += 1
        self._tables[child_id] = list(table)
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        if self.enable_prefix_caching:
            tokens = self._tokens[parent_id]
            self._tokens[child_id] = list(tokens) if tokens is not None else None
            self._hashes[child_id] = list(self._hashes[parent_id])
            self._extra_keys[child_id] = self._extra_keys[parent_id]

    def free(self, seq_id: int) -> None:
        table = self._table(seq_id)
        # Tail first: the tail's cached blocks become the least recently used.
        for block in reversed(table):
            self._release(block)
        del self._tables[seq_id]
        del self._num_tokens[seq_id]
        if self.enable_prefix_caching:
            del self._tokens[seq_id], self._hashes[seq_id], self._extra_keys[seq_id]

    def free_batch(self, seq_ids: Iterable[int]) -> None:
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self._table(seq_id)
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgumentError("duplicate sequence ids in one batch")
        for seq_id in seq_ids:
            self.free(seq_id)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._table(seq_id))

    def num_tokens(self, seq_id: int) -> int:
        self._table(seq_id)
        return self._num_tokens[seq_id]

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def take_copy_ops(self) -> list[tuple[int, int]]:
        ops, self._copy_ops = self._copy_ops, []
        return ops

    def check_invariants(self) -> None:
        counts = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            if len(table) != _ceil_div(self._num_tokens[seq_id], self.block_size):
                raise InvariantViolation(f"sequence {seq_id}: table length mismatch")
            for block in table:
                counts[block] += 1
        if counts != self._refcounts:
            raise InvariantViolation("refcounts disagree with the block tables")
        free = set(self._free)
        if len(free) != len(self._free):
            raise InvariantViolation("a block is on the free list twice")
        cached = set(self._evictable)
        if free & cached or any(counts[b] for b in free | cached):
            raise InvariantViolation("a free or cached block is in use")
        in_use = sum(1 for c in counts if c > 0)
        if in_use + len(free) + len(cached) != self.num_blocks:
            raise InvariantViolation("in_use + cached + free != num_blocks")
        indexed = list(self._index.values())
        if sorted(self._hash_of_block) != sorted(indexed) or not cached <= set(self._hash_of_block):
            raise InvariantViolation("prefix index and cached blocks disagree")
