"""The prefill engine's listener port: one it picks itself is picked again while NIXL's listener
fails to bind it (the kernel may give a just-freed port to an outgoing connection first); one
the caller named is tried once; other failures are never retried."""

from __future__ import annotations

import numpy as np
import pytest
from pagedkv.disagg import prefill_engine
from pagedkv.errors import TransferError
from pagedkv.transfer import KvRegions


class FlakySource:
    """Stands in for ``TransferSource``: refuses the first ``failures`` ports it is given."""

    def __init__(
        self, failures: int, message: str = "creating NIXL agent 'p' listening on port {port}: bind"
    ):
        self.failures = failures
        self.message = message
        self.ports: list[int] = []

    def __call__(self, regions, *, engine_id, free_request, host, port, lease_s):
        self.ports.append(port)
        if len(self.ports) <= self.failures:
            raise TransferError(self.message.format(port=port))
        return ("source", engine_id, port)


@pytest.fixture
def regions() -> KvRegions:
    caches = [np.zeros((4, 16, 1, 8), np.float32) for _ in range(2)]
    return KvRegions(caches, block_size=16)


def test_a_picked_port_that_fails_to_bind_is_picked_again(monkeypatch, regions):
    flaky = FlakySource(failures=2)
    monkeypatch.setattr(prefill_engine, "TransferSource", flaky)
    source = prefill_engine._open_source(regions, lambda r: None, "127.0.0.1", 0, 30.0)
    assert len(flaky.ports) == 3 and source == (
        "source",
        f"prefill@127.0.0.1:{flaky.ports[-1]}",
        flaky.ports[-1],
    )


def test_picking_gives_up_after_its_tries(monkeypatch, regions):
    flaky = FlakySource(failures=prefill_engine._PICKED_PORT_TRIES)
    monkeypatch.setattr(prefill_engine, "TransferSource", flaky)
    with pytest.raises(TransferError, match="listening on port"):
        prefill_engine._open_source(regions, lambda r: None, "127.0.0.1", 0, 30.0)
    assert len(flaky.ports) == prefill_engine._PICKED_PORT_TRIES


def test_a_named_port_and_other_failures_are_tried_once(monkeypatch, regions):
    named = FlakySource(failures=1)
    monkeypatch.setattr(prefill_engine, "TransferSource", named)
    with pytest.raises(TransferError):
        prefill_engine._open_source(regions, lambda r: None, "127.0.0.1", 41234, 30.0)
    assert named.ports == [41234]
    other = FlakySource(failures=1, message="registering the caches with NIXL: out of memory")
    monkeypatch.setattr(prefill_engine, "TransferSource", other)
    with pytest.raises(TransferError, match="registering"):
        prefill_engine._open_source(regions, lambda r: None, "127.0.0.1", 0, 30.0)
    assert len(other.ports) == 1
