"""Sliding-window attention (``window=``) in the decode and prefill kernels, run on the CPU through
the emulation harness, against the NumPy reference (conftest.TOLERANCE).

Every case releases what a sliding-window KV group would: each block wholly before the window of
a sequence's first query is NaN and its table entry -1. The kernel runs then also get NaN in every
slot before that first visible key (slots of the first visible block included, which the NumPy
reference gathered before), so a kernel that loads or fails to mask any key before the window
shows NaN, and one that reads a -1 entry reads outside the cache (the harness's bounds check).
Windows: smaller than a block, not a multiple of the block size, larger than the context.
Shapes stay small (every emulated launch runs 128 real threads on the CI's 2 cores) and reuse the
instances the other emulated tests build.
"""

from __future__ import annotations

import numpy as np
import pytest
from pagedkv.attention import paged_attention, paged_prefill_attention, split_planning
from pagedkv.attention import prefill_validation as pval
from pagedkv.attention.prefill_launch import plan
from pagedkv.attention.runners import get_runner
from pagedkv.kernels import emulation, instances

from .conftest import assert_close, needs_cxx
from .prefill_problems import PrefillProblem, make_prefill_problem
from .window_problems import poison_before_window, release_out_of_window

pytestmark = needs_cxx

# (kind, head_dim, block_size, group): decode cases. Group 1 and fp32 run the CUDA-core kernel;
# groups 4/5 at fp16/bf16 the tensor-core kernel, whose loop starts at the first visible key's
# block (block 8 or 1, tile 64 or 32 tokens) and masks the keys before it.
DECODE = [
    ("float16", 128, 16, 1),
    ("float32", 64, 1, 1),
    ("float16", 64, 8, 4),
    ("bfloat16", 128, 1, 5),
]
# (kind, head_dim, block_size): prefill cases (their merge instance: float16 64).
PREFILL = [("bfloat16", 64, 8), ("float16", 128, 16), ("float16", 64, 1)]
WINDOWS = [3, 13, 500]  # < a block, not a multiple of the block sizes, > every context


@pytest.fixture(scope="module", autouse=True)
def built():
    out = []
    for kind, head_dim, block_size, group in DECODE:
        out += [instances.decode_for(kind, head_dim, block_size, group), instances.merge(kind, head_dim)]
    out += [instances.prefill(*case) for case in PREFILL] + [instances.merge_prefill("float16", 64)]
    emulation.prebuild([(i.source, i.name) for i in out], jobs=2)


def decode_problem(kind, head_dim, block_size, group, seq_lens, window, seed):
    p = make_prefill_problem(
        np.random.default_rng(seed),
        kind,
        [n - 1 for n in seq_lens],
        [1] * len(seq_lens),
        1,
        group,
        head_dim,
        block_size,
    )
    release_out_of_window(p, window)
    return p


def decode(p: PrefillProblem, window: int, backend: str, **kwargs):
    paged = p.paged
    return paged_attention(
        p.q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        p.seq_lens,
        window=window,
        backend=backend,
        **kwargs,
    )


@pytest.mark.parametrize("case", DECODE, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_decode_matches_the_reference(case, window):
    kind = case[0]
    # Long enough for released blocks and, at the tensor-core tile of 64 / 32 keys, a window
    # starting mid-tile; num_splits=2 cuts the window's keys (not the context) into two splits.
    p = decode_problem(*case, [70, 9, 40], window, seed=window)
    ref = decode(p, window, "numpy")
    poison_before_window(p, window)
    for splits in (1, 2):
        out = decode(p, window, "emulated", num_splits=splits)
        assert_close(out, ref, kind)


@pytest.mark.parametrize("case", PREFILL, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_prefill_matches_the_reference(case, window):
    kind, head_dim, block_size = case
    # GQA group 3: a 64-row tile packs ~21 tokens, so later rows of a tile see fewer early keys
    # (per-row masking); a prefix-hit suffix, a whole prompt, a decode row and an empty row.
    p = make_prefill_problem(
        np.random.default_rng(window), kind, [40, 0, 61, 7], [12, 30, 1, 0], 1, 3, head_dim, block_size
    )
    release_out_of_window(p, window)
    ref = paged_prefill_attention(*p.args(), window=window)
    poison_before_window(p, window)
    for layout in ("padded", "csr"):
        out = paged_prefill_attention(*p.args(layout), window=window, backend="emulated")
        assert_close(out, ref, kind)
    if case == ("float16", 64, 1):  # split-KV over the window, then the merge
        out = paged_prefill_attention(*p.args(), window=window, backend="emulated", num_splits=2)
        assert_close(out, ref, kind)


def test_split_planning_counts_only_visible_keys():
    # A 100k-token context under a 4096-key window plans like a 4096 + tile - 1 key context.
    assert split_planning.visible_tokens(100_000, 4096, 64) == 4096 + 63
    assert split_planning.visible_tokens(100, 4096, 64) == 100
    assert split_planning.visible_tokens(100_000, None, 64) == 100_000
    p = make_prefill_problem(np.random.default_rng(0), "float16", [4000], [2], 1, 1, 64, 1)
    args = pval.check_paged_prefill(*p.args(), None, True, "emulated", 16)
    windowed = plan(get_runner("emulated"), args, None, 16)
    full = plan(get_runner("emulated"), args, None, None)
    assert windowed is not None and full is not None
    # The emulated runner's 2 SMs want 4 CTAs: the full context splits, the 17 visible keys not.
    assert windowed.grid[0] == 1 and full.grid[0] > 1
