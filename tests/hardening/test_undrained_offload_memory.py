"""Memory stays bounded when the offload tier's op queues are never drained.

10^6 admit + free cycles on 8 device blocks over a 16-block offload tier, half of them new
prompts (their blocks are offloaded when evicted) and half two prompts the tier serves (loads),
``take_offload_ops`` / ``take_load_ops`` never called: ~5 ops a cycle, which before dead-op
elimination stayed queued (+39 MiB of address space and resident memory for this run). The
child runs under an address-space limit 16 MiB above its size after a warm-up, so a queue that
grew would fail an allocation and kill it, and it reports its resident peak's growth. mimalloc
(the extension's allocator) reserves a 1 GiB arena up front by default, inside which growth does
not move the address-space size, so the child runs with ``MIMALLOC_ARENA_RESERVE=0``. (The Rust
side's length bound is `rust/pagedkv/tests/offload.rs::undrained_offload_and_load_queues_stay_bounded`.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import resource

    import numpy  # noqa: F401 - mapped before the limit (the bindings import it lazily)
    import pagedkv

    kv = pagedkv.KvCacheManager(
        num_blocks=8, block_size=1, enable_prefix_caching=True, num_offload_blocks=16
    )
    hot = [list(range(10**8 + 100 * p, 10**8 + 100 * p + 5)) for p in range(2)]

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))

    def cycles(start, stop):
        for i in range(start, stop):
            prompt = hot[(i // 2) % 2] if i % 2 else list(range(100 * i, 100 * i + 5))
            kv.add_sequence(i, prompt)
            kv.free(i)

    cycles(0, 20_000)  # warm up: every allocator cache and queue at its working size
    kv.take_copy_ops()  # the bindings' NumPy API, loaded before the limit
    limit = status("VmSize") + (16 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resident = status("VmHWM")
    cycles(20_000, 1_000_000)
    grown = status("VmHWM") - resident
    stats = kv.stats()
    offloads, loads = len(kv.take_offload_ops()), len(kv.take_load_ops())
    kv.check_invariants()
    counts = (stats["blocks_offloaded"], stats["blocks_loaded"], stats["offload_ops_elided"])
    print(*counts, offloads, loads, grown)
    """
)


def test_undrained_offload_and_load_ops_stay_bounded_under_a_memory_limit() -> None:
    env = {**os.environ, "MIMALLOC_ARENA_RESERVE": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert proc.returncode == 0, f"child died (status {proc.returncode}): {proc.stderr[-2000:]}"
    offloaded, loaded, elided, pending_offloads, pending_loads, grown = map(int, proc.stdout.split())
    assert offloaded > 2_000_000 and loaded > 1_000_000  # both queues were exercised
    assert elided > 3_000_000
    assert pending_offloads < 2 * 16 + 64 and pending_loads < 2 * 8 + 64
    assert grown < 8 << 20, f"resident peak grew by {grown >> 20} MiB"
