"""KvCacheManager drives paged prefill: prefix-cache hits, chunked prefill and mixed prefill +
decode batches, with the manager's slot mappings feeding write_kv and its tables (padded and CSR)
feeding paged_prefill_attention. Every output must equal dense causal attention over the
sequence's whole prompt: bit for bit on the NumPy backend, within the kernel tolerance emulated.

Keys and values are a fixed function of (token id, position), so a prompt's cached prefix holds
exactly what recomputing it would write, as in a real model with deterministic weights.
"""

from __future__ import annotations

import shutil

import numpy as np
import pagedkv
import pytest
from pagedkv.attention import contiguous_attention, paged_prefill_attention, write_kv
from pagedkv.kernels import emulation, instances

from .conftest import assert_close, needs_cxx, to_kind

HEADS, GROUP, HEAD_DIM, BLOCK = 2, 4, 64, 8
VOCAB, MAX_POS = 100, 128


class Model:
    """Deterministic stand-in for a transformer layer's projections: K, V, Q of (token, position)."""

    def __init__(self, kind: str, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.kind = kind
        self.k = to_kind(rng.standard_normal((VOCAB, MAX_POS, HEADS, HEAD_DIM)), kind)
        self.v = to_kind(rng.standard_normal((VOCAB, MAX_POS, HEADS, HEAD_DIM)), kind)
        self.q = to_kind(rng.standard_normal((VOCAB, MAX_POS, HEADS * GROUP, HEAD_DIM)), kind)

    def kvq(self, tokens: list[int], start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pos = np.arange(start, start + len(tokens))
        t = np.array(tokens, dtype=np.int64)
        return self.k[t, pos], self.v[t, pos], self.q[t, pos]

    def dense(self, tokens: list[int], first: int) -> np.ndarray:
        """Causal attention of positions first.. of the whole prompt, one query at a time."""
        k, v, q = self.kvq(tokens, 0)
        return np.stack(
            [contiguous_attention(q[p], k[: p + 1], v[: p + 1]) for p in range(first, len(tokens))]
        )


class Cache:
    def __init__(self, kv: pagedkv.KvCacheManager, model: Model) -> None:
        dtype = model.k.dtype
        shape = (kv.num_blocks, BLOCK, HEADS, HEAD_DIM)
        fill = 0x7FC0 if model.kind == "bfloat16" else np.nan
        self.k = np.full(shape, fill, dtype)  # NaN wherever nothing was written
        self.v = np.full(shape, fill, dtype)
        self.kv, self.model = kv, model

    def write(self, seq: int, tokens: list[int], start: int) -> np.ndarray:
        """Writes the K/V of `tokens` at positions start.. of `seq`; returns their queries."""
        k, v, q = self.model.kvq(tokens, start)
        write_kv(k, v, self.k, self.v, self.kv.slot_mapping([seq], len(tokens)))
        return q

    def prefill(self, seqs: list[int], qs: list[np.ndarray], layout: str, backend: str) -> np.ndarray:
        tables: object
        if layout == "csr":
            tables = self.kv.csr_page_table(seqs)
            lens = self.kv.batch_block_tables(seqs)[1]
        else:
            tables, lens = self.kv.batch_block_tables(seqs)
        qsl = np.concatenate([[0], np.cumsum([len(q) for q in qs])]).astype(np.int32)
        return paged_prefill_attention(np.concatenate(qs), self.k, self.v, tables, lens, qsl, backend=backend)


def compare(actual: np.ndarray, expected: np.ndarray, kind: str, backend: str) -> None:
    if backend == "numpy":
        assert np.array_equal(actual, expected)
    else:
        assert_close(actual, expected, kind)


BACKENDS = [
    ("float32", "numpy"),
    pytest.param("float16", "emulated", marks=needs_cxx),
]


@pytest.fixture(scope="module")
def prebuilt():
    if shutil.which("g++"):
        emulation.prebuild([(i.source, i.name) for i in [instances.prefill("float16", HEAD_DIM, BLOCK)]])


@pytest.mark.parametrize("kind,backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "csr"])
def test_shared_system_prompt_prefills_only_the_suffix(kind, backend, layout, prebuilt):
    model = Model(kind)
    kv = pagedkv.KvCacheManager(num_blocks=32, block_size=BLOCK, enable_prefix_caching=True)
    cache = Cache(kv, model)
    system = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 11, 12, 13, 14, 15, 16]  # two full blocks
    first = system + [20, 21, 22]
    assert kv.add_sequence(1, first) == 0
    q1 = cache.write(1, first, 0)
    compare(cache.prefill([1], [q1], layout, backend), model.dense(first, 0), kind, backend)

    second = system + [30, 31, 32, 33, 34]
    hit = kv.add_sequence(2, second)
    assert hit == len(system)
    suffix = second[hit:]
    q2 = cache.write(2, suffix, hit)  # only the uncached suffix is written and queried
    out = cache.prefill([2], [q2], layout, backend)
    compare(out, model.dense(second, hit), kind, backend)
    kv.check_invariants()


@pytest.mark.parametrize("kind,backend", BACKENDS)
def test_three_chunks_equal_one_shot(kind, backend, prebuilt):
    model = Model(kind, seed=1)
    kv = pagedkv.KvCacheManager(num_blocks=32, block_size=BLOCK)
    cache = Cache(kv, model)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, 29)]
    cuts = [0, 10, 11, 29]
    outs = []
    for c0, c1 in zip(cuts, cuts[1:], strict=False):
        if c0 == 0:
            kv.add_sequence(1, prompt[:c1])
        else:
            kv.append_tokens(1, prompt[c0:c1])
        q = cache.write(1, prompt[c0:c1], c0)
        outs.append(cache.prefill([1], [q], "csr", backend))
    chunked = np.concatenate(outs)
    compare(chunked, model.dense(prompt, 0), kind, backend)
    if backend == "numpy":
        kv2 = pagedkv.KvCacheManager(num_blocks=32, block_size=BLOCK)
        cache2 = Cache(kv2, model)
        kv2.add_sequence(1, prompt)
        one_shot = cache2.prefill([1], [cache2.write(1, prompt, 0)], "padded", backend)
        assert np.array_equal(chunked, one_shot)


