"""``pagedkv cluster``: N replicas behind a KV-event-driven router (`pagedkv.sim.cluster`).

Prints one table per policy (a row per replica count), then, for each replica count, what the
cache-aware policies save against round-robin. ``--json`` writes ``{"rows": [...]}`` with one
row per (policy, replicas); ``--plot`` draws hit rate and mean TTFT against replicas.

``--shared-tier BYTES`` adds a KV store every replica spills evicted blocks to and loads prefixes
from (`pagedkv.sim.shared_tier`); each policy then runs twice, routing alone and with the tier,
and a last table compares them.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from pagedkv.commands import args as cli_args
from pagedkv.commands.output import check_outputs, finish

__all__ = ["register"]

_DEFAULT_GBPS = 100.0
_DEFAULT_LATENCY_MS = 1.0
_POLICY_CHOICES = ("all", "round-robin", "least-loaded", "longest-prefix", "cost")


def _workload(text: str) -> str:
    from pagedkv.sim.cluster import WORKLOADS

    if text in WORKLOADS or text.endswith((".jsonl", ".jsonl.gz")):
        return text
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(WORKLOADS)} or a .jsonl path, got {text!r}")


_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_UNITS |= {f"{unit}B": factor for unit, factor in _UNITS.items() if unit}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "B": 1}
_BYTES = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)", re.ASCII)
MAX_SHARED_TIER_BYTES = 2**60


def _tier_bytes(text: str) -> int | str:
    """``--shared-tier``: bytes (``64GiB``, ``500GB``, ``1e12`` is not accepted) or ``unbounded``."""
    if text.strip().lower() == "unbounded":
        return "unbounded"
    match = _BYTES.fullmatch(text.strip())
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"expected bytes (e.g. 500GB, 64GiB, 1000000) or 'unbounded', got {cli_args._clip(text)}"
        )
    value = (
        int(float(match.group(1)) * _UNITS[unit])
        if "." in match.group(1)
        else int(match.group(1)) * _UNITS[unit]
    )
    if not 0 < value <= MAX_SHARED_TIER_BYTES:
        raise argparse.ArgumentTypeError(
            f"expected bytes > 0 and <= 2**60 (1 EiB), got {cli_args._clip(text)}"
        )
    return value


def _replica_counts(text: str) -> list[int]:
    counts = cli_args.positive_int_list(text)
    if any(n > 1024 for n in counts):
        raise argparse.ArgumentTypeError("replica counts must be <= 1024")
    return counts


def _plot(rows: list[dict[str, Any]], title: str, path: str, ideal: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for number, policy in enumerate(dict.fromkeys(row["policy"] for row in rows)):
        color = f"C{number}"
        for tier, style, suffix in ((False, "-", ""), (True, "--", " + shared tier")):
            mine = [row for row in rows if row["policy"] == policy and row["shared_tier"] == tier]
            if not mine:
                continue
            xs = [row["replicas"] for row in mine]
            label = policy + suffix
            hits.plot(
                xs, [100 * row["token_hit_rate"] for row in mine], style, color=color, marker="o", label=label
            )
            ttft.plot(xs, [row["mean_ttft_s"] for row in mine], style, color=color, marker="o", label=label)
    if ideal is not None:
        hits.axhline(100 * ideal, color="k", linestyle=":", label="ideal (infinite cache)")
        hits.set_ylim(0, 110 * max(ideal, *(row["token_hit_rate"] for row in rows)))
    for axis, label in ((hits, "token hit rate (%)"), (ttft, "mean TTFT (s, simulated)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("replicas")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    ttft.set_yscale("log")
    hits.legend(fontsize="small")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _cmd_cluster(args: argparse.Namespace) -> int:
    from pagedkv.sim import cluster, reports
    from pagedkv.sim.names import PREFIX_TRACES
    from pagedkv.sim.traces import MOONCAKE_ATTRIBUTION

    check_outputs(args)
    tier = _tier_config(args)
    config = cluster.ClusterConfig(
        num_slots=args.num_slots or cluster.deployment_num_slots(args.block_size),
        block_size=args.block_size,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_s_per_token=args.decode_s_per_token,
    )
    requests = cluster.load_requests(args.workload, seed=args.seed, max_requests=args.max_requests)
    if args.workload in PREFIX_TRACES:
        print(MOONCAKE_ATTRIBUTION, file=sys.stderr)
    policies = list(cluster.POLICIES) if args.policy == "all" else [args.policy]
    print(
        f"{args.workload}: {len(requests):,} requests, {config.num_slots:,} slots per replica "
        f"(block size {config.block_size}), prefill {config.prefill_tokens_per_s:,.0f} tokens/s",
        file=sys.stderr,
    )
    rows = cluster.sweep(requests, args.replicas, policies, config)
    ideal = None
    if tier is not None:
        ideal = cluster.ideal_hit_rate(requests, config.block_size)
        tier_rows = cluster.sweep(requests, args.replicas, policies, config, shared_tier=tier)
        rows = [row for policy in policies for row in (*rows, *tier_rows) if row["policy"] == policy]
    for policy in policies:
        mine = [row for row in rows if row["policy"] == policy and not row["shared_tier"]]
        table = [
            [
                row["replicas"],
                reports.Number(100 * row["token_hit_rate"], ".1f"),
                reports.Number(row["prefill_tokens"], ","),
                reports.Number(row["load_max_over_mean"], ".2f"),
                reports.Number(row["mean_queue_s"], ".2f"),
                reports.Number(row["mean_ttft_s"], ".2f"),
                reports.Number(row["p99_ttft_s"], ".2f"),
            ]
            for row in mine
        ]
        print(
            reports.format_table(
                ["replicas", "hit %", "prefill tokens", "load max/mean", "queue s", "TTFT s", "p99 TTFT s"],
                table,
                title=f"{args.workload}, policy {policy}",
            )
        )
        print()
    alone = [row for row in rows if not row["shared_tier"]]
    baseline = {row["replicas"]: row for row in alone if row["policy"] == "round-robin"}
    if baseline and len(policies) > 1:
        table = []
        for row in alone:
            base = baseline.get(row["replicas"])
            if row["policy"] == "round-robin" or base is None:
                continue
            saved, base_saved = row["prefill_tokens_saved"], base["prefill_tokens_saved"]
            table.append(
                [
                    row["policy"],
                    row["replicas"],
                    reports.Number(saved / base_saved if base_saved else float("inf"), ".2f"),
                    reports.Number(
                        base["mean_ttft_s"] / row["mean_ttft_s"] if row["mean_ttft_s"] else 0.0, ".2f"
                    ),
                ]
            )
        print(
            reports.format_table(
                [
                    "policy",
                    "replicas",
                    "prefill tokens saved vs round-robin (x)",
                    "TTFT speedup vs round-robin (x)",
                ],
                table,
                title="cache-aware routing against round-robin",
            )
        )
    if tier is not None and ideal is not None:
        print()
        print(_tier_table(rows, ideal, args.workload))
    data: dict[str, Any] = {"workload": args.workload, "config": config.__dict__, "rows": rows}
    title = f"{args.workload}: routing across replicas"
    if tier is not None:
        data["shared_tier"] = tier.__dict__
        data["ideal_token_hit_rate"] = ideal
        size = "unbounded" if tier.capacity_bytes is None else f"{tier.capacity_bytes / 1e9:,.6g} GB"
        title += f", shared tier {size} at {tier.load_gbps:g} Gb/s"
    return finish(args, data, lambda path: _plot(rows, title, path, ideal))


def _tier_config(args: argparse.Namespace) -> Any:
    from pagedkv.sim.shared_tier import SharedTierConfig

    if args.shared_tier is None:
        cli_args.refuse_options(
            args,
            {"shared_tier_gbps": _DEFAULT_GBPS, "shared_tier_latency_ms": _DEFAULT_LATENCY_MS},
            "they describe the shared tier, which needs --shared-tier BYTES",
        )
        return None
    capacity = None if args.shared_tier == "unbounded" else args.shared_tier
    return SharedTierConfig(capacity, args.shared_tier_gbps, args.shared_tier_latency_ms / 1e3)


def _tier_table(rows: list[dict[str, Any]], ideal: float, workload: str) -> str:
    from pagedkv.sim import reports

    alone = {(r["policy"], r["replicas"]): r for r in rows if not r["shared_tier"]}
    table = []
    for row in rows:
        base = alone.get((row["policy"], row["replicas"]))
        if not row["shared_tier"] or base is None:
            continue
        table.append(
            [
                row["policy"],
                row["replicas"],
                reports.Number(100 * base["token_hit_rate"], ".1f"),
                reports.Number(100 * row["local_hit_rate"], ".1f"),
                reports.Number(100 * row["shared_hit_rate"], ".1f"),
                reports.Number(100 * row["token_hit_rate"] / ideal if ideal else 0.0, ".0f"),
                reports.Number(row["prefill_tokens_saved"] - base["prefill_tokens_saved"], ","),
                reports.Number(base["mean_ttft_s"], ".2f"),
                reports.Number(row["mean_ttft_s"], ".2f"),
            ]
        )
    return reports.format_table(
        [
            "policy",
            "replicas",
            "hit % alone",
            "local %",
            "shared %",
            "% of ideal",
            "more prefill saved",
            "TTFT s alone",
            "TTFT s tier",
        ],
        table,
        title=f"{workload}: shared tier against routing alone (ideal hit rate {100 * ideal:.1f} %)",
    )


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cluster",
        parents=[cli_args.output_options()],
        help="KV-cache-aware routing across replicas (router fed by KV events)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workload",
        type=_workload,
        default="mooncake-conversation",
        help="mooncake-conversation | mooncake-synthetic (both bundled) | system-prompt | multi-turn | "
        "PATH.jsonl[.gz] (Mooncake format)",
    )
    parser.add_argument("--replicas", type=_replica_counts, default=[1, 2, 4, 8, 16], help="e.g. 1,2,4,8,16")
    parser.add_argument("--policy", choices=_POLICY_CHOICES, default="all")
    parser.add_argument(
        "--num-slots",
        type=cli_args.positive_int,
        default=None,
        help="KV slots per replica (default: Llama-3-8B on one H200, 829,952; docs/experiments.md)",
    )
    parser.add_argument(
        "--block-size", type=cli_args.bounded_int(1, 512), default=512, help="tokens per block"
    )
    parser.add_argument("--prefill-tokens-per-s", type=cli_args.positive_float, default=20_000.0)
    parser.add_argument("--decode-s-per-token", type=cli_args.non_negative_float, default=0.03)
    parser.add_argument(
        "--max-requests", type=cli_args.positive_int, default=None, help="first N requests only"
    )
    parser.add_argument(
        "--shared-tier",
        type=_tier_bytes,
        default=None,
        metavar="BYTES",
        help="add a KV store shared by the replicas, holding their evicted blocks (LRU), of BYTES "
        "(500GB, 64GiB, ...) or 'unbounded'; each policy then also runs without it",
    )
    parser.add_argument(
        "--shared-tier-gbps",
        type=cli_args.positive_float,
        default=_DEFAULT_GBPS,
        help="load bandwidth of the shared tier, gigabits per second (default 100)",
    )
    parser.add_argument(
        "--shared-tier-latency-ms",
        type=cli_args.non_negative_float,
        default=_DEFAULT_LATENCY_MS,
        help="fixed cost of one load from the shared tier, ms (default 1)",
    )
    parser.add_argument("--seed", type=cli_args.seed, default=0, help="seed of the generated workloads")
    parser.set_defaults(handler=_cmd_cluster)
