"""Helpers of the transfer tests: deterministic K/V contents, cache regions of SmolLM2's shapes,
and a prefill instance in its own process (spawned) driven over a pipe.

The K/V a block holds is a function of the tokens up to the block's end (what a real model's
K/V is: a function of the prefix), so a decode process that computed a shared prefix itself
holds the very bytes the prefill process would send, and any process can compute what a block
must hold.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
from listen_ports import free_port

# SmolLM2-135M's K/V: 30 layers, 3 KV heads, head_dim 64, 16-token blocks, fp32 caches.
SMOLLM2 = {"layers": 30, "kv_heads": 3, "head_dim": 64, "block_size": 16}


def make_caches(
    num_blocks: int, *, layers: int, kv_heads: int, head_dim: int, block_size: int, fill: float = 0.0
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = [np.full(shape, fill, np.float32) for _ in range(layers)]
    v = [np.full(shape, fill, np.float32) for _ in range(layers)]
    return k, v


def block_kv(tokens: list[int], position: int, num_regions: int, row_shape: tuple[int, ...]) -> np.ndarray:
    """float32 ``[num_regions, *row_shape]``: what block ``position`` holds after ``tokens``
    (rows of token slots past the end are zero)."""
    block_size = row_shape[0]
    end = min(len(tokens), (position + 1) * block_size)
    seed = int.from_bytes(
        hashlib.blake2b(np.asarray(tokens[:end], np.int64).tobytes(), digest_size=8).digest(), "little"
    )
    out = np.random.default_rng(seed).standard_normal((num_regions, *row_shape), dtype=np.float32)
    out[:, end - position * block_size :] = 0.0
    return out


def write_blocks(regions: list[np.ndarray], tokens: list[int], table: np.ndarray, first: int = 0) -> None:
    """Fill the blocks of ``table`` (logical positions ``first``...) as a prefill of ``tokens``
    would have."""
    for i, block in enumerate(table):
        if block < 0:
            continue
        kv = block_kv(tokens, first + i, len(regions), regions[0].shape[1:])
        for r, region in enumerate(regions):
            region[block] = kv[r]


def blocks_hold(regions: list[np.ndarray], tokens: list[int], table: list[int], first: int) -> list[bool]:
    """Whether each block of ``table`` holds exactly (bit for bit) what it must."""
    out = []
    for i, block in enumerate(table):
        kv = block_kv(tokens, first + i, len(regions), regions[0].shape[1:])
        out.append(
            all(
                np.array_equal(region[block].view(np.uint32), kv[r].view(np.uint32))
                for r, region in enumerate(regions)
            )
        )
    return out


def prefill_server(
    conn: Any,
    port: int,
    num_blocks: int,
    shape: dict[str, int],
    lease_s: float,
    prefix_caching: bool,
    staging_bytes: int = 0,
) -> None:
    """A prefill instance: a KvCacheManager, caches, a TransferSource on ``port``. Commands over
    ``conn`` (one reply each): ("offer", request_id, tokens[, write]) -> params dict (``write``
    False: the blocks keep what they hold, for a test about time, not bytes); ("corrupt",
    request_id, position, region) flips a byte of that block (of its staged copy if staged);
    ("reuse",) takes every free block for a new sequence and fills it with other contents;
    ("status",) -> dict; ("stop",)."""
    import pagedkv
    from pagedkv.transfer import KvRegions, TransferSource, source_block_ids

    kv = pagedkv.KvCacheManager(
        num_blocks=num_blocks, block_size=shape["block_size"], enable_prefix_caching=prefix_caching
    )
    k, v = make_caches(num_blocks, **shape)
    regions = KvRegions.from_caches(k, v, block_size=shape["block_size"])
    arrays = list(regions.arrays)
    seq_of: dict[str, int] = {}
    freed: list[str] = []

    def free_request(request_id: str) -> None:
        kv.free(seq_of.pop(request_id))
        freed.append(request_id)

    source = TransferSource(
        regions,
        engine_id="prefill",
        free_request=free_request,
        port=port,
        lease_s=lease_s,
        staging_bytes=staging_bytes,
    )
    offered: dict[str, Any] = {}
    next_seq = 0
    conn.send(("ready", source.instance))
    while True:
        source.poll()
        if not conn.poll(0.002):
            continue
        command, *args = conn.recv()
        if command == "offer":
            request_id, tokens, *write = args
            next_seq += 1
            seq_of[request_id] = next_seq
            kv.add_sequence(next_seq, tokens)
            if not write or write[0]:
                write_blocks(arrays, tokens, kv.block_table(next_seq))
            params = source.offer(request_id, source_block_ids(kv, next_seq), len(tokens))
            offered[request_id] = params
            conn.send(params.to_dict())
        elif command == "corrupt":
            request_id, position, region = args
            params = offered[request_id]
            block = params.block_ids[0][position]
            if params.staged_addr:  # the staged copy is what a decode side reads
                column = sum(spec.block_nbytes for spec in regions.specs[:region])
                at = params.staged_addr - source._arena.address + position * regions.block_nbytes + column
                source._arena.array[at + 7] ^= 0x10
            else:
                arrays[region][block].view(np.uint8).reshape(-1)[7] ^= 0x10
            conn.send(block)
        elif command == "reuse":
            next_seq += 1
            free = kv.num_free_blocks
            tokens = list(range(10_000, 10_000 + free * shape["block_size"]))
            kv.add_sequence(next_seq, tokens)
            write_blocks(arrays, tokens, kv.block_table(next_seq))
            conn.send(free)
        elif command == "status":
            kv.check_invariants()
            pending = source.pending
            conn.send(
                {
                    "pending": len(pending),
                    "free_blocks": kv.num_free_blocks,
                    "freed": list(freed),
                    "completed": pending.completed,
                    "expired": pending.expired,
                    "late": pending.late_notifications,
                    "bad": source.bad_notifications,
                }
            )
        elif command == "stop":
            source.close()
            conn.send("stopped")
            return


def start_prefill(
    ctx: Any,
    *,
    num_blocks: int,
    shape: dict[str, int],
    lease_s: float = 30.0,
    prefix_caching: bool = True,
    staging_bytes: int = 0,
) -> tuple[Any, Any, int]:
    """(process, connection, port) of a running prefill server."""
    parent, child = ctx.Pipe()
    port = free_port()
    proc = ctx.Process(
        target=prefill_server,
        args=(child, port, num_blocks, shape, lease_s, prefix_caching, staging_bytes),
        daemon=True,
    )
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise TimeoutError("the prefill process did not start")
    ready = parent.recv()
    assert ready[0] == "ready"
    return proc, parent, port


def call(conn: Any, *message: Any, timeout_s: float = 60.0) -> Any:
    conn.send(message)
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer to {message[0]!r}")
    return conn.recv()


def wait_status(conn: Any, ready: Any, timeout_s: float) -> dict[str, Any]:
    """Poll the prefill server's status until ``ready(status)``; the last status either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = call(conn, "status")
        if ready(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.02)


def slow_destination(params: dict[str, Any]) -> list[list[int]]:
    """Destination ids in the reverse order of the sources: no two neighbouring rows are
    neighbours on both sides, so NIXL merges nothing and the read takes one descriptor per row
    (long enough to be killed in the middle of)."""
    return [list(range(len(g)))[::-1] for g in params["remote_block_ids"]]


def decode_reader(conn: Any, params: dict[str, Any], num_blocks: int, shape: dict[str, int]) -> None:
    """A decode instance that says it is about to read, reads, and says it finished (the test
    kills it before that)."""
    from pagedkv.transfer import KvRegions, TransferSink

    k, v = make_caches(num_blocks, **shape)
    sink = TransferSink(KvRegions.from_caches(k, v, block_size=shape["block_size"]), engine_id="decode")
    sink.connect(params)  # the handshake, before the test's clock starts
    conn.send("reading")
    result = sink.wait(sink.start(params, slow_destination(params)))
    conn.send(("finished", result.ok))
    time.sleep(600)
