"""ResidualSlots: which residual slot each sequence of an ``int4`` engine holds.

An int4 cache keeps every sequence's open last block in an int8 residual slot
(docs/quantized_kv.md, "The residual in a paged cache"). The scheduler hands the slots out as it
hands out blocks: one on admission, the parent's copied into a fresh one on fork, one released
when a sequence finishes or is preempted by recompute, moved to a host slot and back with a swap.
Slot ``s`` is residual index ``s * num_groups + g`` of KV group ``g`` in every K/V tensor
(``kv_store.py``).

A request of ``n`` samples is admitted only with ``n`` free slots: its first sample takes one and
reserves ``n - 1`` for the samples it forks into after its prefill, so that a fork never waits
for a slot (the engine forks between steps, where nothing can wait).
"""

from __future__ import annotations

from pagedkv.errors import InvariantViolation

__all__ = ["ResidualSlots"]


class ResidualSlots:
    """``num_slots`` slots. Invariant: every slot is free, held by exactly one sequence, or
    reserved by exactly one sequence (``check``)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._held: dict[int, int] = {}
        self._reserved: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_take(self, count: int) -> bool:
        return count <= len(self._free)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._held

    def take(self, seq_id: int, reserve: int = 0) -> int:
        """A slot for ``seq_id`` and ``reserve`` more held for its forks; the caller checked
        ``can_take(1 + reserve)``."""
        if seq_id in self._held or not self.can_take(1 + reserve):
            raise InvariantViolation(
                f"residual slot for sequence {seq_id}: held already, or none free: a pagedkv bug"
            )
        self._held[seq_id] = self._free.pop()
        if reserve:
            self._reserved[seq_id] = [self._free.pop() for _ in range(reserve)]
        return self._held[seq_id]

    def slot(self, seq_id: int) -> int:
        return self._held[seq_id]

    def reserved(self, seq_id: int) -> int:
        return len(self._reserved.get(seq_id, ()))

    def fork(self, parent_id: int, child_id: int) -> tuple[int, int]:
        """The child takes one of the parent's reserved slots: (parent's slot, child's slot)."""
        spare = self._reserved.get(parent_id)
        if not spare or child_id in self._held:
            raise InvariantViolation(
                f"fork of sequence {parent_id}: no reserved residual slot for {child_id}: a pagedkv bug"
            )
        self._held[child_id] = spare.pop()
        if not spare:
            del self._reserved[parent_id]
        return self._held[parent_id], self._held[child_id]

    def release(self, seq_id: int) -> None:
        """Frees ``seq_id``'s slot and its reservations (nothing if it holds none)."""
        slot = self._held.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
        self._free.extend(self._reserved.pop(seq_id, ()))

    def check(self) -> None:
        """Every slot free, held or reserved exactly once (InvariantViolation otherwise)."""
        every = [*self._free, *self._held.values(), *(s for r in self._reserved.values() for s in r)]
        if sorted(every) != list(range(self.num_slots)):
            raise InvariantViolation(
                f"residual slots: {sorted(every)} is not each of 0..{self.num_slots - 1} once"
            )
