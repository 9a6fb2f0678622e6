"""Argument types and the option groups several commands share.

Every type raises ``argparse.ArgumentTypeError``, so a bad value is a one-line usage error with
exit status 2, never a traceback. Numbers are bounded: a value no run could use is refused here
rather than failing deep inside NumPy or the simulator.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from pagedkv.errors import CliError
from pagedkv.sim.names import (
    ALLOCATORS,
    PLACEMENTS,
    PREEMPTIONS,
    SCHEDULING_POLICIES,
    SYNTHETIC_WORKLOADS,
    WORKLOAD_CHOICES,
)

__all__ = [
    "CliError",
    "MAX_NUM_REQUESTS",
    "MAX_COUNT",
    "parse_int",
    "positive_int",
    "bounded_int",
    "num_requests",
    "seed",
    "positive_float",
    "non_negative_float",
    "positive_int_list",
    "arrival",
    "workload_name",
    "workload_options",
    "engine_options",
    "output_options",
    "workload_kwargs",
    "config_kwargs",
    "refuse_options",
]

# Requests of one synthetic workload: a bound far above any useful run, so that a typo cannot ask
# NumPy for arrays beyond memory (which fails with a traceback, not a clear message).
MAX_NUM_REQUESTS = 10_000_000
# Largest token count, slot count or step count an option takes: far beyond any pool, and small
# enough that the simulator's int64 arithmetic (tokens x requests, steps x step time) cannot
# overflow.
MAX_COUNT = 2**40

_DECIMAL = re.compile(r"[+-]?[0-9]+", re.ASCII)


def parse_int(text: str) -> int:
    """A decimal integer in ASCII digits: Python's ``int`` would also take ``1_000`` and
    digits of other scripts, which a count on a command line should not."""
    if not _DECIMAL.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"expected an integer, got {_clip(text)}")
    return int(text)


def _clip(text: str, limit: int = 40) -> str:
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def bounded_int(low: int, high: int) -> Any:
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        value = parse_int(text)
        if not low <= value <= high:
            if high == MAX_COUNT:
                raise argparse.ArgumentTypeError(f"expected an integer >= {low} and <= 2**40, got {text}")
            raise argparse.ArgumentTypeError(f"expected an integer in [{low:,}, {high:,}], got {text}")
        return value

    return parse


positive_int = bounded_int(1, MAX_COUNT)
non_negative_int = bounded_int(0, MAX_COUNT)
num_requests = bounded_int(1, MAX_NUM_REQUESTS)


def seed(text: str) -> int:
    value = parse_int(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {_clip(text)}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {_clip(text)}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {_clip(text)}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {_clip(text)}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {_clip(text)}")
    return value


def positive_int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1 (block sizes, context lengths); at least one."""
    values = [positive_int(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {_clip(text)}")
    return values


def arrival(text: str) -> tuple[str, float | None]:
    """``saturated`` | ``trace`` | ``poisson`` | ``poisson:RATE`` (requests per second)."""
    mode, sep, rate = text.partition(":")
    if mode in ("saturated", "trace") and not rate:
        return mode, None
    if mode == "poisson":
        if sep and not rate:
            raise argparse.ArgumentTypeError("expected poisson:RATE with a rate, got 'poisson:'")
        return mode, positive_float(rate) if rate else None
    raise argparse.ArgumentTypeError(f"expected saturated, trace or poisson:RATE, got {_clip(text)}")


_TRACE_SUFFIXES = (".csv", ".csv.gz", ".jsonl", ".jsonl.gz")


def workload_name(text: str) -> str:
    """A workload name of `pagedkv.sim.names.WORKLOAD_CHOICES`, or the path of a CSV trace or a
    Mooncake-format JSONL trace."""
    if text in WORKLOAD_CHOICES or text.lower().endswith(_TRACE_SUFFIXES):
        return text
    raise argparse.ArgumentTypeError(
        f"expected one of {', '.join(WORKLOAD_CHOICES)} or a path ending in .csv or .jsonl, got {_clip(text)}"
    )


def workload_options() -> argparse.ArgumentParser:
    """A parent parser with the workload group (``--workload``, ``--num-requests`` ...).

    Built afresh for every command: argparse shares a parent's actions by reference, so one
    command's ``set_defaults`` would otherwise change every other command's defaults.
    """
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("workload")
    group.add_argument(
        "--workload",
        type=workload_name,
        default="synthetic",
        metavar="NAME|PATH",
        help=f"{'|'.join(WORKLOAD_CHOICES)}, the path of a CSV trace "
        "(TIMESTAMP,ContextTokens,GeneratedTokens) or of a Mooncake-format .jsonl trace "
        "(default: synthetic)",
    )
    group.add_argument(
        "--num-requests",
        type=num_requests,
        default=None,
        help="requests of a synthetic workload (default 1000), or the first N of a trace",
    )
    group.add_argument(
        "--seed", type=seed, default=0, help="seed of the workload and the simulation (default 0)"
    )
    group.add_argument(
        "--prompt-mean", type=positive_float, default=None, help="lognormal: mean prompt tokens"
    )
    group.add_argument(
        "--output-mean", type=positive_float, default=None, help="lognormal: mean output tokens"
    )
    group.add_argument(
        "--prompt-sigma", type=_float, default=1.0, help="lognormal: spread of log prompt length"
    )
    group.add_argument(
        "--output-sigma", type=_float, default=1.0, help="lognormal: spread of log output length"
    )
    group.add_argument(
        "--parallel-samples",
        type=positive_int,
        default=None,
        metavar="N",
        help="each request samples N outputs sharing its prompt (parallel sampling)",
    )
    group.add_argument(
        "--beam-width",
        type=positive_int,
        default=None,
        metavar="W",
        help="each request runs beam search of width W",
    )
    return parent


def engine_options(*, allocator: bool = True, block_size: bool = True, preemption: bool = True) -> Any:
    """A parent parser with the engine and memory group (``--allocator``, ``--num-slots`` ...).

    A command that sets one of these itself (``compare`` runs every allocator) leaves it out, so
    argparse refuses the flag instead of accepting and ignoring it.
    """
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("engine and memory")
    if allocator:
        group.add_argument("--allocator", choices=ALLOCATORS, default="paged")
    group.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="first-fit",
        help="address-space allocator of the contiguous policies (default first-fit)",
    )
    if block_size:
        group.add_argument(
            "--block-size", type=positive_int, default=16, help="tokens per block (default 16)"
        )
    group.add_argument(
        "--num-slots",
        type=positive_int,
        default=15_744,
        help="KV pool size in token slots (default 15744: a 13B model on a 40 GB GPU)",
    )
    group.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="longest request in tokens (default 2048; a trace's longest request for traces)",
    )
    group.add_argument(
        "--arrival",
        type=arrival,
        default=("saturated", None),
        metavar="MODE",
        help="saturated (all at once) | trace (the workload's own times) | poisson:RATE",
    )
    group.add_argument("--step-time", type=positive_float, default=0.02, help="seconds per engine step")
    if preemption:
        group.add_argument("--preemption", choices=PREEMPTIONS, default="recompute")
    group.add_argument(
        "--num-host-slots",
        type=non_negative_int,
        default=None,
        help="host-tier token slots for swap (default: as many as --num-slots with "
        "--preemption swap, else 0)",
    )
    group.add_argument("--max-num-seqs", type=positive_int, default=256, help="batch cap (default 256)")
    group.add_argument("--prefix-caching", action="store_true", help="enable prefix caching (paged)")
    group.add_argument(
        "--scheduling",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="admission order: fcfs, lpm (longest cached prefix first) or dfs (shared prefixes "
        "depth first); lpm and dfs need --prefix-caching (default fcfs)",
    )
    group.add_argument(
        "--aging-bound",
        type=non_negative_int,
        default=2048,
        metavar="N",
        help="lpm/dfs: at most N admissions may pass over a waiting request (0: first come, first "
        "served; default 2048)",
    )
    group.add_argument(
        "--queue-aware-eviction",
        action="store_true",
        help="lpm/dfs: evict cached blocks a waiting request will hit after every other cached block "
        "(default: plain LRU)",
    )
    group.add_argument("--max-steps", type=positive_int, default=None, help="stop after this many steps")
    return parent


