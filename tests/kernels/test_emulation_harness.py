"""The CPU emulation harness itself: shuffles, masks, barriers, shared-memory poison, deadlocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pagedkv.kernels import emulation

from .conftest import needs_cxx

pytestmark = needs_cxx
HERE = Path(__file__).resolve().parent
PROBES = "harness_kernels.cu"


@pytest.fixture(scope="module", autouse=True)
def built():
    names = ["shuffle_probe", "block_sum_probe", "stale_shared_probe", "exited_lane_probe", "scalar_probe"]
    emulation.prebuild([(PROBES, f"pagedkv::{n}") for n in names], source_dir=HERE)


def probe(name: str, flags: tuple[str, ...] = ()) -> emulation.EmulatedKernel:
    return emulation.get_kernel(PROBES, f"pagedkv::{name}", source_dir=HERE, extra_flags=flags)


def test_shuffles_follow_cuda_semantics():
    out = np.full((64, 6), np.nan, np.float32)
    probe("shuffle_probe").launch((1, 1, 1), (64, 1, 1), [out])
    tid = np.arange(64)
    lane = tid % 32
    warp_base = tid - lane
    assert np.array_equal(out[:, 0], tid ^ 1)
    assert np.array_equal(out[:, 1], tid ^ 16)
    assert np.array_equal(out[:, 2], warp_base + 5)
    seg = lane // 8
    down = np.where((lane + 3) // 8 == seg, tid + 3, tid)  # past the 8-lane segment: own value
    assert np.array_equal(out[:, 3], down)
    assert np.array_equal(out[:, 4], np.where(lane >= 2, tid - 2, tid))
    # Two half-warp masks active at once, each exchanging within itself.
    assert np.array_equal(out[:, 5], np.where(lane < 16, tid ^ 4, (tid ^ 4) + 1000))


def test_barriers_and_shared_memory_across_blocks():
    out = np.full(5, np.nan, np.float32)
    probe("block_sum_probe").launch((5, 1, 1), (128, 1, 1), [out])
    expected = [sum(range(b * 128, b * 128 + 128)) for b in range(5)]
    assert np.array_equal(out, np.array(expected, np.float32))


def test_shared_memory_is_poisoned_between_blocks():
    out = np.zeros(64, np.float32)
    probe("stale_shared_probe").launch((2, 1, 1), (32, 1, 1), [out])
    assert np.all(out[:32] == 7.0)
    assert np.isnan(out[32:]).all(), "block 1 saw block 0's shared memory instead of poison"


def test_reading_an_exited_lane_gives_nan():
    out = np.zeros(32, np.float32)
    probe("exited_lane_probe").launch((1, 1, 1), (32, 1, 1), [out])
    assert np.isnan(out[:16]).all()
    assert np.all(out[16:] == -1.0)


def test_deadlock_is_reported_not_hung():
    out = np.zeros(32, np.float32)
    kernel = probe("deadlock_probe", ("-DPKV_EMU_TIMEOUT_S=2",))
    with pytest.raises(emulation.KernelLaunchError, match="deadlock"):
        kernel.launch((1, 1, 1), (32, 1, 1), [out])


def test_bad_launch_shape_is_an_error():
    with pytest.raises(emulation.KernelLaunchError, match="1..1024 threads"):
        probe("block_sum_probe").launch((1, 1, 1), (2048, 1, 1), [np.zeros(1, np.float32)])


def test_scalar_accesses_are_bounds_checked():
    out = np.zeros(1, np.float32)
    data = np.arange(4, dtype=np.float32)
    probe("scalar_probe").launch((1, 1, 1), (1, 1, 1), [out, data, np.int64(3)])
    assert out[0] == 3.0
    for index in (4, -1, 1 << 20):
        with pytest.raises(emulation.KernelLaunchError, match="out-of-bounds scalar load"):
            probe("scalar_probe").launch((1, 1, 1), (1, 1, 1), [out, data, np.int64(index)])
