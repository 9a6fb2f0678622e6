"""vLLM's own unit tests on pagedkv's KV-cache manager.

Runs test files of vLLM 0.33's source distribution (``tests/v1/core``, unpacked by
scripts/vllm/env.sh) with the manager substituted by ``pagedkv_manager_plugin`` and checks that
every test in the expected pass set (``expected/<file>.txt``: the tests that pass offline on a CPU
with vLLM's own manager) passes on pagedkv's too. Tests outside that set need what this machine
does not have (models from the hub, Triton, multimodal processors) and are deselected by name.

    python own_tests.py --venv VENV                      # pagedkv's manager (the test command)
    python own_tests.py --venv VENV --record             # vLLM's own: rewrite expected/*.txt
    python own_tests.py --venv VENV --record-pagedkv     # pagedkv's: rewrite expected/pagedkv_*.txt

The check: every test of ``expected/pagedkv_<file>.txt`` (the floor: what passed on pagedkv's
manager when it was recorded, a subset of vLLM's pass set) passes, so the pass set cannot silently
shrink; the tests of vLLM's pass set outside the floor are listed (docs/integrations/vllm.md says
why each group fails: KV connectors and the other optional paths pagedkv's manager refuses).

Run it with the vLLM venv's Python and pagedkv importable (scripts/vllm/stage.sh does both).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "expected"
# vLLM's test files this runs, relative to its tests/v1/core.
# test_prefix_caching.py: most of its tests build the manager directly and many read vLLM's
# internals (block pool, free queue, per-group request maps) or need a group kind pagedkv's manager
# refuses; docs/integrations/vllm.md lists the groups that do not pass and why.
FILES = ("test_scheduler.py", "test_prefix_caching.py")


def _outcomes(junit: Path) -> dict[str, str]:
    """Test name -> passed / failed / skipped, from a JUnit XML report."""
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            outcome = "failed"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        result[case.get("name", "")] = outcome
    return result


def _run(venv: Path, tests_root: Path, file: str, manager: str, selected: set[str] | None) -> dict[str, str]:
    """Runs one vLLM test file with `manager` substituted; returns each test's outcome."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # The hub names some tests use resolve to local folders holding only their config.json.
        shutil.copytree(HERE / "models", work, dirs_exist_ok=True)
        (work / "tests").symlink_to(tests_root)
        junit = work / "junit.xml"
        env = dict(os.environ)
        env["PAGEDKV_VLLM_MANAGER"] = manager
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
        cmd = [
            str(venv / "bin" / "python"),
            "-m",
            "pytest",
            "-q",
            # One line per failure: formatting the full tracebacks of the tests pagedkv's manager
            # refuses costs more than running them.
            "--tb=line",
            "-p",
            "pagedkv_manager_plugin",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            f"tests/v1/core/{file}",
        ]
        if selected is not None:
            # Select by keyword would match substrings; deselect the others by node id instead.
            collected = subprocess.run(
                [*cmd[:3], "--collect-only", "-q", "-p", "pagedkv_manager_plugin", f"tests/v1/core/{file}"],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                check=False,
            ).stdout.splitlines()
            for node in collected:
                name = node.rpartition("::")[2]
                if "::" in node and name not in selected:
                    cmd.append(f"--deselect={node}")
        subprocess.run(cmd, cwd=work, env=env, check=False)
        return _outcomes(junit)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--venv", type=Path, required=True, help="the vLLM venv (scripts/vllm/env.sh)")
    parser.add_argument("--record", action="store_true", help="run vLLM's own manager, rewrite expected/")
    parser.add_argument(
        "--record-pagedkv", action="store_true", help="run pagedkv's manager, rewrite expected/pagedkv_*"
    )
    parser.add_argument("--file", choices=FILES, help="only this test file (default: all)")
    args = parser.parse_args()
    tests_root = args.venv.parent / "tests"
    failed = False
    for file in (args.file,) if args.file else FILES:
        expected_file = EXPECTED / (file.removesuffix(".py") + ".txt")
        if args.record:
            outcomes = _run(args.venv, tests_root, file, "vllm", None)
            passed = sorted(name for name, outcome in outcomes.items() if outcome == "passed")
            EXPECTED.mkdir(exist_ok=True)
            header = f"# {file}: the tests that pass with vLLM's own KVCacheManager offline on a CPU\n"
            expected_file.write_text(header + "".join(f"{name}\n" for name in passed))
            print(f"{file}: {len(passed)} of {len(outcomes)} pass with vLLM's manager -> {expected_file}")
            continue
        expected = {
            line for line in expected_file.read_text().splitlines() if line and not line.startswith("#")
        }
        outcomes = _run(args.venv, tests_root, file, "pagedkv", expected)
        passed = {name for name, outcome in outcomes.items() if outcome == "passed"}
        floor_file = EXPECTED / ("pagedkv_" + file.removesuffix(".py") + ".txt")
        if args.record_pagedkv:
            header = (
                f"# {file}: the tests (of vLLM's pass set) that pass with pagedkv's KVCacheManager; "
                "a floor own_tests.py checks\n"
            )
            floor_file.write_text(header + "".join(f"{name}\n" for name in sorted(passed & expected)))
        floor = {line for line in floor_file.read_text().splitlines() if line and not line.startswith("#")}
        missing = sorted(name for name in expected if name not in passed)
        print(
            f"{file}: {len(expected) - len(missing)} of the {len(expected)} tests that pass on "
            f"vLLM's manager pass on pagedkv's (floor: {len(floor)})"
        )
        for name in missing:
            print(f"  not passed on pagedkv: {name} ({outcomes.get(name, 'not run')})")
        regressed = sorted(floor - passed)
        for name in regressed:
            print(f"  REGRESSED (in the floor, not passed): {name} ({outcomes.get(name, 'not run')})")
        failed |= bool(regressed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
