"""The environment check of `scripts/gpu_run.sh`: what the GPU run needs, found or not, in one JSON.

    python benches/gpu_env.py --out results/env.json            # on the GPU machine
    python benches/gpu_env.py --dry-run --out results/env.json  # on a CPU: GPU pieces optional

Required (exit 1 when missing): NumPy, pytest and hypothesis, the prebuilt
extension ``pagedkv._core`` imported from this checkout's ``python/pagedkv`` (not some installed
copy), and -- unless --dry-run -- CuPy with a CUDA device and libnvrtc. Reported, optional:
pytest-xdist (the tests run in parallel with it), PyTorch with CUDA and its flash SDPA backend
(the prefill baseline), FlashInfer. ``arch`` (e.g. ``sm_90``) is what the precompile stage
compiles for.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _version(module: str) -> str | None:
    try:
        return str(getattr(importlib.import_module(module), "__version__", "present"))
    except Exception:  # ImportError, or a broken install raising anything at import
        return None


def check(dry_run: bool) -> tuple[dict[str, Any], list[str]]:
    """(facts, problems): problems are the required pieces that are missing."""
    facts: dict[str, Any] = {"python": platform.python_version(), "dry_run": dry_run, "arch": "sm_90"}
    problems: list[str] = []
    for module in ("numpy", "pytest", "hypothesis"):
        facts[module] = _version(module)
        if facts[module] is None:
            problems.append(f"{module} is not importable")
    for module in ("xdist", "flashinfer"):
        facts[module] = _version(module)
    try:
        import pagedkv
        import pagedkv._core as core

        facts["pagedkv"] = pagedkv.__file__
        facts["extension"] = core.__file__
        # A dry run may use an installed pagedkv (CI tests the wheel); the device run must load
        # the extension carried into this checkout.
        if not dry_run and not Path(core.__file__).resolve().is_relative_to(REPO / "python" / "pagedkv"):
            problems.append(
                f"pagedkv._core comes from {core.__file__}, not this checkout: run with PYTHONPATH=python"
            )
    except Exception as error:  # the .so missing, or built for another platform
        problems.append(
            f"pagedkv._core does not import ({type(error).__name__}: {error}): build it on a CPU "
            "machine (docs/decode_kernel.md, section 5) and put _core.abi3.so in python/pagedkv/"
        )
    try:
        from pagedkv.kernels import nvrtc

        facts["nvrtc"] = ".".join(map(str, nvrtc.version()))
    except Exception as error:
        facts["nvrtc"] = None
        if not dry_run:
            problems.append(f"libnvrtc: {error}")
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
    except Exception as error:
        facts.setdefault("cupy", None)
        if not dry_run:
            problems.append(f"CuPy with a CUDA device: {type(error).__name__}: {error}")
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_cuda"] = bool(torch.cuda.is_available())
        facts["torch_flash_sdpa"] = bool(torch.backends.cuda.is_flash_attention_available())
    except Exception:
        facts.setdefault("torch", None)
    return facts, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="write the facts as JSON here")
    parser.add_argument("--dry-run", action="store_true", help="CPU machine: CuPy, a device, NVRTC optional")
    args = parser.parse_args(argv)
    facts, problems = check(args.dry_run)
    facts["problems"] = problems
    for key, value in facts.items():
        if key != "problems":
            print(f"{key}: {value}")
    for problem in problems:
        print(f"MISSING {problem}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(facts, indent=1))
        os.replace(tmp, out)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
