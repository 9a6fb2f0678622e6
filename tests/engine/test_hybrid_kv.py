"""Hybrid KV groups on the engine side: the layout (which layers share a group and a K/V tensor,
as vLLM's hybrid KV-cache manager lays them out) and the paged store reading each layer through
its own group's block table, with the blocks a sliding-window group has released marked ``-1``
and poisoned with NaN. The engine on the manager's groups: test_hybrid_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_hybrid import WINDOW, tiny_hybrid_model
from tiny_llama import VOCAB


def _gemma_windows(num_layers: int, window: int) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_gemma3_270m_layout_is_one_global_and_five_local_groups_of_three():
    from pagedkv.engine.kv_layout import kv_layout

    layout = kv_layout(_gemma_windows(18, 512))
    assert layout.group_windows == (None, 512, 512, 512, 512, 512)
    assert layout.layers_per_group == 3 and layout.num_groups == 6 and layout.is_hybrid
    assert layout.group_layers[0] == (5, 11, 17)
    assert layout.group_layers[1:] == ((0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    # The i-th layer of every group shares tensor i; every layer has exactly one slot.
    assert [layout.slot(layer) for layer in (5, 11, 17, 0, 6, 16)] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (2, 2),
        (5, 2),
    ]
    assert sorted(layout.slot(i) for i in range(18)) == sorted((g, i) for g in range(6) for i in range(3))
    # A block of any group holds 3 layers' K and V: a sixth of an all-full-attention block.
    full = kv_layout(_gemma_windows(18, 512), hybrid=False)
    assert full.group_windows == (None,) and full.layers_per_group == 18 and not full.is_hybrid
    assert full.bytes_per_block(16, 1, 256) == 6 * layout.bytes_per_block(16, 1, 256) == 2 * 18 * 16 * 256 * 4


def test_layout_group_size_and_padding_follow_vllm():
    from pagedkv.engine.kv_layout import kv_layout

    # Gemma 3 27B (vLLM's example): 10 global, 52 local -> 1 + 6 groups of 10, the last with 2.
    big = kv_layout(_gemma_windows(62, 1024))
    assert big.layers_per_group == 10 and big.group_windows == (None,) + (1024,) * 6
    assert [len(g) for g in big.group_layers] == [10] * 6 + [2]
    # Counts within 1.25x of each other (vLLM's gpt-oss-20b + EAGLE, 12 local and 13 global):
    # one group per kind of the larger count; 4 and 5 are not (5 < 1.25 * 4 is false).
    close = kv_layout([None] * 13 + [64] * 12)
    assert close.layers_per_group == 13 and close.group_windows == (None, 64)
    assert kv_layout([None] * 4 + [64] * 5).group_windows == (None, 64, 64)
    # No window anywhere (SmolLM2), or one window everywhere: a single group, unchanged.
    assert kv_layout([None] * 30).group_windows == (None,)
    assert kv_layout([8] * 4).group_windows == (8,)
    assert kv_layout([None] * 30).manager_groups() is None


def test_layout_refuses_bad_windows():
    from pagedkv.engine.kv_layout import kv_layout
    from pagedkv.errors import InvalidArgumentError

    for bad in ([], [0], [None, -3], [True], [2.5]):
        with pytest.raises(InvalidArgumentError):
            kv_layout(bad)


class _HandTables:
    """Block tables of each KV group for a few sequences, allocated by hand (fresh ids), with a
    sliding-window group's blocks released by vLLM's rule (every block wholly before
    ``computed - window + 1``): the entry becomes -1 and the block is filled with NaN in every
    tensor, as a block reused by another sequence would be."""

    def __init__(self, store, windows, block_size):
        self.store, self.windows, self.bs = store, windows, block_size
        self.tables: list[dict[int, list[int]]] = [{} for _ in windows]
        self.next_block = 0
        self.released = 0

    def grow(self, seq: int, num_tokens: int) -> None:
        for table in self.tables:
            blocks = table.setdefault(seq, [])
            while len(blocks) * self.bs < num_tokens:
                blocks.append(self.next_block)
                self.next_block += 1

    def release(self, seq: int, computed: int) -> None:
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            blocks = self.tables[g].get(seq, [])
            for b in range(max(0, computed - window + 1) // self.bs):
                if blocks[b] >= 0:
                    for cache in (*self.store.k_caches, *self.store.v_caches):
                        cache[blocks[b]] = np.nan
                    blocks[b] = -1
                    self.released += 1

    def batch(self, seqs: list[int]) -> list[np.ndarray]:
        out = []
        for table in self.tables:
            width = max(len(table[s]) for s in seqs)
            out.append(np.array([table[s] + [-1] * (width - len(table[s])) for s in seqs], np.int32))
        return out


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_hybrid_tables_with_released_blocks_equal_contiguous_kv(backend):
    """A real forward pass of the tiny hybrid model (1 full + 2 sliding-window groups, window 8,
    blocks of 2) through per-group tables whose out-of-window blocks are released (-1, NaN):
    two prompts in one chunked prefill, then decode steps; the logits equal contiguous per-layer
    KV with the window mask, bit for bit on the NumPy data plane (the reference), within float
    rounding on the Rust CPU one. Each group reads its own table: a layer reading another
    group's table, or a released block, gives other (or NaN) logits."""
    from pagedkv.engine.kv_layout import kv_layout, layer_windows
    from pagedkv.engine.kv_store import ContiguousKvStore, PagedKvStore

    model = tiny_hybrid_model().model
    c = model.config
    layout = kv_layout(layer_windows(c))
    assert layout.group_windows == (None, WINDOW, WINDOW) and layout.layers_per_group == 2
    bs = 2
    paged = PagedKvStore(c, 128, bs, backend=backend, layout=layout)
    contiguous = ContiguousKvStore(c, 64)
    hand = _HandTables(paged, layout.group_windows, bs)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, VOCAB, size=n).tolist() for n in (13, 6)]
    tokens = [list(p) for p in prompts]
    computed = [0, 0]
    for s in range(2):
        contiguous.add(s)
    chunks = [[7, 6], [6, 0], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1]]
    for step, chunk in enumerate(chunks):
        seqs = [s for s in range(2) if chunk[s]]
        for s in seqs:
            hand.release(s, computed[s])  # before the step's tokens, as the manager does
            hand.grow(s, computed[s] + chunk[s])
        ctx = [computed[s] + chunk[s] for s in seqs]
        q_lens = [chunk[s] for s in seqs]
        paged.set_batch(hand.batch(seqs), np.array(ctx, np.int32), np.array(q_lens, np.int32))
        contiguous.set_batch(seqs, ctx, q_lens)
        flat = np.concatenate([tokens[s][computed[s] : computed[s] + chunk[s]] for s in seqs])
        pos = np.concatenate([np.arange(computed[s], computed[s] + chunk[s]) for s in seqs])
        rows = np.arange(len(flat))
        a = model.forward(flat, pos, paged, rows)
        b = model.forward(flat, pos, contiguous, rows)
        if backend == "numpy":
            assert np.array_equal(a, b), step
        else:
            # Another summation order, through 6 layers of sharp attention: logits of ~30 agree to
            # ~1e-3 (a NaN from a released block, or a wrong table, is far outside).
            assert np.isfinite(a).all()
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-2, err_msg=str(step))
        ends = np.cumsum(q_lens) - 1
        for k, s in enumerate(seqs):
            computed[s] += chunk[s]
            if computed[s] == len(tokens[s]):
                tokens[s].append(int(np.argmax(a[ends[k]])))
    assert computed[0] > 2 * WINDOW and hand.released >= 2 * (computed[0] - WINDOW) // bs - 2


def test_store_refuses_a_write_into_a_released_block():
    from pagedkv.engine.kv_layout import kv_layout, layer_windows
    from pagedkv.engine.kv_store import PagedKvStore
    from pagedkv.errors import InvalidArgumentError

    c = tiny_hybrid_model().model.config
    layout = kv_layout(layer_windows(c))
    store = PagedKvStore(c, 8, 2, backend="numpy", layout=layout)
    table = np.array([[0, 1]], np.int32)
    with pytest.raises(InvalidArgumentError, match="3 KV groups"):
        store.set_batch(table, np.array([4], np.int32), np.array([1], np.int32))
    released = np.array([[2, -1]], np.int32)
    with pytest.raises(InvalidArgumentError, match="group 2.*position 3"):
        store.set_batch([table, table, released], np.array([4], np.int32), np.array([1], np.int32))
