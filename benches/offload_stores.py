"""Offload store loads against the baseline they are judged by, in one run.

    python benches/offload_stores.py [--blocks 64] [--rounds 7] [--redis-url URL]

Blocks are realistic SmolLM2-135M KV blocks: 30 layers x (K, V) x 16 tokens x 3 KV heads x 64
dims x fp32 = 737,280 bytes. Each round times, back to back:

- ``open().read()``: reading plain files of the same sizes as the store's entry files (the
  target: the DiskStore loads at >= 50 % of this);
- ``DiskStore.get``: bytes payloads and NumPy-array payloads (open, read the head, read the
  payload into its own ``bytes``, check length, XXH3 checksum and key, hand the payload out
  without a copy: an array is a read-only view of those bytes);
- ``OffloadWorker.load`` over the DiskStore (the same gets on the worker thread, one call for
  all blocks, which it holds until it returns them), against ``open().read()`` of every file
  keeping every result: holding 47 MB of blocks makes each read land in fresh memory and pay
  its page faults, which the drop-each-block loops above do not;
- ``RedisStore.get`` against a ``redis-server`` (one started on a free port, no persistence,
  unless ``--redis-url`` names one): bytes/s and per-get latency percentiles.

All files are in the page cache (written just before): this measures the store's own cost
over the file system's, not the disk. Prints a Markdown table; ratios are medians of the
per-round ratios (the machine is shared: read the ratios).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_ports import free_port
from pagedkv.offload import DiskStore, OffloadWorker, RedisStore

BLOCK_SHAPE = (30, 2, 16, 3, 64)


def _start_redis(workdir: str) -> tuple[subprocess.Popen[bytes], str] | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(500):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.02)
    proc.kill()
    return None


def _plain_read(paths: list[Path]) -> tuple[float, int]:
    t0 = time.perf_counter()
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            total += len(f.read())
    return time.perf_counter() - t0, total


def _plain_read_kept(paths: list[Path]) -> tuple[float, int]:
    # Keeps every block until the end, as a load does (the blocks wait to be copied to the
    # device): each read then lands in fresh memory and pays its page faults.
    t0 = time.perf_counter()
    kept = []
    for path in paths:
        with open(path, "rb") as f:
            kept.append(f.read())
    dt = time.perf_counter() - t0
    return dt, sum(len(b) for b in kept)


def _store_read(store: DiskStore | RedisStore, keys: list[int]) -> tuple[float, int, list[float]]:
    lat: list[float] = []
    total = 0
    t0 = time.perf_counter()
    for key in keys:
        s = time.perf_counter()
        payload = store.get(key)
        lat.append(time.perf_counter() - s)
        assert payload is not None, key
        total += payload.nbytes if isinstance(payload, np.ndarray) else len(payload)
    return time.perf_counter() - t0, total, lat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal(BLOCK_SHAPE).astype(np.float32) for _ in range(args.blocks)]
    block_bytes = blocks[0].nbytes
    tmp = tempfile.mkdtemp(prefix="offload-bench-")
    redis_proc = None
    try:
        store = DiskStore(Path(tmp) / "store", capacity_bytes=4 * args.blocks * block_bytes)
        arrays = list(range(args.blocks))
        raw = list(range(args.blocks, 2 * args.blocks))
        for i, block in enumerate(blocks):
            assert store.put(arrays[i], block)
            assert store.put(raw[i], block.tobytes())
        entry_sizes = sorted(p.stat().st_size for p in store.path.glob("*.blk"))[: args.blocks]
        plain_dir = Path(tmp) / "plain"
        plain_dir.mkdir()
        plain = []
        for i, size in enumerate(entry_sizes):
            path = plain_dir / f"{i}.bin"
            path.write_bytes(os.urandom(size))
            plain.append(path)
        worker = OffloadWorker(store)

        redis_store = None
        url = args.redis_url
        if url is None:
            started = _start_redis(tmp)
            if started is not None:
                redis_proc, url = started
        if url is not None:
            redis_store = RedisStore(url, namespace="bench", timeout_s=5.0)
            for i, block in enumerate(blocks):
                assert redis_store.put(i, block)

        rows: dict[str, list[float]] = {
            k: [] for k in ("plain", "disk_bytes", "disk_array", "plain_kept", "worker", "redis")
        }
        redis_lat: list[float] = []
        disk_lat: list[float] = []

        def time_plain() -> None:
            dt, n = _plain_read(plain)
            rows["plain"].append(n / dt)

        def time_disk_bytes() -> None:
            dt, n, _ = _store_read(store, raw)
            rows["disk_bytes"].append(n / dt)

        def time_disk_array() -> None:
            dt, n, lat = _store_read(store, arrays)
            rows["disk_array"].append(n / dt)
            disk_lat.extend(lat)

        timed = [time_plain, time_disk_bytes, time_disk_array]
        for round_index in range(args.rounds):
            # Rotate the order each round: whichever runs first after the kept reads below
            # inherits their memory state, and the order must not favour one path.
            for k in range(len(timed)):
                timed[(round_index + k) % len(timed)]()
            dt, n = _plain_read_kept(plain)
            rows["plain_kept"].append(n / dt)
            t0 = time.perf_counter()
            got = worker.load(arrays, deadline_s=60.0)
            dt = time.perf_counter() - t0
            assert len(got) == args.blocks
            rows["worker"].append(sum(a.nbytes for a in got.values()) / dt)
            del got
            if redis_store is not None:
                dt, n, lat = _store_read(redis_store, list(range(args.blocks)))
                rows["redis"].append(n / dt)
                redis_lat += lat
        worker.close()

        def med(xs: list[float]) -> float:
            return statistics.median(xs) if xs else float("nan")

        def ratio(name: str, base: str = "plain") -> float:
            return med([a / b for a, b in zip(rows[name], rows[base], strict=True)])

        def pct(lat: list[float], q: float) -> float:
            return float(np.percentile(np.array(lat) * 1e6, q)) if lat else float("nan")

        print(
            f"blocks: {args.blocks} x {block_bytes:,} B payload "
            f"(entry file {entry_sizes[0]:,} B), rounds: {args.rounds}, "
            f"redis: {url or 'absent'}\n"
        )
        print(
            "| path | median GB/s | vs open().read() (median of per-round ratios) "
            "| vs open().read() keeping all blocks |"
        )
        print("|---|---:|---:|---:|")
        labels = {
            "plain": "open().read() of files of the entry sizes",
            "disk_bytes": "DiskStore.get, bytes payload",
            "disk_array": "DiskStore.get, NumPy array payload",
            "plain_kept": "open().read() keeping all blocks (as a load does)",
            "worker": "OffloadWorker.load over the DiskStore (one call, all blocks kept)",
            "redis": "RedisStore.get, NumPy array payload",
        }
        for name, label in labels.items():
            if rows[name]:
                kept = f"{ratio(name, 'plain_kept') * 100:.0f} %" if name == "worker" else ""
                print(f"| {label} | {med(rows[name]) / 1e9:.2f} | {ratio(name) * 100:.0f} % | {kept} |")
        print("\n| per-get latency (µs) | p50 | p99 |\n|---|---:|---:|")
        print(f"| DiskStore.get (array) | {pct(disk_lat, 50):.0f} | {pct(disk_lat, 99):.0f} |")
        if redis_lat:
            print(f"| RedisStore.get (array) | {pct(redis_lat, 50):.0f} | {pct(redis_lat, 99):.0f} |")
    finally:
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
