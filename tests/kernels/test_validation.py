"""Every launcher rejects malformed input with InvalidArgumentError before anything runs."""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest
from pagedkv.attention import contiguous_attention, copy_blocks, paged_attention, swap_blocks, write_kv

from .conftest import make_problem, needs_cxx

BACKENDS = ["numpy", pytest.param("emulated", marks=needs_cxx)]


@pytest.fixture
def problem():
    return make_problem(np.random.default_rng(0), "float16", [20, 5], 2, 2, 128, 16)


def call(p, backend, **overrides):
    args = dict(q=p.q, k_cache=p.k_cache, v_cache=p.v_cache, block_tables=p.block_tables, seq_lens=p.seq_lens)
    args.update(overrides)
    return paged_attention(
        args["q"],
        args["k_cache"],
        args["v_cache"],
        args["block_tables"],
        args["seq_lens"],
        backend=backend,
        **{k: v for k, v in overrides.items() if k in ("scale",)},
    )


def test_unknown_backend(problem):
    with pytest.raises(pagedkv.InvalidArgumentError, match="backend"):
        call(problem, "tpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda p: dict(q=p.q[0]), "q must be"),
        (lambda p: dict(q=p.q.astype(np.float32)), "share one dtype"),
        (lambda p: dict(q=np.asfortranarray(p.q)), "C-contiguous"),
        (lambda p: dict(v_cache=p.v_cache[:, :8]), "v_cache shape"),
        (lambda p: dict(q=np.ascontiguousarray(p.q[:, :3])), "multiple of num_kv_heads"),
        (lambda p: dict(block_tables=p.block_tables.astype(np.int64)), "int32"),
        (lambda p: dict(seq_lens=p.seq_lens[:1]), "num_seqs"),
        (lambda p: dict(seq_lens=np.array([20, 999], np.int32)), "seq_lens must lie"),
        (lambda p: dict(seq_lens=np.array([-1, 5], np.int32)), "seq_lens must lie"),
        (
            lambda p: dict(
                block_tables=np.where(np.arange(p.block_tables.shape[1]) == 0, 10**6, p.block_tables).astype(
                    np.int32
                )
            ),
            r"block_tables\[0, 0\]",
        ),
        (
            lambda p: dict(
                block_tables=np.where(np.arange(p.block_tables.shape[1]) == 1, -1, p.block_tables).astype(
                    np.int32
                )
            ),
            r"block_tables\[0, 1\]",
        ),
        (lambda p: dict(q=p.q.tolist()), "arrays"),
        (lambda p: dict(scale=float("nan")), "finite"),
        (lambda p: dict(scale="big"), "real number"),
    ],
)
def test_paged_attention_rejects(problem, backend, mutate, match):
    with pytest.raises(pagedkv.InvalidArgumentError, match=match):
        call(problem, backend, **mutate(problem))


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_past_a_sequence_is_ignored(problem, backend):
    """Entries past a sequence's last block are never read: an out-of-range value there is
    accepted and gives exactly the output of the unpadded tables."""
    assert problem.seq_lens.tolist() == [20, 5] and problem.block_tables.shape[1] >= 2
    expected = call(problem, backend)
    tables = problem.block_tables.copy()
    tables[1, 1:] = 10**6  # sequence 1 has 5 tokens: one block
    padded = call(problem, backend, block_tables=tables)
    np.testing.assert_array_equal(padded, expected)
    # The check can fail: a table that moves sequence 1's one used block changes its output.
    moved = problem.block_tables.copy()
    moved[1, 0] = problem.block_tables[0, 0]
    assert not np.array_equal(call(problem, backend, block_tables=moved)[1], expected[1])


@needs_cxx
def test_kernel_backends_reject_what_they_do_not_compile():
    """(The cuda backend runs the same checks; its arrays must be CuPy's.)"""
    rng = np.random.default_rng(1)
    for kind, head_dim, block_size, group, match in [
        ("float64", 128, 16, 1, "not supported"),
        ("float16", 96, 16, 1, "head_dim 96"),
        ("float16", 128, 4, 1, "block_size 4"),
        ("float16", 64, 16, 16, "largest compiled group"),
    ]:
        p = make_problem(rng, kind, [3], 1, group, head_dim, block_size)
        with pytest.raises(pagedkv.InvalidArgumentError, match=match):
            paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="emulated")


def test_cuda_backend_takes_cupy_arrays_only(problem):
    with pytest.raises(pagedkv.InvalidArgumentError, match="CuPy"):
        call(problem, "cuda")


