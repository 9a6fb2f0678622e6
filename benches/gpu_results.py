"""The one results file of `scripts/gpu_run.sh`: each stage folded in as it ends.

    python benches/gpu_results.py init --results R.json --stages setup,precompile,... [--dry-run]
    python benches/gpu_results.py stage --results R.json --name decode --exit 0 --seconds 93 \\
        --limit 115 --log decode.log [--junit decode.xml] [--json decode.json] [--note TEXT]
    python benches/gpu_results.py skip --results R.json --name sanitizer --note "why"
    python benches/gpu_results.py finish --results R.json --seconds 431
    python benches/gpu_results.py show --results R.json

The device run brings back only a few files from its output folder, so everything goes into
this JSON (next to it, the run's whole console log): per stage its status (``passed``,
``failed``, ``timed out``, ``skipped``), exit code, seconds and limit, the tail of its log, its
JUnit XML folded into counts and the failing tests' messages, and its own JSON result (a
benchmark's points so far: the benchmarks rewrite their JSON after every point, so a stage cut
off by its time limit still contributes all it finished). The file is rewritten atomically after
every stage; ``complete`` turns true only at ``finish``. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

SCHEMA = "pagedkv-gpu-run/1"
LOG_TAIL_LINES = 60
MESSAGE_CHARS = 1500
TIMED_OUT = (124, 137)  # timeout(1): the limit passed; 137: killed after the grace period


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def save(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


def status_of(exit_code: int) -> str:
    if exit_code == 0:
        return "passed"
    return "timed out" if exit_code in TIMED_OUT else "failed"


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts and the failing or erroring test cases of a JUnit XML file (pytest's)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as error:
        return {"unreadable": f"{type(error).__name__}: {error}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {
        key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")
    }
    failed = []
    for case in root.iter("testcase"):
        for outcome in ("failure", "error"):
            node = case.find(outcome)
            if node is not None:
                text = (node.get("message") or "") + "\n" + (node.text or "")
                failed.append(
                    {
                        "test": f"{case.get('classname', '')}::{case.get('name', '')}",
                        "outcome": outcome,
                        "message": text.strip()[:MESSAGE_CHARS],
                    }
                )
    return {**counts, "failed": failed}


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def stage_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:  # cut off mid-write cannot happen (atomic), but say so
        return {"unreadable": f"{type(error).__name__}: {error}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=("init", "stage", "skip", "finish", "show"))
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--stages", default="")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--budget-s", type=float)
    parser.add_argument("--kill-after-s", type=float)
    parser.add_argument("--name")
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--limit", type=float, default=0.0)
    parser.add_argument("--log", type=Path)
    parser.add_argument("--junit", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)

    if args.command == "init":
        save(
            args.results,
            {
                "schema": SCHEMA,
                "dry_run": args.dry_run,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "stages_planned": [s for s in args.stages.split(",") if s],
                "budget_s": args.budget_s,
                "kill_after_s": args.kill_after_s,
                "gpu": None,
                "stages": [],
                "complete": False,
            },
        )
        return 0
    payload = load(args.results)
    if args.command in ("stage", "skip"):
        record: dict[str, Any] = {
            "name": args.name,
            "status": "skipped" if args.command == "skip" else status_of(args.exit),
            "exit": None if args.command == "skip" else args.exit,
            "seconds": args.seconds,
            "limit_s": args.limit,
            "note": args.note,
        }
        if args.junit is not None and args.junit.is_file():
            record["junit"] = junit_summary(args.junit)
        if args.json is not None:
            record["result"] = stage_json(args.json)
            if args.name == "setup" and isinstance(record["result"], dict):
                payload["gpu"] = record["result"].get("gpu")
                payload["device"] = record["result"].get("device")
        if args.log is not None:
            record["log_tail"] = log_tail(args.log)
        payload["stages"].append(record)
        save(args.results, payload)
        return 0
    if args.command == "finish":
        payload["elapsed_s"] = args.seconds
        payload["complete"] = True
        save(args.results, payload)
        return 0
    # show: one line per stage
    print(f"{'stage':<12} {'status':<10} {'exit':>4} {'seconds':>7} {'limit':>5}  note")
    for s in payload["stages"]:
        junit = s.get("junit") or {}
        tests = f" [{junit.get('tests', 0)} tests, {len(junit.get('failed', []))} failed]" if junit else ""
        exit_code = "-" if s["exit"] is None else s["exit"]
        print(
            f"{s['name']:<12} {s['status']:<10} {exit_code:>4} {s['seconds']:>7.0f} {s['limit_s']:>5.0f}  "
            f"{s['note']}{tests}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
