"""KvCacheManager drives the data plane: its slot mappings feed write_kv, its CoW copy ops feed
copy_blocks, its block tables feed paged_attention, and its swap mappings feed swap_blocks. Every
step's output must equal contiguous attention over each sequence's own history."""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest
from pagedkv.attention import contiguous_attention, copy_blocks, paged_attention, swap_blocks, write_kv
from pagedkv.kernels import emulation, instances

from .conftest import assert_close, needs_cxx, to_kind

HEADS, GROUP, HEAD_DIM, BLOCK = 2, 4, 64, 16
LAYERS = 2


class Engine:
    """A tiny decode loop: per-layer caches, one history per sequence and layer."""

    def __init__(
        self,
        kv: pagedkv.KvCacheManager,
        kind: str,
        backend: str,
        rng: np.random.Generator,
        num_host_blocks: int = 0,
    ) -> None:
        self.kv, self.kind, self.backend, self.rng = kv, kind, backend, rng
        dtype = np.float16 if kind == "float16" else np.float64
        shape = (kv.num_blocks, BLOCK, HEADS, HEAD_DIM)
        # NaN everywhere no token was written: reading a wrong slot shows.
        self.k = [np.full(shape, np.nan, dtype) for _ in range(LAYERS)]
        self.v = [np.full(shape, np.nan, dtype) for _ in range(LAYERS)]
        host = (num_host_blocks, BLOCK, HEADS, HEAD_DIM)
        self.host_k = [np.full(host, np.nan, dtype) for _ in range(LAYERS)]
        self.host_v = [np.full(host, np.nan, dtype) for _ in range(LAYERS)]
        self.history: dict[int, list[tuple[list[np.ndarray], list[np.ndarray]]]] = {}

    def _tokens(self, n: int) -> np.ndarray:
        return to_kind(self.rng.standard_normal((n, HEADS, HEAD_DIM)), self.kind)

    def _write(self, seq_ids: list[int], n: int) -> None:
        slots = self.kv.slot_mapping(seq_ids, n)
        for layer in range(LAYERS):
            ks = [self._tokens(n) for _ in seq_ids]
            vs = [self._tokens(n) for _ in seq_ids]
            write_kv(
                np.concatenate(ks),
                np.concatenate(vs),
                self.k[layer],
                self.v[layer],
                slots,
                backend=self.backend,
            )
            for s, kk, vv in zip(seq_ids, ks, vs, strict=True):
                self.history[s][layer][0].append(kk)
                self.history[s][layer][1].append(vv)

    def run_copies(self) -> int:
        ops = self.kv.take_copy_ops()
        copy_blocks(self.k, self.v, ops, backend=self.backend)
        return len(ops)

    def add(self, seq_id: int, prompt_len: int) -> None:
        self.kv.add_sequence(seq_id, num_tokens=prompt_len)
        self.history[seq_id] = [([], []) for _ in range(LAYERS)]
        self._write([seq_id], prompt_len)

    def fork(self, parent: int, child: int) -> None:
        self.kv.fork(parent, child)
        self.history[child] = [(list(k), list(v)) for k, v in self.history[parent]]

    def step(self, seq_ids: list[int]) -> int:
        self.kv.append_tokens_batch(seq_ids, num_tokens=1)
        copies = self.run_copies()  # CoW before the new token lands in the copied block
        self._write(seq_ids, 1)
        self.check(seq_ids)
        return copies

    def check(self, seq_ids: list[int]) -> None:
        tables, lens = self.kv.batch_block_tables(seq_ids)
        for layer in range(LAYERS):
            q = to_kind(self.rng.standard_normal((len(seq_ids), HEADS * GROUP, HEAD_DIM)), self.kind)
            out = paged_attention(q, self.k[layer], self.v[layer], tables, lens, backend=self.backend)
            for b, s in enumerate(seq_ids):
                keys = np.concatenate(self.history[s][layer][0])
                values = np.concatenate(self.history[s][layer][1])
                assert int(lens[b]) == len(keys) == self.kv.num_tokens(s)
                expected = contiguous_attention(q[b], keys, values)
                if self.backend == "numpy":
                    assert np.array_equal(out[b], expected), f"seq {s} layer {layer}"
                else:
                    assert_close(out[b], expected, self.kind)


