"""The tensor-core switch of the decode kernel: ``use_tensor_cores`` on paged_attention and
DecodeWorkspace (None: the launcher's rule, True: the tensor-core kernel or an error, False: the
CUDA-core kernel), run on the CPU through the emulation harness against the NumPy reference.

Every launch is recorded (EmulatedRunner.launch wrapped), so each test checks which kernel
actually ran, not only what the instance-selection function says. Problems come from
conftest.make_problem: unused cache slots are NaN and table padding names NaN blocks or -1.
"""

from __future__ import annotations

import numpy as np
import pytest
from pagedkv.attention import DecodeWorkspace, paged_attention
from pagedkv.attention import validation as val
from pagedkv.attention.kernel_launch import decode_instance
from pagedkv.attention.runners import EmulatedRunner
from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels import emulation, instances

from .conftest import KIND_DTYPES, assert_close, make_problem, needs_cxx, stable_seed

pytestmark = needs_cxx

# (kind, head_dim, block_size, group, seq_lens, num_kv_heads): group instances 4 and 8, where
# the launcher's default is the tensor-core kernel. The tensor-core instances are the ones
# test_emulated_decode_mma.py builds (shared build cache).
CASES = [
    ("float16", 64, 8, 4, [130, 5, 0], 1),
    ("bfloat16", 64, 32, 8, [77, 12], 2),
]


def _instances():
    out = []
    for kind, head_dim, block_size, group, _, _ in CASES:
        for use in (False, True):
            out.append(instances.decode_for(kind, head_dim, block_size, group, use))
        out.append(instances.merge(kind, head_dim))
    return [(i.source, i.name) for i in out]


@pytest.fixture(scope="module", autouse=True)
def built():
    emulation.prebuild(_instances())


@pytest.fixture
def launched(monkeypatch):
    """Names of the decode instances launched during the test, in order."""
    names: list[str] = []
    original = EmulatedRunner.launch

    def record(self, instance, grid, block, args, reachable=()):
        if "decode" in instance.name:
            names.append(instance.name)
        return original(self, instance, grid, block, args, reachable)

    monkeypatch.setattr(EmulatedRunner, "launch", record)
    return names


def _shape(kind: str, head_dim: int, group: int, use: bool | None) -> val.AttentionShape:
    return val.AttentionShape(1, group, 1, head_dim, 16, 4, 1, group, kind, 1.0, use_tensor_cores=use)


@pytest.mark.parametrize("kind", ["float16", "bfloat16", "float32"])
def test_instance_selection_follows_the_switch(kind):
    for head_dim in instances.HEAD_DIMS:
        for group in range(1, instances.MAX_GROUP + 1):
            tc_possible = kind != "float32" and 3 <= group <= 8
            cuda_core = f"pagedkv::paged_decode_kernel<{instances.KERNEL_TYPES[kind]}, {head_dim}, 16, "
            assert decode_instance(_shape(kind, head_dim, group, False)).name.startswith(cuda_core)
            default = decode_instance(_shape(kind, head_dim, group, None)).name
            assert ("paged_decode_mma_kernel" in default) == tc_possible, (group, default)
            if tc_possible:
                assert decode_instance(_shape(kind, head_dim, group, True)).name == default
            else:
                with pytest.raises(ValueError):
                    decode_instance(_shape(kind, head_dim, group, True))


