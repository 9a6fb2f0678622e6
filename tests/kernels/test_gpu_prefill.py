"""The prefill kernel on a real GPU against the NumPy reference (skipped without CuPy and a GPU)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from pagedkv.attention import paged_prefill_attention
from pagedkv.kernels import instances

from .conftest import assert_close, cupy_and_gpu_marks, stable_seed
from .prefill_problems import make_prefill_problem
from .window_problems import poison_before_window, release_out_of_window

cupy, pytestmark = cupy_and_gpu_marks("backend='cuda' needs CuPy")

GRID = list(
    itertools.product(instances.PREFILL_KINDS, instances.PREFILL_HEAD_DIMS, instances.BLOCK_SIZES, (1, 3, 8))
)


@pytest.mark.parametrize("kind,head_dim,block_size,group", GRID)
@pytest.mark.parametrize("layout", ["padded", "csr"])
def test_prefill_matches_reference_every_instance(kind, head_dim, block_size, group, layout):
    rng = np.random.default_rng(stable_seed(kind, head_dim, block_size, group))
    # whole prompt, prefix-hit suffix over several K/V tiles, decode, idle row
    p = make_prefill_problem(rng, kind, [0, 150, 300, 7], [70, 33, 1, 0], 2, group, head_dim, block_size)
    q, k, v, tables, lens, qsl = p.args(layout)
    out = paged_prefill_attention(
        cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), tables, lens, qsl, backend="cuda"
    )
    assert_close(out.get(), paged_prefill_attention(q, k, v, tables, lens, qsl), kind)


@pytest.mark.parametrize("kind,head_dim,block_size,group", GRID)
@pytest.mark.parametrize("window", [3, 37, 1000])
def test_windowed_prefill_every_instance(kind, head_dim, block_size, group, window):
    """window=: released blocks NaN with table entry -1, the slots before the window NaN; both
    table layouts, with and without split-KV."""
    rng = np.random.default_rng(stable_seed("window", kind, head_dim, block_size, group, window))
    p = make_prefill_problem(rng, kind, [0, 150, 300, 7], [70, 33, 1, 0], 2, group, head_dim, block_size)
    release_out_of_window(p, window)
    expected = paged_prefill_attention(*p.args(), window=window)
    poison_before_window(p, window)
    for layout in ("padded", "csr"):
        q, k, v, tables, lens, qsl = p.args(layout)
        for splits in (None, 4):
            out = paged_prefill_attention(
                cupy.asarray(q),
                cupy.asarray(k),
                cupy.asarray(v),
                tables,
                lens,
                qsl,
                backend="cuda",
                num_splits=splits,
                window=window,
            )
            assert_close(out.get(), expected, kind)


def test_long_prompt_and_device_metadata():
    rng = np.random.default_rng(9)
    p = make_prefill_problem(rng, "bfloat16", [300], [200], 2, 8, 128, 16)
    q, k, v, tables, lens, qsl = p.args()
    out = paged_prefill_attention(*(cupy.asarray(a) for a in (q, k, v, tables, lens, qsl)), backend="cuda")
    assert_close(out.get(), paged_prefill_attention(q, k, v, tables, lens, qsl), "bfloat16")


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_split_kv_on_device(num_splits):
    # decode-heavy: 16 decode rows and one suffix over long contexts, group 8
    rng = np.random.default_rng(11)
    p = make_prefill_problem(rng, "float16", [700] * 16 + [500], [1] * 16 + [40], 2, 8, 128, 16)
    q, k, v, tables, lens, qsl = p.args("csr")
    out = paged_prefill_attention(
        cupy.asarray(q),
        cupy.asarray(k),
        cupy.asarray(v),
        tables,
        lens,
        qsl,
        backend="cuda",
        num_splits=num_splits,
    )
    assert_close(out.get(), paged_prefill_attention(q, k, v, tables, lens, qsl), "float16")
