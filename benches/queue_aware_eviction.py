"""Queue-aware eviction in the simulator (docs/scheduling.md): each workload of
``cache_aware_scheduling.py`` (same pools) under ``lpm`` and ``dfs``, with the plain LRU and with
``queue_aware_eviction``, at the workload's own arrival times and with every request waiting.

    python benches/queue_aware_eviction.py [--quick] [--workloads system-prompt,...]

Columns: the blocks evicted while a waiting request would have hit them
(``evicted_wanted_blocks``), the token hit rate, its share of the offline optimum, prefill
tokens and the p99 wait. Simulated time: every number is a property of the schedule, not of
this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cache_aware_scheduling import SETUPS, _config, _workload  # noqa: E402
from pagedkv.sim.engine import simulate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="cut the Mooncake traces to 800 requests")
    parser.add_argument("--workloads", default=",".join(SETUPS), help="comma-separated workload names")
    args = parser.parse_args()
    print("| workload | arrivals | policy | eviction | wanted evicted | hit rate | of opt. | prefill | p99 |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for name in args.workloads.split(","):
        workload = _workload(name, args.quick)
        for arrival in ("trace", "saturated"):
            for policy in ("lpm", "dfs"):
                for queue_aware in (False, True):
                    config = dataclasses.replace(
                        _config(workload, name, policy, arrival, 2048), queue_aware_eviction=queue_aware
                    )
                    r = simulate(workload, config)
                    print(
                        f"| {name} | {'own times' if arrival == 'trace' else 'saturated'} | {policy} | "
                        f"{'queue-aware' if queue_aware else 'LRU'} | {r.evicted_wanted_blocks:,} | "
                        f"{r.token_hit_rate:.2%} | {r.hit_rate_of_optimum:.2%} | {r.prefill_tokens:,} | "
                        f"{r.p99_wait_s:.1f} s |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
