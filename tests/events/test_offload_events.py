"""KV events of the host offload tier on the wire: vLLM's ``medium`` field says the tier
(``"CPU"`` for the offload tier, ``"GPU"`` for the device index), decoded with vLLM's own
struct definitions, and the direct encoder equals encoding the event objects."""

from __future__ import annotations

import random

import pagedkv
import pytest
from pagedkv.events import encode_batch

msgspec = pytest.importorskip("msgspec")
from vllm_kv_events_schema import DECODER, Removed, Stored  # noqa: E402


def _drive(drain) -> None:
    rng = random.Random(5)
    kv = pagedkv.KvCacheManager(
        num_blocks=8, block_size=4, enable_prefix_caching=True, enable_kv_events=True, num_host_cache_blocks=3
    )
    prefixes = [[rng.randrange(50_000) for _ in range(8)] for _ in range(4)]
    for seq in range(30):
        kv.add_sequence(seq, rng.choice(prefixes) + [rng.randrange(50_000)])
        kv.take_offload_ops()
        kv.take_load_ops()
        kv.free(seq)
        if seq % 10 == 9:
            drain(kv)
    kv.check_invariants()


def test_offload_tier_events_carry_medium_cpu_on_the_wire() -> None:
    encoded: list[tuple[int, bytes]] = []
    direct: list[tuple[int, bytes]] = []
    _drive(lambda kv: encoded.append((len(events := kv.take_events()), encode_batch(events, ts=1.5))))
    _drive(lambda kv: direct.append(kv.take_event_batch(1.5)))
    assert direct == encoded
    decoded = [e for _, payload in direct for e in DECODER.decode(payload).events]
    kinds = {(type(e).__name__, e.medium) for e in decoded if isinstance(e, (Stored, Removed))}
    assert kinds == {("Stored", "GPU"), ("Removed", "GPU"), ("Stored", "CPU"), ("Removed", "CPU")}
