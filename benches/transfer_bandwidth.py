"""KV block transfer throughput against the transport's own large-buffer throughput, one run.

Two processes on this machine (multiprocessing spawn): a prefill process holds SmolLM2-135M's
K/V caches (30 layers, K and V: 60 regions ``[pool_blocks, 16, 3, 64]`` fp32, 12 KiB a block
row, 720 KiB a block) behind ``pagedkv.transfer.TransferSource``s; this process reads a
request's blocks through ``TransferSink``s. Per repetition, interleaved so load drifts hit all
alike:

- ``large buffer``: one NIXL READ of one registered buffer of the request's byte count, raw
  NIXL agents on the same UCX backend (the transport's own throughput: the baseline);
- ``rows, fresh pool``: the request's block ids as a fresh KvCacheManager hands them out (one
  run of consecutive ids on both sides, which NIXL merges into one read per region);
- ``rows, served pool``: ids as KvCacheManagers hand them out after ``--churn`` steps of
  sequences arriving and finishing (a serving engine's pool: nearly every row its own read);
- ``staged, served pool``: the same ids, the prefill side packing the blocks block-major into
  its staging arena at ``offer`` and the decode side reading them into its own, checking them
  there and copying them into its caches (``staging_bytes=``);
- ``rows, block-major layout`` (what if): one region ``[pool_blocks, 720 KiB]`` (all 60 rows of
  a block contiguous: a cache layout the engine does not use today) at served-pool ids.

Columns: the prefill side's ``offer`` (checksums, and the packing when staged), the transport's
time (``TransferResult.read_s``), the decode side's checks (``verify_s``) and staged copy
(``copy_s``); blocks/s, GB/s and the ratio to the large buffer's median are over the
transport's time, ``end to end`` over all four. Run:

    python benches/transfer_bandwidth.py [--blocks 256] [--pool-blocks 1024] [--reps 5] [--json FILE]

Needs the ``transfer`` extra. Results: benches/results/2026-12-06-transfer.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from typing import Any

import numpy as np
from bench_ports import free_port

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16


def _caches(pool_blocks: int, block_major: bool, fill: bool) -> list[np.ndarray]:
    row = (BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if block_major:
        shape: tuple[int, ...] = (pool_blocks, 2 * LAYERS * int(np.prod(row)))
        arrays = [np.zeros(shape, np.float32)]
    else:
        arrays = [np.zeros((pool_blocks, *row), np.float32) for _ in range(2 * LAYERS)]
    for r, a in enumerate(arrays):
        # Cheap, distinct contents per block and region; written either way, so every page is
        # mapped before the clock starts (a running engine's caches are; fresh zeros are not).
        a.reshape(pool_blocks, -1)[:] = (
            np.arange(pool_blocks, dtype=np.float32)[:, None] + r / 64 if fill else -1
        )
    return arrays


def manager_ids(pool_blocks: int, blocks: int, seed: int, churn_steps: int) -> list[int]:
    """A request's block ids as a KvCacheManager hands them out after ``churn_steps`` steps of
    sequences of 1 to 32 blocks arriving and finishing at random (a serving engine's pool)."""
    import pagedkv

    rng = np.random.default_rng(seed)
    kv = pagedkv.KvCacheManager(num_blocks=pool_blocks, block_size=BLOCK_SIZE)
    live: list[int] = []
    for seq in range(churn_steps):
        n = int(rng.integers(1, 33))
        if live and (rng.random() < 0.5 or kv.num_free_blocks - n < blocks):
            kv.free(live.pop(int(rng.integers(len(live)))))
        elif kv.num_free_blocks - n >= blocks:
            kv.add_sequence(seq, num_tokens=n * BLOCK_SIZE)
            live.append(seq)
    while kv.num_free_blocks < blocks:
        kv.free(live.pop())
    kv.add_sequence(-1 & 0x7FFFFFFF, num_tokens=blocks * BLOCK_SIZE)
    return [int(b) for b in kv.block_table(-1 & 0x7FFFFFFF)]


def runs(src: list[int], dst: list[int]) -> int:
    """Stretches of consecutive ids on both sides (what NIXL can merge into one descriptor)."""
    pairs = sorted(zip(src, dst, strict=True))
    return 1 + sum(1 for (a, b), (c, d) in zip(pairs, pairs[1:], strict=False) if (c, d) != (a + 1, b + 1))


def prefill_process(conn: Any, pool_blocks: int, big_nbytes: int) -> None:
    from nixl._api import nixl_agent, nixl_agent_config
    from pagedkv.transfer import KvRegions, TransferSource

    rows = KvRegions(_caches(pool_blocks, False, fill=True), block_size=BLOCK_SIZE)
    block_major = KvRegions(_caches(pool_blocks, True, fill=True), block_size=BLOCK_SIZE)
    sources = {
        name: TransferSource(
            regions,
            engine_id=f"prefill-{name}",
            free_request=lambda r: None,
            port=free_port(),
            staging_bytes=staging,
        )
        for name, regions, staging in (
            ("rows", rows, 0),
            ("staged", rows, 2 * big_nbytes),
            ("block-major", block_major, 0),
        )
    }
    big = np.ones(big_nbytes, np.uint8)
    raw_port = free_port()
    # Raw agents configured as pagedkv.transfer's (no spinning progress thread: this loop drives it).
    config = nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=True, listen_port=raw_port, backends=["UCX"]
    )
    raw = nixl_agent("raw-prefill", config)
    raw.register_memory([(int(big.ctypes.data), big.nbytes, 0, "")], "DRAM")
    conn.send((raw_port, int(big.ctypes.data)))
    while True:
        for source in sources.values():
            source.poll()
        raw.get_new_notifs()
        if not conn.poll(0.002):
            continue
        command, *args = conn.recv()
        if command == "offer":
            name, request_id, ids = args
            start = time.perf_counter()
            params = sources[name].offer(request_id, [ids], len(ids) * BLOCK_SIZE)
            conn.send((params.to_dict(), time.perf_counter() - start))
        elif command == "stop":
            for source in sources.values():
                source.close()
            conn.send("stopped")
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=256, help="blocks per request (16 tokens each)")
    parser.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each side's caches")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--churn", type=int, default=2000, help="allocate/free steps before a request's ids")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args(argv)

    from nixl._api import nixl_agent, nixl_agent_config
    from pagedkv.transfer import KvRegions, TransferSink

    block_nbytes = 2 * LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4
    nbytes = args.blocks * block_nbytes
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_process, args=(child, args.pool_blocks, nbytes), daemon=True)
    proc.start()
    raw_port, big_addr = conn.recv()

    rows = KvRegions(_caches(args.pool_blocks, False, fill=False), block_size=BLOCK_SIZE)
    block_major = KvRegions(_caches(args.pool_blocks, True, fill=False), block_size=BLOCK_SIZE)
    sinks = {
        "rows": TransferSink(rows, engine_id="decode-rows"),
        "staged": TransferSink(rows, engine_id="decode-staged", staging_bytes=2 * nbytes),
        "block-major": TransferSink(block_major, engine_id="decode-block-major"),
    }
    big = np.zeros(nbytes, np.uint8)
    raw = nixl_agent(
        "raw-decode", nixl_agent_config(enable_listen_thread=True, listen_port=0, backends=["UCX"])
    )
    raw.register_memory([(int(big.ctypes.data), big.nbytes, 0, "")], "DRAM")
    raw.fetch_remote_metadata("raw-prefill", "127.0.0.1", raw_port)
    while not raw.check_remote_metadata("raw-prefill"):
        time.sleep(0.001)
    raw.make_connection("raw-prefill")
    for _ in range(100):  # let the connection finish setting up
        raw.get_new_notifs()
        time.sleep(0.001)
    local = raw.get_xfer_descs([(int(big.ctypes.data), nbytes, 0)], "DRAM")
    remote = raw.get_xfer_descs([(big_addr, nbytes, 0)], "DRAM")

    def large_buffer() -> float:
        handle = raw.initialize_xfer("READ", local, remote, "raw-prefill")
        start = time.perf_counter()
        state = raw.transfer(handle)
        while state == "PROC":
            state = raw.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
        handle.release()
        assert state == "DONE", state
        return elapsed

    rng = np.random.default_rng(0)

    def served() -> tuple[list[int], list[int]]:
        seeds = rng.integers(1 << 31, size=2)
        return (
            manager_ids(args.pool_blocks, args.blocks, int(seeds[0]), args.churn),
            manager_ids(args.pool_blocks, args.blocks, int(seeds[1]), args.churn),
        )

    def fresh() -> tuple[list[int], list[int]]:
        return manager_ids(args.pool_blocks, args.blocks, 0, 0), manager_ids(
            args.pool_blocks, args.blocks, 0, 0
        )

    variants = {
        "rows, fresh pool": ("rows", fresh),
        "rows, served pool": ("rows", served),
        "staged, served pool": ("staged", served),
        "rows, block-major layout (what if)": ("block-major", served),
    }
    base: list[float] = []
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    # One warm-up of each (connections, first-touch page faults), then the reps.
    for rep in range(args.reps + 1):
        elapsed = large_buffer()
        if rep:
            base.append(elapsed)
        for variant, (name, make_ids) in variants.items():
            src, dst = make_ids()
            conn.send(("offer", name, f"{variant}-{rep}", src))
            params, offer_s = conn.recv()
            result = sinks[name].wait(sinks[name].start(params, [dst]))
            assert result.ok and result.blocks_read == args.blocks, result
            staged = name == "staged"
            assert (result.copy_s > 0) == staged, (variant, result)
            if rep:
                samples[variant].append(
                    {
                        "offer_s": offer_s,
                        "read_s": result.read_s,
                        "verify_s": result.verify_s,
                        "copy_s": result.copy_s,
                        "runs": runs(src, dst),
                    }
                )
    conn.send(("stop",))
    conn.recv()
    for sink in sinks.values():
        sink.close()
    proc.join(10)

    base_s = statistics.median(base)
    table = [
        {
            "variant": "large buffer",
            "offer_s": 0.0,
            "read_s": base_s,
            "verify_s": 0.0,
            "copy_s": 0.0,
            "runs": 1,
        }
    ]
    for variant, rows_ in samples.items():
        table.append({"variant": variant, **{k: statistics.median(r[k] for r in rows_) for k in rows_[0]}})
    for row in table:
        total = row["offer_s"] + row["read_s"] + row["verify_s"] + row["copy_s"]
        row.update(
            blocks_per_s=args.blocks / row["read_s"],
            gb_per_s=nbytes / row["read_s"] / 1e9,
            ratio=base_s / row["read_s"],
            end_to_end_gb_per_s=nbytes / total / 1e9,
            end_to_end_ratio=base_s / total,
        )
    print(
        f"request: {args.blocks} blocks x {block_nbytes} B = {nbytes / 1e6:.1f} MB; pool {args.pool_blocks} "
        f"blocks; churn {args.churn}; {args.reps} reps (medians)"
    )
    print(
        "| variant | runs | offer ms | read ms | verify ms | copy ms | blocks/s | GB/s | ratio "
        "| end to end GB/s | end-to-end ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        cells = [
            row["variant"],
            f"{row['runs']:.0f}",
            *(f"{row[k] * 1e3:.1f}" for k in ("offer_s", "read_s", "verify_s", "copy_s")),
            f"{row['blocks_per_s']:.0f}",
            f"{row['gb_per_s']:.2f}",
            f"{row['ratio']:.2f}",
            f"{row['end_to_end_gb_per_s']:.2f}",
            f"{row['end_to_end_ratio']:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "bytes": nbytes,
                    "table": table,
                    "large_buffer_s": base,
                    "samples": samples,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