@needs_cxx
@pytest.mark.parametrize("splits", [0, -2, 1.5, True])
def test_num_splits_must_be_a_positive_int(problem, splits):
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_splits"):
        paged_attention(
            problem.q,
            problem.k_cache,
            problem.v_cache,
            problem.block_tables,
            problem.seq_lens,
            backend="emulated",
            num_splits=splits,
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_contiguous_attention_rejects(backend):
    q = np.zeros((4, 64), np.float32)
    k = np.zeros((3, 2, 64), np.float32)
    with pytest.raises(pagedkv.InvalidArgumentError, match="v shape"):
        contiguous_attention(q, k, k[:2], backend=backend)
    with pytest.raises(pagedkv.InvalidArgumentError, match="multiple"):
        contiguous_attention(q[:3], k, k, backend=backend)
    with pytest.raises(pagedkv.InvalidArgumentError, match="head_dim"):
        contiguous_attention(q, k[:, :, :32].copy(), k[:, :, :32].copy(), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "slots,match",
    [
        (np.array([0, 1, 2], np.int32), "int64"),
        (np.array([0, 1], np.int64), "entries for 3 tokens"),
        (np.array([0, 64, 1], np.int64), r"\[-1, 64\)"),
        (np.array([0, -2, 1], np.int64), r"\[-1, 64\)"),
        (np.array([5, 9, 5], np.int64), "one slot twice"),
    ],
)
def test_write_kv_rejects_and_changes_nothing(backend, slots, match):
    caches = [np.zeros((4, 16, 1, 64), np.float16) for _ in range(2)]
    k = np.ones((3, 1, 64), np.float16)
    with pytest.raises(pagedkv.InvalidArgumentError, match=match):
        write_kv(k, k, caches[0], caches[1], slots, backend=backend)
    assert not caches[0].any() and not caches[1].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_rejects_mismatched_tokens(backend):
    caches = [np.zeros((4, 16, 1, 64), np.float16) for _ in range(2)]
    with pytest.raises(pagedkv.InvalidArgumentError, match="k must be"):
        write_kv(
            np.ones((3, 2, 64), np.float16),
            np.ones((3, 2, 64), np.float16),
            caches[0],
            caches[1],
            np.arange(3, dtype=np.int64),
            backend=backend,
        )
    with pytest.raises(pagedkv.InvalidArgumentError, match="dtype"):
        write_kv(
            np.ones((3, 1, 64), np.float32),
            np.ones((3, 1, 64), np.float32),
            caches[0],
            caches[1],
            np.arange(3, dtype=np.int64),
            backend=backend,
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_rejects(backend):
    caches = [np.zeros((4, 16, 1, 64), np.float16) for _ in range(3)]
    good = np.array([[0, 1]], np.int32)
    cases = [
        ((caches[:1], caches[1:], good), "same layers"),
        ((caches[0], caches[1], good), "lists"),
        (([caches[0]], [caches[1]], np.array([[0, 4]], np.int32)), r"\[0, 4\)"),
        (([caches[0]], [caches[1]], np.array([0, 1], np.int32)), r"\[N, 2\]"),
        (([caches[0]], [caches[1]], good.astype(np.int64)), "int32"),
        (([caches[0]], [np.zeros((4, 16, 1, 64), np.float32)], good), "one shape and dtype"),
    ]
    for args, match in cases:
        with pytest.raises(pagedkv.InvalidArgumentError, match=match):
            copy_blocks(*args, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_swap_blocks_rejects(backend):
    src = np.zeros((4, 16, 1, 64), np.float16)
    dst = np.zeros((6, 16, 1, 64), np.float16)
    cases = [
        ((src, dst, np.array([[0, 1], [1, 1]], np.int32)), "destination block twice"),
        ((src, dst, np.array([[4, 1]], np.int32)), "source block ids"),
        ((src, dst, np.array([[0, 6]], np.int32)), "destination block ids"),
        ((src, src[2:], np.array([[0, 1]], np.int32)), "overlap"),
        ((src, np.zeros((6, 8, 1, 64), np.float16), np.array([[0, 1]], np.int32)), "block shape"),
        ((src, dst, np.array([[0, 1]], np.int64)), "int32"),
    ]
    for args, match in cases:
        with pytest.raises(pagedkv.InvalidArgumentError, match=match):
            swap_blocks(*args, backend=backend)


def test_import_pagedkv_does_not_import_cupy():
    import subprocess
    import sys

    code = "import sys, pagedkv, pagedkv.attention; assert 'cupy' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"
