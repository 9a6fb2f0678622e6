"""NVRTC compiles every kernel template instance for sm_90 without warnings and (nearly) without
spills; the register/spill report is printed so regressions are visible in the CI log.

ptxas's default register heuristic (CUDA 13: --register-usage-level=5) may trade a few bytes of
spill for occupancy on an instance or two; SPILL_BUDGET_BYTES bounds that, so a real regression
(an array indexed dynamically, a loop no longer unrolled) still fails."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from pagedkv.errors import CudaUnavailableError, KernelCompileError, PagedKvError
from pagedkv.kernels import instances, nvrtc

try:
    nvrtc.load()
    NVRTC = True
except nvrtc.NvrtcUnavailable:
    NVRTC = False

SPILL_BUDGET_BYTES = 64

pytestmark = pytest.mark.skipif(not NVRTC, reason="libnvrtc not installed (pip install nvidia-cuda-nvrtc)")


def _chunks() -> list[tuple[str, list[str]]]:
    """One NVRTC program per (source, element type): parallel, and small enough to report well."""
    groups: dict[tuple[str, str], list[str]] = {}
    for inst in instances.all_instances():
        kind = next((k for k, t in instances.KERNEL_TYPES.items() if f"<{t}," in inst.name), "any")
        groups.setdefault((inst.source, kind), []).append(inst.name)
    return [(source, names) for (source, _), names in groups.items()]


def test_every_instance_compiles_for_sm90_clean(capsys):
    chunks = _chunks()
    with ThreadPoolExecutor(max_workers=2) as pool:  # NVRTC releases the GIL (ctypes)
        results = list(pool.map(lambda c: (c, nvrtc.compile_source(c[0], c[1])), chunks))
    rows = []
    for (source, names), result in results:
        assert result.warnings() == [], f"{source}: NVRTC/ptxas warnings:\n" + "\n".join(result.warnings())
        assert result.cubin_bytes > 0
        for name in names:
            mangled = result.lowered_names[name]
            res = result.resources.get(mangled)
            assert res is not None, f"no ptxas report for {name}"
            assert max(res.spill_stores_bytes, res.spill_loads_bytes) <= SPILL_BUDGET_BYTES, (
                f"{name} spills: {res}"
            )
            rows.append((name, res))
    assert len(rows) == len(instances.all_instances())
    with capsys.disabled():
        major, minor = nvrtc.version()
        print(f"\nNVRTC {major}.{minor}, {nvrtc.DEFAULT_ARCH}: registers / spill bytes / smem per instance")
        for name, res in rows:
            print(
                f"  {name:<70} regs={res.registers:>3} "
                f"spill={res.spill_stores_bytes}/{res.spill_loads_bytes} "
                f"smem={res.shared_bytes}"
            )


@pytest.mark.parametrize(
    "pick",
    [
        instances.decode("float16", 128, 16, 2),
        instances.decode("bfloat16", 128, 16, 8),  # the CUDA-core baseline of a tensor-core shape
        instances.decode_mma("float16", 128, 16),
        instances.decode_mma("bfloat16", 64, 1),
        instances.merge("bfloat16", 64),
        instances.write_kv("float32", 256),
        instances.copy_blocks(),
        instances.prefill("bfloat16", 128, 16),
    ],
)
def test_single_instance_programs_compile_clean(pick):
    """The cuda backend compiles one instance per program: that must be warning-free too."""
    result = nvrtc.compile_source(pick.source, [pick.name])
    assert result.warnings() == []


def test_compile_error_is_reported():
    with pytest.raises(nvrtc.NvrtcCompileError, match="paged_decode_kernel"):
        nvrtc.compile_source(instances.ATTENTION_SOURCE, ["pagedkv::paged_decode_kernel<float, 100, 16, 1>"])


def test_nvrtc_errors_are_pagedkv_errors() -> None:
    # One base class catches every error pagedkv raises on purpose (was RuntimeError).
    assert issubclass(nvrtc.NvrtcUnavailable, CudaUnavailableError)
    assert issubclass(nvrtc.NvrtcCompileError, KernelCompileError)
    for cls in (nvrtc.NvrtcUnavailable, nvrtc.NvrtcCompileError):
        assert issubclass(cls, PagedKvError) and not issubclass(cls, RuntimeError)
