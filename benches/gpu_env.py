"""The setup stage of `scripts/gpu_run.sh`: what the GPU run needs, found or not, in one JSON.

    python benches/gpu_env.py --out setup.json            # on the GPU machine
    python benches/gpu_env.py --dry-run --out setup.json  # on a CPU: GPU pieces optional

Installs nothing (the device image has no package registry). Required (exit 1, and the last
line printed says what is missing, in one line): NumPy, pytest and hypothesis, pagedkv imported
from this checkout's ``python/`` (not some installed copy), and -- unless --dry-run -- a CUDA
driver, CuPy seeing a device, and libnvrtc compiling a kernel for that device's architecture.
Reported, not required: the prebuilt extension ``pagedkv._core`` (no kernel stage needs it:
pagedkv loads it on first use), and the installed versions of pytest-xdist (the tests run in
parallel with it), PyTorch (the baselines; not imported here: the benchmarks say what it can do)
and FlashInfer, and compute-sanitizer (the memcheck stage). ``arch`` (e.g. ``sm_90``) is what
the precompile stage compiles for, ``gpu`` the device's peaks from benches/gpu_specs.py (None
where the table does not list it: the benchmarks then measure them).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpu_specs import NOMINAL, GpuSpec, describe, lookup

REPO = Path(__file__).resolve().parents[1]
SANITIZER_DIRS = ("/usr/local/cuda/bin", "/usr/local/cuda/compute-sanitizer")


def _version(module: str) -> str | None:
    try:
        return str(getattr(importlib.import_module(module), "__version__", "present"))
    except Exception:  # ImportError, or a broken install raising anything at import
        return None


def _installed(distribution: str) -> str | None:
    """An optional package's installed version, without importing it (importing PyTorch takes
    seconds on a cold machine; the benchmarks that use it report what it can do)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, else where CUDA toolkits put it."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for folder in SANITIZER_DIRS:
        path = Path(folder) / "compute-sanitizer"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def _driver(facts: dict[str, Any]) -> str | None:
    """The driver's version (nvidia-smi, else CuPy's driver query), or None."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=15,
            )
            if out.returncode == 0 and out.stdout.strip():
                facts["nvidia_smi"] = out.stdout.strip().splitlines()
                return out.stdout.strip().splitlines()[0].split(",")[1].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        import cupy

        version = int(cupy.cuda.runtime.driverGetVersion())
        return f"CUDA {version // 1000}.{version % 1000 // 10}" if version else None
    except Exception:
        return None


def check(dry_run: bool) -> tuple[dict[str, Any], list[str]]:
    """(facts, problems): problems are the required pieces that are missing or broken."""
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "dry_run": dry_run,
        "arch": "sm_90",
        "gpu": asdict(NOMINAL) if dry_run else None,
    }
    problems: list[str] = []
    for module in ("numpy", "pytest", "hypothesis"):
        facts[module] = _version(module)
        if facts[module] is None:
            problems.append(f"{module} is not importable")
    for key, distribution in (
        ("xdist", "pytest-xdist"),
        ("flashinfer", "flashinfer-python"),
        ("torch", "torch"),
    ):
        facts[key] = _installed(distribution)
    try:
        import pagedkv

        facts["pagedkv"] = pagedkv.__file__
        # A dry run may use an installed pagedkv (CI tests the wheel); the device run must use
        # this checkout's sources.
        if not dry_run and not Path(pagedkv.__file__).resolve().is_relative_to(REPO / "python"):
            problems.append(f"pagedkv comes from {pagedkv.__file__}, not this checkout: PYTHONPATH=python")
    except Exception as error:
        problems.append(f"pagedkv does not import ({type(error).__name__}: {error})")
    try:
        import pagedkv._core as core

        facts["extension"] = core.__file__
    except Exception as error:  # missing, or built for another platform: only a note
        facts["extension"] = None
        facts["extension_error"] = f"{type(error).__name__}: {error}"[:300]
    facts["driver"] = _driver(facts)
    if facts["driver"] is None and not dry_run:
        problems.append("no CUDA driver (nvidia-smi and CuPy's driver query found none)")
    try:
        import cupy

        facts["cupy"] = cupy.__version__
        facts["devices"] = int(cupy.cuda.runtime.getDeviceCount())
        device = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(device.id)
        name = props["name"]
        facts["device"] = name.decode() if isinstance(name, bytes) else str(name)
        facts["arch"] = f"sm_{device.compute_capability}"
        facts["sms"] = int(device.attributes["MultiProcessorCount"])
        facts["memory_gib"] = round(int(props["totalGlobalMem"]) / 2**30, 1)
        spec = lookup(facts["device"])
        facts["gpu"] = None if spec is None else asdict(spec)
    except Exception as error:
        facts.setdefault("cupy", None)
        if not dry_run:
            problems.append(f"CuPy with a CUDA device: {type(error).__name__}: {error}")
    try:
        from pagedkv.kernels import instances, nvrtc

        facts["nvrtc"] = ".".join(map(str, nvrtc.version()))
        probe = instances.copy_blocks()  # the smallest instance: NVRTC knows this architecture
        nvrtc.compile_source(probe.source, [probe.name], facts["arch"])
        facts["nvrtc_compiles_for_arch"] = True
    except Exception as error:
        facts.setdefault("nvrtc", None)
        facts["nvrtc_compiles_for_arch"] = False
        if not dry_run:
            problems.append(
                f"NVRTC for {facts['arch']}: {type(error).__name__}: {str(error).splitlines()[0]}"
            )
    facts["compute_sanitizer"] = find_sanitizer()
    return facts, problems


def summary(facts: dict[str, Any], problems: list[str]) -> str:
    """The one line the device script shows for this stage."""
    if problems:
        return "SETUP FAILED: " + "; ".join(problems)
    gpu = facts.get("gpu")
    peaks = describe(GpuSpec(**gpu)) if gpu else "not in gpu_specs' table (the benchmarks measure them)"
    device = facts.get("device") or ("none (dry run)" if facts["dry_run"] else "?")
    extension = "loads" if facts.get("extension") else "does not load (not needed by the kernel stages)"
    return (
        f"setup ok: device {device}, {facts['arch']}, peaks {peaks}; CuPy {facts.get('cupy')}, "
        f"NVRTC {facts.get('nvrtc')}, torch {facts.get('torch')}, compute-sanitizer "
        f"{'found' if facts.get('compute_sanitizer') else 'absent'}, pagedkv._core {extension}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="write the facts as JSON here")
    parser.add_argument("--dry-run", action="store_true", help="CPU machine: driver, CuPy, NVRTC optional")
    args = parser.parse_args(argv)
    facts, problems = check(args.dry_run)
    facts["problems"] = problems
    for key, value in facts.items():
        if key != "problems":
            print(f"{key}: {value}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(facts, indent=1))
        os.replace(tmp, out)
    print(summary(facts, problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