def _drive(engine: Engine, steps: int) -> int:
    kv = engine.kv
    engine.add(1, 21)
    engine.add(2, 16)  # exactly one full block
    engine.add(3, 5)
    engine.check([1, 2, 3])
    cow = 0
    for _ in range(steps):
        cow += engine.step([1, 2, 3])
    engine.fork(1, 4)  # shares every block of 1, the last one partially filled
    engine.fork(3, 5)
    cow += engine.step([1, 2, 3, 4, 5])  # 4 and 5 (or 1 and 3) must copy-on-write the shared last block
    cow += engine.step([4, 5, 1])
    kv.free(2)
    engine.add(6, 40)
    cow += engine.step([1, 3, 4, 5, 6])
    kv.check_invariants()
    return cow


def test_manager_drives_numpy_data_plane_bit_exactly():
    kv = pagedkv.KvCacheManager(num_blocks=48, block_size=BLOCK)
    engine = Engine(kv, "float64", "numpy", np.random.default_rng(0))
    assert _drive(engine, steps=3) >= 2


@needs_cxx
def test_manager_drives_emulated_kernels():
    emulation.prebuild(
        [
            (i.source, i.name)
            for i in (
                instances.write_kv("float16", HEAD_DIM),
                instances.copy_blocks(),
                instances.decode_for("float16", HEAD_DIM, BLOCK, GROUP),
            )
        ]
    )
    kv = pagedkv.KvCacheManager(num_blocks=48, block_size=BLOCK)
    engine = Engine(kv, "float16", "emulated", np.random.default_rng(1))
    assert _drive(engine, steps=1) >= 2


def test_a_manager_with_a_host_tier_swaps_out_and_in():
    # The host tier is part of the contract: a swap_out refused (or missing) is the regression
    # the round trip below exists to catch, so it fails here rather than skipping.
    kv = pagedkv.KvCacheManager(num_blocks=4, block_size=BLOCK, num_host_blocks=4)
    kv.add_sequence(0, num_tokens=1)
    kv.swap_out(0)
    assert kv.is_swapped_out(0) and kv.num_free_host_blocks == 3
    kv.swap_in(0)
    assert not kv.is_swapped_out(0) and kv.num_free_host_blocks == 4
    kv.check_invariants()


@pytest.mark.parametrize("backend", ["numpy", pytest.param("emulated", marks=needs_cxx)])
def test_manager_swap_round_trip(backend):
    """swap_out -> other sequences overwrite the freed device blocks -> swap_in: bit-identical
    KV and the same attention output, including a fork group sharing blocks."""
    kind = "float16"
    kv = pagedkv.KvCacheManager(num_blocks=12, block_size=BLOCK, num_host_blocks=16)
    engine = Engine(kv, kind, backend, np.random.default_rng(2), num_host_blocks=16)
    engine.add(1, 37)
    engine.fork(1, 2)
    engine.step([1, 2])
    group = [1, 2]
    tables_before, lens = kv.batch_block_tables(group)
    q = to_kind(np.random.default_rng(3).standard_normal((2, HEADS * GROUP, HEAD_DIM)), kind)
    before = [
        paged_attention(q, engine.k[layer], engine.v[layer], tables_before, lens, backend=backend)
        for layer in range(LAYERS)
    ]
    saved = {}
    for b, s in enumerate(group):
        for layer in range(LAYERS):
            ids = tables_before[b, : -(-int(lens[b]) // BLOCK)]
            saved[s, layer] = (engine.k[layer][ids].copy(), engine.v[layer][ids].copy())

    out_map = kv.swap_out(group)
    for layer in range(LAYERS):
        swap_blocks(engine.k[layer], engine.host_k[layer], out_map, backend=backend)
        swap_blocks(engine.v[layer], engine.host_v[layer], out_map, backend=backend)
    for layer in range(LAYERS):  # the freed device blocks are reused and overwritten
        engine.k[layer][:] = np.float16(-7.0)
        engine.v[layer][:] = np.float16(5.0)
    engine.add(9, 3 * BLOCK)
    kv.free(9)

    in_map = kv.swap_in(group)
    for layer in range(LAYERS):
        swap_blocks(engine.host_k[layer], engine.k[layer], in_map, backend=backend)
        swap_blocks(engine.host_v[layer], engine.v[layer], in_map, backend=backend)
    kv.check_invariants()
    tables_after, lens_after = kv.batch_block_tables(group)
    assert np.array_equal(lens_after, lens)
    for b, s in enumerate(group):
        for layer in range(LAYERS):
            ids = tables_after[b, : -(-int(lens[b]) // BLOCK)]
            assert engine.k[layer][ids].tobytes() == saved[s, layer][0].tobytes()
            assert engine.v[layer][ids].tobytes() == saved[s, layer][1].tobytes()
    for layer in range(LAYERS):
        after = paged_attention(q, engine.k[layer], engine.v[layer], tables_after, lens, backend=backend)
        assert after.tobytes() == before[layer].tobytes()
