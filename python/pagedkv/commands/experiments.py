"""``pagedkv demo``, ``figure2`` and ``sharing``: fixed experiments with their own settings."""

from __future__ import annotations

import argparse
from typing import Any

import pagedkv
from pagedkv.commands import args as cli_args
from pagedkv.commands.output import check_outputs, finish, progress_enabled
from pagedkv.sim.names import PLACEMENTS

__all__ = ["register"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots

    check_outputs(args)
    if args.attention_backend == "cuda":
        from pagedkv.attention.runners import get_runner

        get_runner("cuda")  # CudaUnavailableError (exit 2) before any section runs
    print(f"pagedkv {pagedkv.__version__} demo: why paging the KV cache wins, measured")
    data = experiments.demo(
        progress=progress_enabled(args),
        num_requests=args.num_requests,
        seed=args.seed,
        attention_backend=args.attention_backend,
    )
    return finish(args, data, lambda path: plots.plot_demo(data, path))


def _cmd_figure2(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots

    check_outputs(args)
    # Buddy first: the headline results use Orca's allocator.
    placements = ("buddy", "first-fit") if args.placement == "both" else (args.placement,)
    data = experiments.figure2(
        num_requests=args.num_requests, seed=args.seed, placements=placements, progress=progress_enabled(args)
    )
    print(experiments.render_figure2(data))
    return finish(
        args,
        data,
        lambda path: plots.plot_shares(
            data["results"],
            path,
            title="vLLM Figure 2 setting (dashes: published token states)",
            published_token_states=data["published_token_states"],
        ),
    )


def _cmd_sharing(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots

    check_outputs(args)
    data = experiments.sharing_savings(
        num_requests=args.num_requests,
        block_size=args.block_size,
        seed=args.seed,
        progress=progress_enabled(args),
    )
    print(experiments.render_sharing(data))
    return finish(args, data, lambda path: plots.plot_sharing(data, path, title="Sharing savings"))


def register(subparsers: Any) -> None:
    """Add ``demo``, ``figure2`` and ``sharing`` to the ``pagedkv`` subparsers."""
    demo = subparsers.add_parser(
        "demo",
        parents=[cli_args.output_options()],
        help="the main job: the whole story in six sections (a few seconds)",
        description="Paged vs contiguous attention, allocators, block sizes, copy-on-write, "
        "exhaustion and recovery, prefix caching: six printed sections.",
    )
    demo.add_argument(
        "--num-requests",
        type=cli_args.num_requests,
        default=1000,
        help="synthetic requests (default 1000)",
    )
    demo.add_argument("--seed", type=cli_args.seed, default=0)
    demo.add_argument(
        "--attention-backend",
        choices=("numpy", "emulated", "cuda"),
        default="numpy",
        help="backend of section (a) (default numpy; emulated compiles the CUDA source for the CPU; "
        "cuda needs CuPy and a GPU)",
    )
    demo.set_defaults(handler=_cmd_demo)

    figure2 = subparsers.add_parser(
        "figure2",
        parents=[cli_args.output_options()],
        help="the vLLM paper's Figure 2 setting, our shares beside the published ones",
    )
    figure2.add_argument("--num-requests", type=cli_args.num_requests, default=2000)
    figure2.add_argument("--seed", type=cli_args.seed, default=0)
    figure2.add_argument(
        "--placement",
        choices=("both", *PLACEMENTS),
        default="both",
        help="placement of the contiguous policies (default both; buddy, as Orca, first)",
    )
    figure2.set_defaults(handler=_cmd_figure2)

    sharing = subparsers.add_parser(
        "sharing",
        parents=[cli_args.output_options()],
        help="blocks saved by sharing: parallel sampling and beam search, width 2/4/6",
    )
    sharing.add_argument(
        "--num-requests", type=cli_args.num_requests, default=100, help="groups per row (default 100)"
    )
    sharing.add_argument("--block-size", type=cli_args.positive_int, default=16)
    sharing.add_argument("--seed", type=cli_args.seed, default=0)
    sharing.set_defaults(handler=_cmd_sharing)