def test_both_paths_are_compiled():
    """Every instance either setting can launch is in all_instances (what NVRTC compiles)."""
    compiled = {i.name for i in instances.all_instances()}
    for kind in instances.KERNEL_TYPES:
        for head_dim in instances.HEAD_DIMS:
            for block_size in instances.BLOCK_SIZES:
                for group in range(1, instances.MAX_GROUP + 1):
                    for use in (None, False, True):
                        if use and not instances.uses_tensor_cores(kind, head_dim, group):
                            continue
                        name = instances.decode_for(kind, head_dim, block_size, group, use).name
                        assert name in compiled, name


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-d{c[1]}-bs{c[2]}-g{c[3]}" for c in CASES])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_cuda_core_path_matches_reference(case, num_splits, launched):
    kind, head_dim, block_size, group, seq_lens, num_kv_heads = case
    rng = np.random.default_rng(stable_seed(case[:4], num_splits, "cuda-core"))
    p = make_problem(rng, kind, seq_lens, num_kv_heads, group, head_dim, block_size)
    expected = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="numpy")
    args = (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
    out = paged_attention(*args, backend="emulated", num_splits=num_splits, use_tensor_cores=False)
    assert launched == [instances.decode(kind, head_dim, block_size, group).name]
    assert out.dtype == p.q.dtype and out.shape == p.q.shape
    assert_close(out, expected, kind)
    # The default and True run the tensor-core kernel on the same problem, with the same result
    # within the tolerance.
    for use in (None, True, np.bool_(True)):
        launched.clear()
        out = paged_attention(*args, backend="emulated", num_splits=num_splits, use_tensor_cores=use)
        assert launched == [instances.decode_mma(kind, head_dim, block_size).name], use
        assert_close(out, expected, kind)


def _workspace(p, kind, head_dim, block_size, group, num_kv_heads, use):
    return DecodeWorkspace(
        num_blocks=int(p.k_cache.shape[0]),
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        num_q_heads=num_kv_heads * group,
        head_dim=head_dim,
        dtype=KIND_DTYPES[kind],
        max_num_seqs=4,
        max_blocks_per_seq=int(p.block_tables.shape[1]),
        backend="emulated",
        split_bytes=1 << 20,
        use_tensor_cores=use,
    )


@pytest.mark.parametrize("use", [False, True, None])
def test_workspace_runs_the_chosen_kernel(use, launched):
    kind, head_dim, block_size, group, seq_lens, num_kv_heads = CASES[1]
    rng = np.random.default_rng(stable_seed("workspace", use))
    p = make_problem(rng, kind, seq_lens, num_kv_heads, group, head_dim, block_size)
    ws = _workspace(p, kind, head_dim, block_size, group, num_kv_heads, use)
    wanted = instances.decode_for(kind, head_dim, block_size, group, use)
    assert ws.instance == wanted
    assert ("mma" in wanted.name) == (use is not False)
    ws.plan(p.block_tables, p.seq_lens, num_splits=2)
    out = ws.run(p.q, p.k_cache, p.v_cache)
    assert launched == [wanted.name]
    expected = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="numpy")
    assert_close(out, expected, kind)


# (kind, group): the tensor-core kernel cannot run fp32 caches, nor fewer than 3 query heads per
# KV head.
IMPOSSIBLE = [("float32", 4), ("float32", 8), ("float16", 1), ("bfloat16", 2)]


@pytest.mark.parametrize("kind,group", IMPOSSIBLE)
def test_forcing_tensor_cores_where_impossible_raises(kind, group, launched):
    rng = np.random.default_rng(3)
    p = make_problem(rng, kind, [20], 1, group, 64, 8)
    with pytest.raises(InvalidArgumentError, match="use_tensor_cores=True"):
        paged_attention(
            p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="emulated", use_tensor_cores=True
        )
    with pytest.raises(InvalidArgumentError, match="use_tensor_cores=True"):
        _workspace(p, kind, 64, 8, group, 1, True)
    assert launched == []


@pytest.mark.parametrize("bad", [1, 0, "true", 1.0, np.array(True), np.int32(1), [True]])
@pytest.mark.parametrize("backend", ["numpy", "emulated"])
def test_use_tensor_cores_must_be_a_bool_or_none(bad, backend, launched):
    rng = np.random.default_rng(4)
    p = make_problem(rng, "float16", [9], 1, 4, 64, 8)
    with pytest.raises(InvalidArgumentError, match="use_tensor_cores must be True, False or None"):
        paged_attention(
            p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend=backend, use_tensor_cores=bad
        )
    if backend == "emulated":
        with pytest.raises(InvalidArgumentError, match="use_tensor_cores must be True, False or None"):
            _workspace(p, "float16", 64, 8, 4, 1, bad)
    assert launched == []


def test_numpy_bools_are_accepted():
    assert val.check_use_tensor_cores(np.bool_(False)) is False
    assert val.check_use_tensor_cores(np.True_) is True
    assert val.check_use_tensor_cores(None) is None
