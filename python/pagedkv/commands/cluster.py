"""``pagedkv cluster``: N replicas behind a KV-event-driven router (`pagedkv.sim.cluster`).

Prints one table per policy (a row per replica count), then, for each replica count, what the
cache-aware policies save against round-robin. ``--json`` writes ``{"rows": [...]}`` with one
row per (policy, replicas); ``--plot`` draws hit rate and mean TTFT against replicas.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedkv.commands import args as cli_args
from pagedkv.commands.output import check_outputs, finish

__all__ = ["register"]

_POLICY_CHOICES = ("all", "round-robin", "least-loaded", "longest-prefix", "cost")


def _workload(text: str) -> str:
    from pagedkv.sim.cluster import WORKLOADS

    if text in WORKLOADS or text.endswith((".jsonl", ".jsonl.gz")):
        return text
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(WORKLOADS)} or a .jsonl path, got {text!r}")


def _replica_counts(text: str) -> list[int]:
    counts = cli_args.positive_int_list(text)
    if any(n > 1024 for n in counts):
        raise argparse.ArgumentTypeError("replica counts must be <= 1024")
    return counts


def _plot(rows: list[dict[str, Any]], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in dict.fromkeys(row["policy"] for row in rows):
        mine = [row for row in rows if row["policy"] == policy]
        xs = [row["replicas"] for row in mine]
        hits.plot(xs, [100 * row["token_hit_rate"] for row in mine], marker="o", label=policy)
        ttft.plot(xs, [row["mean_ttft_s"] for row in mine], marker="o", label=policy)
    for axis, label in ((hits, "token hit rate (%)"), (ttft, "mean TTFT (s, simulated)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("replicas")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    ttft.set_yscale("log")
    hits.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _cmd_cluster(args: argparse.Namespace) -> int:
    from pagedkv.sim import cluster, reports
    from pagedkv.sim.names import PREFIX_TRACES
    from pagedkv.sim.traces import MOONCAKE_ATTRIBUTION

    check_outputs(args)
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
    for policy in policies:
        mine = [row for row in rows if row["policy"] == policy]
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
    baseline = {row["replicas"]: row for row in rows if row["policy"] == "round-robin"}
    if baseline and len(policies) > 1:
        table = []
        for row in rows:
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
    data = {"workload": args.workload, "config": config.__dict__, "rows": rows}
    title = f"{args.workload}: routing across replicas"
    return finish(args, data, lambda path: _plot(rows, title, path))


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
    parser.add_argument("--seed", type=cli_args.seed, default=0, help="seed of the generated workloads")
    parser.set_defaults(handler=_cmd_cluster)
