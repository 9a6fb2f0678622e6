"""``PendingSends``, the prefill side's lease table, on an injected clock: every request offered
is freed exactly once, through the door that applies (done, expiry, abort, shutdown); a
renewal never shortens a lease; late and repeated notifications change nothing. A Hypothesis
state machine checks it against a plain model after every step."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from pagedkv.errors import InvalidArgumentError
from pagedkv.transfer import PendingSends


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(lease_s: float = 10.0):
    clock, freed = Clock(), []
    return PendingSends(freed.append, lease_s=lease_s, clock=clock), clock, freed


def test_done_expiry_abort_and_shutdown_each_free_once():
    pending, clock, freed = table()
    for r in "abcd":
        pending.add(r)
    assert pending.complete("a") and freed == ["a"]
    assert not pending.complete("a") and pending.late_notifications == 1  # repeated: nothing
    clock.now += 9.9
    assert pending.expire() == [] and len(pending) == 3
    clock.now += 0.1
    assert pending.expire() == ["b", "c", "d"] and freed == ["a", "b", "c", "d"]
    pending.add("e")
    assert pending.abort("e") and not pending.abort("e")
    pending.add("f")
    assert pending.release_all() == ["f"] and freed == ["a", "b", "c", "d", "e", "f"]
    assert (pending.completed, pending.expired, pending.aborted) == (1, 3, 2)


def test_renew_extends_never_shortens_and_late_renewals_are_counted():
    pending, clock, freed = table(lease_s=10.0)
    pending.add("a")
    clock.now += 8
    assert pending.renew("a") and pending.deadline("a") == 118.0
    pending.add("b")  # deadline 118
    clock.now -= 5  # a renewal computed earlier than the deadline (clock skew in a test)
    assert pending.renew("b") and pending.deadline("b") == 118.0
    assert not pending.renew("zz") and pending.late_notifications == 1
    clock.now = 118.0
    assert pending.expire() == ["a", "b"]


def test_refusals_change_nothing():
    pending, _, freed = table()
    pending.add("a")
    with pytest.raises(InvalidArgumentError, match="already pending"):
        pending.add("a")
    for bad in ("", 3, None):
        with pytest.raises(InvalidArgumentError):
            pending.add(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="not pending"):
        pending.deadline("b")
    for lease in (0, -1, float("inf"), True, "3"):
        with pytest.raises(InvalidArgumentError):
            PendingSends(freed.append, lease_s=lease)  # type: ignore[arg-type]
    assert len(pending) == 1 and freed == []


def test_a_failing_free_callback_never_frees_twice():
    clock, calls = Clock(), []

    def free(request_id: str) -> None:
        calls.append(request_id)
        if request_id == "b":
            raise OSError("the engine's free failed")

    pending = PendingSends(free, lease_s=1.0, clock=clock)
    for r in "abc":
        pending.add(r)
    clock.now += 1
    with pytest.raises(OSError):
        pending.expire()
    assert calls == ["a", "b"] and "b" not in pending and "c" in pending
    assert pending.expire() == ["c"] and calls == ["a", "b", "c"]


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.freed: list[str] = []
        self.pending = PendingSends(self.freed.append, lease_s=5.0, clock=self.clock)
        self.model: dict[str, float] = {}  # request -> deadline
        self.offered: set[str] = set()

    ids = st.sampled_from([f"r{i}" for i in range(6)])

    @rule(r=ids)
    def add(self, r):
        if r in self.model:
            with pytest.raises(InvalidArgumentError):
                self.pending.add(r)
        elif r not in self.offered:  # request ids are unique per prefill instance
            self.pending.add(r)
            self.model[r] = self.clock.now + 5.0
            self.offered.add(r)

    @rule(r=ids, kind=st.sampled_from(["complete", "abort", "renew"]))
    def notify(self, r, kind):
        result = getattr(self.pending, kind)(r)
        assert result == (r in self.model)
        if r in self.model:
            if kind == "renew":
                self.model[r] = max(self.model[r], self.clock.now + 5.0)
            else:
                del self.model[r]

    @rule(dt=st.floats(0, 4))
    def tick(self, dt):
        self.clock.now += dt

    @rule()
    def expire(self):
        due = sorted(r for r, d in self.model.items() if d <= self.clock.now)
        assert sorted(self.pending.expire()) == due
        for r in due:
            del self.model[r]

    @invariant()
    def matches_the_model(self):
        assert {r: self.pending.deadline(r) for r in self.model} == self.model
        assert len(self.pending) == len(self.model)
        assert len(self.freed) == len(set(self.freed))  # never freed twice
        assert set(self.freed) | set(self.model) == self.offered
        assert not set(self.freed) & set(self.model)


TestLeaseMachine = LeaseMachine.TestCase
