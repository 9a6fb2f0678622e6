"""The GPU a benchmark runs on and the peaks its results are reported against.

Peaks come from a table of datasheet figures keyed by the device name CUDA reports: HBM bandwidth
and the dense (no sparsity) fp16/bf16 tensor-core rate with fp32 accumulation. A GPU the table
does not know is reported against what the run measures on it instead (``source="measured"``: a
device-to-device copy for bandwidth, a cuBLAS fp16 matrix product for FLOP/s), so every "% of
peak" names what it is a percentage of. A dry run (no GPU) assumes the GPU the device script
expects, ``NOMINAL`` (``source="assumed"``).

Imported by the GPU benchmarks and the setup check (run as scripts: this folder is on the path).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_bytes_per_s: float | None  # HBM, read + write
    peak_flops: float | None  # dense fp16/bf16 tensor-core multiply-adds x 2, fp32 accumulate
    num_sms: int | None = None
    source: str = "table"  # table | measured | assumed (a dry run's NOMINAL)


# (pattern over the CUDA device name, spec); the first match wins, so the variants come before
# their family. "NVIDIA H100 80GB HBM3" is the SXM part; \b keeps "GH200" from matching "H200".
TABLE: tuple[tuple[str, GpuSpec], ...] = (
    (r"\bH100\b.*\bPCIe\b", GpuSpec("H100 PCIe", 2.0e12, 756e12, 114)),
    (r"\bH100\b.*\bNVL\b", GpuSpec("H100 NVL", 3.9e12, 835e12, 132)),
    (r"\bH100\b", GpuSpec("H100 SXM", 3.35e12, 989e12, 132)),
    (r"\bH200\b.*\bNVL\b", GpuSpec("H200 NVL", 4.8e12, 835e12, 132)),
    (r"\bH200\b", GpuSpec("H200 SXM", 4.8e12, 989e12, 132)),
)

NOMINAL = replace(TABLE[2][1], source="assumed")  # the GPU the device script is written for


def lookup(device_name: str) -> GpuSpec | None:
    """The table's spec for a CUDA device name, or None for a GPU it does not list."""
    for pattern, spec in TABLE:
        if re.search(pattern, device_name, re.IGNORECASE):
            return spec
    return None


def measured(
    device_name: str, num_sms: int, copy_bytes_per_s: float | None, flops: float | None = None
) -> GpuSpec:
    """The spec of a GPU the table does not list: its own measured copy bandwidth and FLOP/s."""
    return GpuSpec(device_name, copy_bytes_per_s, flops, num_sms, source="measured")


def describe(spec: GpuSpec) -> str:
    """One line: name, peaks and where they come from."""
    bandwidth = "?" if spec.peak_bytes_per_s is None else f"{spec.peak_bytes_per_s / 1e12:.2f} TB/s"
    flops = "?" if spec.peak_flops is None else f"{spec.peak_flops / 1e12:.0f} TFLOP/s"
    return f"{spec.name}: {bandwidth}, {flops} dense fp16/bf16 ({spec.source})"