@pytest.mark.parametrize("kind,backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "csr"])
def test_mixed_prefill_and_decode_batch_equals_each_row_alone(kind, backend, layout, prebuilt):
    model = Model(kind, seed=3)
    kv = pagedkv.KvCacheManager(num_blocks=64, block_size=BLOCK)
    cache = Cache(kv, model)
    rng = np.random.default_rng(4)
    prompts = {s: [int(t) for t in rng.integers(0, VOCAB, n)] for s, n in [(1, 13), (2, 30)]}
    for s in (1, 2):  # running sequences: prefilled earlier, now decoding one token each
        kv.add_sequence(s, prompts[s])
        cache.write(s, prompts[s], 0)
    qs = {}
    for s in (1, 2):
        token = [int(rng.integers(0, VOCAB))]
        kv.append_tokens(s, token)
        qs[s] = cache.write(s, token, len(prompts[s]))
        prompts[s] = prompts[s] + token
    new = [int(t) for t in rng.integers(0, VOCAB, 21)]  # a new prompt prefilled in the same step
    kv.add_sequence(4, new)
    qs[4] = cache.write(4, new, 0)
    prompts[4] = new
    order = [2, 4, 1]
    batch = cache.prefill(order, [qs[s] for s in order], layout, backend)
    row = 0
    for s in order:
        n = len(qs[s])
        alone = cache.prefill([s], [qs[s]], layout, backend)
        if backend == "numpy":
            assert np.array_equal(batch[row : row + n], alone)
        compare(batch[row : row + n], model.dense(prompts[s], len(prompts[s]) - n), kind, backend)
        row += n
    kv.check_invariants()
