"""paged_prefill_attention rejects malformed input with InvalidArgumentError before anything runs."""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest
from pagedkv.attention import paged_prefill_attention

from .prefill_problems import make_prefill_problem

BACKENDS = ["numpy"]


@pytest.fixture
def problem():
    # two sequences: 20 cached + 4 new, 0 cached + 5 new; block_size 16
    return make_prefill_problem(np.random.default_rng(0), "float16", [20, 0], [4, 5], 2, 2, 128, 16)


def call(p, backend="numpy", layout="padded", **overrides):
    names = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")
    args = dict(zip(names, p.args(layout), strict=True))
    kwargs = {k: overrides.pop(k) for k in ("scale", "causal") if k in overrides}
    args.update(overrides)
    return paged_prefill_attention(*(args[n] for n in names), backend=backend, **kwargs)


def i32(*values):
    return np.array(values, np.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda p: dict(q=p.q[0]), "q must be"),
        (lambda p: dict(q=p.q.astype(np.float32)), "share one dtype"),
        (lambda p: dict(q=np.asfortranarray(p.q[:, :, :64].transpose(0, 2, 1))), "C-contiguous|head_dim"),
        (lambda p: dict(q=p.q[:, :, ::2]), "C-contiguous|head_dim"),
        (lambda p: dict(v_cache=p.paged.v_cache[:, :8]), "v_cache shape"),
        (lambda p: dict(q=np.ascontiguousarray(p.q[:, :3])), "multiple of num_kv_heads"),
        (lambda p: dict(q=p.q.tolist()), "NumPy array"),
        (lambda p: dict(q=np.ma.masked_array(p.q)), "masked"),
        (lambda p: dict(block_tables=p.paged.block_tables.astype(np.int64)), "int32"),
        (lambda p: dict(block_tables=p.paged.block_tables[:1]), "rows"),
        (lambda p: dict(block_tables=np.ascontiguousarray(p.paged.block_tables[:, :1])), "capacity"),
        (lambda p: dict(block_tables=p.paged.block_tables[:, :1]), "C-contiguous"),
        (lambda p: dict(seq_lens=p.seq_lens[:1]), r"\[B \+ 1\]"),
        (lambda p: dict(seq_lens=p.seq_lens.astype(np.int64)), "seq_lens must be int32"),
        (lambda p: dict(seq_lens=i32(24, 3)), "queries but seq_lens"),
        (lambda p: dict(seq_lens=i32(-1, 5), query_start_loc=i32(0, 0, 9)), ">= 0"),
        (lambda p: dict(query_start_loc=i32(0, 4, 8)), "total_q"),
        (lambda p: dict(query_start_loc=i32(1, 4, 9)), r"query_start_loc\[0\]"),
        (lambda p: dict(query_start_loc=i32(0, 10, 9)), "non-decreasing"),
        (lambda p: dict(query_start_loc=i32(0, 9)), r"\[B \+ 1\]"),
        (lambda p: dict(query_start_loc=np.array([[0, 4, 9]], np.int32)), "1-D"),
        (lambda p: dict(query_start_loc=[0, 4, 9]), "NumPy array"),
        (
            lambda p: dict(
                block_tables=np.where(
                    p.paged.block_tables == p.paged.block_tables[0, 1], 99, p.paged.block_tables
                ).astype(np.int32)
            ),
            "sequence 0's block 1 is 99",
        ),
        (lambda p: dict(block_tables=np.full_like(p.paged.block_tables, -1)), "is -1, not a block id"),
        (lambda p: dict(scale=float("nan")), "finite"),
        (lambda p: dict(scale="0.1"), "real number"),
        (lambda p: dict(causal=1), "causal must be a bool"),
    ],
)
def test_padded_rejections(problem, backend, mutate, match):
    with pytest.raises(pagedkv.InvalidArgumentError, match=match):
        call(problem, backend, **mutate(problem))


def with_csr(p, indptr=None, indices=None, last=None):
    a, b, c = p.csr()
    return dict(
        block_tables=(
            a if indptr is None else indptr,
            b if indices is None else indices,
            c if last is None else last,
        )
    )


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda p: dict(block_tables=p.csr()[:2]), "tuple"),
        (lambda p: with_csr(p, indptr=i32(0, 2)), r"\[B \+ 1\]"),
        (lambda p: with_csr(p, last=i32(8)), r"\[B\]"),
        (lambda p: with_csr(p, indptr=i32(1, 2, 3)), r"kv_indptr\[0\]"),
        (lambda p: with_csr(p, indptr=i32(0, 3, 2)), "non-decreasing"),
        (lambda p: with_csr(p, indptr=i32(0, 2, 9)), "exceeds len"),
        (lambda p: with_csr(p, indptr=i32(0, 1, 2)), "CSR row 0 has 1 blocks"),
        (lambda p: with_csr(p, last=i32(7, 5)), "kv_last_page_len"),
        (lambda p: with_csr(p, last=i32(8, 5)[::-1].copy()), "kv_last_page_len"),
        (lambda p: with_csr(p, indices=p.csr()[1].astype(np.int64)), "int32"),
        (lambda p: with_csr(p, indices=np.full(3, 1000, np.int32)), "not a block id"),
        (lambda p: with_csr(p, indices=np.full(3, -1, np.int32)), "not a block id"),
    ],
)
def test_csr_rejections(problem, mutate, match):
    with pytest.raises(pagedkv.InvalidArgumentError, match=match):
        call(problem, **mutate(problem))


def test_csr_may_come_from_a_longer_index_buffer(problem):
    # kv_indices longer than kv_indptr[B] (a preallocated buffer): the tail is never read.
    a, b, c = problem.csr()
    padded = np.concatenate([b, np.full(5, -7, np.int32)])
    out = call(problem, block_tables=(a, padded, c))
    assert np.array_equal(out, call(problem))


def test_subclasses_become_plain_arrays(problem):
    class Tagged(np.ndarray):
        pass

    out = call(problem, q=problem.q.view(Tagged), seq_lens=problem.seq_lens.view(Tagged))
    assert type(out) is np.ndarray
    assert np.array_equal(out, call(problem))


def test_kernel_backends_are_refused_until_built(problem):
    with pytest.raises(pagedkv.InvalidArgumentError, match="backend"):
        call(problem, "tpu")
