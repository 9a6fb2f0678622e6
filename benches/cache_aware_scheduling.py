"""Cache-aware scheduling in the simulator: FCFS, LPM and DFS on four prefix-sharing workloads,
each with a KV pool that cannot hold all of its distinct prefix blocks, against the offline
optimum (docs/scheduling.md).

    python benches/cache_aware_scheduling.py --json OUT.json [--quick]

Rows: every workload under every policy with all requests waiting at once (``saturated``: the
regime where the admission order is a real choice), and with the workload's own arrival times
(``trace``); then the aging bound swept on the workload that needs the most reordering. Columns:
the token hit rate (prompt tokens served from the prefix cache at first admission), the optimum,
their ratio, prefill tokens and those saved against FCFS, p99 wait and the aging bound converted
to seconds (bound x the FCFS run's seconds per admission), the most admissions that passed over
one request, admissions the bound forced. ``--quick`` cuts the Mooncake traces to 800 requests.
Simulated time: read every number as a property of the schedule, not of this machine.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagedkv.sim import builders
from pagedkv.sim.engine import SimConfig, Workload, simulate

# workload -> (block size, KV pool slots). Each pool holds a small share of the workload's distinct
# prefix tokens (printed per row as "pool / distinct").
SETUPS: dict[str, tuple[int, int]] = {
    "system-prompt": (16, 8_192),
    "many-tenants": (16, 32_768),
    "mooncake-conversation": (64, 262_144),
    "mooncake-synthetic": (64, 262_144),
}
POLICIES = ("fcfs", "lpm", "dfs")
AGING_SWEEP = (0, 256, 512, 1024, 2048, 4096)
SWEEP_WORKLOAD = "mooncake-synthetic"


def _workload(name: str, quick: bool) -> Workload:
    num = 800 if quick and name.startswith("mooncake") else (2000 if name == "many-tenants" else None)
    return builders.build_workload(name, num_requests=num)


def _config(workload: Workload, name: str, policy: str, arrival: str, aging_bound: int) -> SimConfig:
    block_size, num_slots = SETUPS[name]
    return builders.build_config(
        workload,
        synthetic=name in builders.SYNTHETIC_WORKLOADS,
        block_size=block_size,
        num_slots=num_slots,
        enable_prefix_caching=True,
        arrival=arrival,
        scheduling=policy,
        aging_bound=aging_bound,
    )


def _distinct_prefix_tokens(workload: Workload, name: str) -> int:
    if workload.block_ids is not None:
        return len(set(workload.block_ids.tolist())) * workload.block_tokens
    assert workload.prefix_id is not None and workload.prefix_tokens is not None
    return sum(dict(zip(workload.prefix_id.tolist(), workload.prefix_tokens.tolist(), strict=True)).values())


def _row(name: str, arrival: str, policy: str, bound: int, result: Any, fcfs: Any, wall_s: float) -> dict:
    seconds_per_admission = fcfs.simulated_seconds / max(1, fcfs.finished_requests)
    return {
        "workload": name,
        "arrival": arrival,
        "policy": policy,
        "aging_bound": bound,
        "token_hit_rate": result.token_hit_rate,
        "optimal_token_hit_rate": result.optimal_token_hit_rate,
        "hit_rate_of_optimum": result.hit_rate_of_optimum,
        "prefill_tokens": result.prefill_tokens,
        "prefill_tokens_saved_vs_fcfs": fcfs.prefill_tokens - result.prefill_tokens,
        "p99_wait_s": result.p99_wait_s,
        "fcfs_p99_wait_s": fcfs.p99_wait_s,
        "aging_bound_s": bound * seconds_per_admission,
        "max_passed_over": result.max_passed_over,
        "forced_admissions": result.forced_admissions,
        "evicted_wanted_blocks": result.evicted_wanted_blocks,
        "finished_requests": result.finished_requests,
        "simulated_seconds": result.simulated_seconds,
        "wall_s": wall_s,
    }


def _run(workload: Workload, config: SimConfig) -> tuple[Any, float]:
    start = time.perf_counter()
    result = simulate(workload, config)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--aging-bound", type=int, default=2048)
    args = parser.parse_args()
    rows: list[dict] = []
    for name in SETUPS:
        workload = _workload(name, args.quick)
        distinct = _distinct_prefix_tokens(workload, name)
        pool = SETUPS[name][1]
        share = f"{pool / distinct:.1%} of {distinct:,} distinct prefix tokens"
        print(f"{name}: {workload.num_requests} requests, pool {pool:,} slots = {share}", flush=True)
        for arrival in ("saturated", "trace"):
            fcfs, wall = _run(workload, _config(workload, name, "fcfs", arrival, args.aging_bound))
            rows.append(_row(name, arrival, "fcfs", 0, fcfs, fcfs, wall))
            for policy in POLICIES[1:]:
                result, wall = _run(workload, _config(workload, name, policy, arrival, args.aging_bound))
                rows.append(_row(name, arrival, policy, args.aging_bound, result, fcfs, wall))
            for row in rows[-3:]:
                print(json.dumps(row), flush=True)
    workload = _workload(SWEEP_WORKLOAD, args.quick)
    fcfs, _ = _run(workload, _config(workload, SWEEP_WORKLOAD, "fcfs", "saturated", 0))
    for bound in AGING_SWEEP:
        for policy in POLICIES[1:]:
            result, wall = _run(workload, _config(workload, SWEEP_WORKLOAD, policy, "saturated", bound))
            row = _row(SWEEP_WORKLOAD, "saturated", policy, bound, result, fcfs, wall)
            row["sweep"] = True
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.json, "w", encoding="utf-8") as handle:
        json.dump({"aging_bound": args.aging_bound, "setups": SETUPS, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
