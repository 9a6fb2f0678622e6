"""The engine's offload tier paths against the baselines they are judged by, in one run.

    python benches/offload_tiers.py [--blocks 64] [--rounds 9] [--redis-url URL]

What an admission pays to bring back a prefix, per tier, through the engine's own code
(``pagedkv.engine``: ``HostCache``, ``StoreLookup``, ``PagedKvStore.write_block``), on
SmolLM2-135M blocks (30 layers x (K, V) x 16 tokens x 3 KV heads x 64 dims x fp32 = 737,280
bytes):

- host cache: ``HostCache.load`` of the load ops (host -> device copies, every layer)
  against one ``np.copyto`` of the same bytes;
- disk store: ``StoreLookup.lookup`` (``OffloadWorker.load`` over a ``DiskStore``, checksum
  and shape checks) then ``PagedKvStore.write_block`` into the device caches, against
  ``open().read()`` of files of the entry files' sizes, keeping every block (as a load does);
- Redis store: the same path over a ``RedisStore`` (a ``redis-server`` started on a free port
  unless ``--redis-url`` names one): bytes/s, and the latency of one-block look-ups (p50, p99).

Every file is in the page cache (written just before). The paths rotate their order from round
to round; ratios are medians of per-round ratios (the machine is shared: read the ratios).
The store-only numbers (``DiskStore.get`` and ``RedisStore.get`` alone) are in
``benches/offload_stores.py``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from offload_stores import _start_redis  # the same throwaway server as the store bench
from pagedkv.engine.host_cache import HostCache
from pagedkv.engine.kv_store import PagedKvStore
from pagedkv.engine.store_lookup import StoreLookup
from pagedkv.offload import DiskStore, OffloadWorker, RedisStore

LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 30, 16, 3, 64
IDENTITY = b"bench"


def _caches(num_blocks: int) -> PagedKvStore:
    config = SimpleNamespace(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM)
    return PagedKvStore(config, num_blocks, BLOCK_SIZE)  # type: ignore[arg-type]


def _lookup(store: DiskStore | RedisStore) -> StoreLookup:
    shape = (LAYERS, 2, BLOCK_SIZE, HEADS, HEAD_DIM)
    return StoreLookup(OffloadWorker(store), IDENTITY, shape, BLOCK_SIZE, deadline_s=60.0)


def _fill(store: DiskStore | RedisStore, n: int, rng: np.random.Generator) -> list[int]:
    hashes = [int(rng.integers(1, 2**62)) for _ in range(n)]
    for h in hashes:
        payload = rng.standard_normal((LAYERS, 2, BLOCK_SIZE, HEADS, HEAD_DIM)).astype(np.float32)
        assert store.put(h, payload, extra_key=IDENTITY)
    return hashes


def _admission(lookup: StoreLookup, caches: PagedKvStore, hashes: list[int]) -> int:
    """A store hit of every block: look-up, then the writes into fresh device blocks."""
    found = lookup.lookup(hashes)
    assert len(found) == len(hashes), "a bench block missed"
    for block, (_, payload) in enumerate(found):
        caches.write_block(block, payload)
    return sum(p.nbytes for _, p in found)


def _plain_kept(paths: list[Path]) -> int:
    kept = []
    for p in paths:
        with open(p, "rb") as f:
            kept.append(f.read())
    return sum(len(b) for b in kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    n, rng = args.blocks, np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        disk = DiskStore(Path(tmp) / "kv", capacity_bytes=4 * n * 737_400)
        disk_hashes = _fill(disk, n, rng)
        paths = sorted((Path(tmp) / "kv").glob("*.blk"))
        plain_dir = Path(tmp) / "plain"
        plain_dir.mkdir()
        plain = []
        for i, p in enumerate(paths):
            q = plain_dir / f"{i}.bin"
            q.write_bytes(rng.bytes(p.stat().st_size))
            plain.append(q)
        url, server = args.redis_url, None
        if url is None:
            started = _start_redis(tmp)
            if started is not None:
                server, url = started
        redis = RedisStore(url, timeout_s=5.0) if url else None
        redis_hashes = _fill(redis, n, rng) if redis is not None else []

        host = HostCache(_caches(n), n)
        for layer in range(LAYERS):
            host.host_k[layer][:] = rng.standard_normal(host.host_k[layer].shape, dtype=np.float32)
            host.host_v[layer][:] = rng.standard_normal(host.host_v[layer].shape, dtype=np.float32)
        loads = np.stack([np.arange(n), np.arange(n)], axis=1).astype(np.int32)
        src = np.stack([np.stack([host.host_k[i], host.host_v[i]]) for i in range(LAYERS)])
        dst = np.empty_like(src)
        device = _caches(n)
        disk_lookup, redis_lookup = _lookup(disk), (_lookup(redis) if redis else None)

        paths_timed = {
            "memcpy": lambda: (np.copyto(dst, src), dst.nbytes)[1],
            "host": lambda: (host.load(loads), src.nbytes)[1],
            "plain": lambda: _plain_kept(plain),
            "disk": lambda: _admission(disk_lookup, device, disk_hashes),
        }
        if redis_lookup is not None:
            paths_timed["redis"] = lambda: _admission(redis_lookup, device, redis_hashes)
        rates: dict[str, list[float]] = {k: [] for k in paths_timed}
        order = list(paths_timed)
        for r in range(args.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                t0 = time.perf_counter()
                nbytes = paths_timed[name]()
                rates[name].append(nbytes / (time.perf_counter() - t0))
        latencies: list[float] = []
        if redis_lookup is not None:
            for h in redis_hashes * 2:
                t0 = time.perf_counter()
                assert len(redis_lookup.lookup([h])) == 1
                latencies.append(time.perf_counter() - t0)
        for lookup in (disk_lookup, redis_lookup):
            if lookup is not None:
                lookup.close()
                lookup.worker.close()
        if server is not None:
            server.kill()
            server.wait()

    def ratio(name: str, base: str) -> float:
        return statistics.median(a / b for a, b in zip(rates[name], rates[base], strict=True))

    def gbs(name: str) -> float:
        return statistics.median(rates[name]) / 1e9

    print(f"{n} blocks of {LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4:,} bytes, {args.rounds} rounds\n")

    def row(label: str, name: str, base: str, unit: str) -> None:
        print(f"| {label} | {gbs(name):.2f} | {100 * ratio(name, base):.0f} % {unit} |")

    print("| path | median GB/s | ratio (median of per-round ratios) |")
    print("|---|---:|---:|")
    row("`np.copyto` of the same bytes", "memcpy", "memcpy", "")
    row("host cache: `HostCache.load`", "host", "memcpy", "of copyto")
    row("`open().read()` of the entry sizes, kept", "plain", "plain", "")
    row("disk store: `lookup` + `write`", "disk", "plain", "of reads")
    if "redis" in rates:
        row("Redis store: `lookup` + `write`", "redis", "plain", "of reads")
        lat = sorted(latencies)
        p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(
            f"\nRedis one-block look-up: p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms ({len(lat)} look-ups)"
        )
    else:
        print("\n(no redis-server: the Redis rows are skipped)")


if __name__ == "__main__":
    main()