def output_options() -> argparse.ArgumentParser:
    """A parent parser with the output group (``--json``, ``--plot``, ``--no-progress``)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("output")
    group.add_argument("--json", metavar="FILE", default=None, help="write the numbers as one JSON object")
    group.add_argument("--plot", metavar="FILE", default=None, help="write a PNG plot (needs matplotlib)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parent


def workload_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of `pagedkv.sim.builders.build_workload` from the workload options."""
    kwargs = {
        "workload": args.workload,
        "num_requests": args.num_requests,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "arrival_rate_per_s": args.arrival[1],
        "prompt_mean_tokens": args.prompt_mean,
        "output_mean_tokens": args.output_mean,
        "prompt_sigma": args.prompt_sigma,
        "output_sigma": args.output_sigma,
        "parallel_samples": args.parallel_samples,
        "beam_width": args.beam_width,
    }
    kwargs.update(overrides)
    return kwargs


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of `pagedkv.sim.builders.build_config` from the engine options; an
    option the command does not take keeps the builder's default."""
    kwargs: dict[str, Any] = {
        "synthetic": args.workload in SYNTHETIC_WORKLOADS,
        "placement": args.placement,
        "num_slots": args.num_slots,
        "max_model_len": args.max_model_len,
        "arrival": args.arrival[0],
        "poisson_rate_per_s": args.arrival[1],
        "step_time_s": args.step_time,
        "num_host_slots": args.num_host_slots,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": args.prefix_caching,
        "seed": args.seed,
        "max_steps": args.max_steps,
        "scheduling": args.scheduling,
        "aging_bound": args.aging_bound,
        "queue_aware_eviction": args.queue_aware_eviction,
    }
    for option, key in (
        ("allocator", "allocator"),
        ("block_size", "block_size"),
        ("preemption", "preemption"),
    ):
        if hasattr(args, option):
            kwargs[key] = getattr(args, option)
    return kwargs


def refuse_options(args: argparse.Namespace, defaults: dict[str, Any], reason: str) -> None:
    """Raise `CliError` when an option in ``defaults`` was changed from its default."""
    changed = [name for name, default in defaults.items() if getattr(args, name, default) != default]
    if changed:
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        raise CliError(f"{flags} does not apply here: {reason}")
