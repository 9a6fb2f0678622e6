"""The experiments of the PagedAttention story, as functions returning JSON-ready dicts.

Each experiment has a ``render_*`` companion that turns its dict into the printed tables, so the
command line, the demo and a notebook print the same thing. Simulations go through
`pagedkv.sim.engine.simulate`; the copy-on-write and sharing experiments drive the real
`pagedkv.KvCacheManager` directly.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import workloads as wl
from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.engine import SimConfig, SimResult, Workload, simulate
from pagedkv.sim.progress import Progress
from pagedkv.sim.reports import format_table, occupancy_table, percent, shares_table

__all__ = [
    "ALLOCATORS",
    "ALLOCATOR_LABELS",
    "PUBLISHED_FIGURE2_TOKEN_STATES",
    "PUBLISHED_SHARING_SAVINGS",
    "FIGURE2_NUM_SLOTS",
    "summarize",
    "run_simulation",
    "compare_allocators",
    "render_compare",
    "figure2",
    "render_figure2",
    "block_size_sweep",
    "render_sweep",
    "sharing_savings",
    "render_sharing",
    "copy_on_write",
    "render_copy_on_write",
    "attention_check",
    "render_attention_check",
    "recovery",
    "render_recovery",
    "prefix_caching",
    "render_prefix_caching",
    "demo",
]

ALLOCATORS = ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged")
# The paper's names for the four policies (Orca reserves contiguous memory per request).
ALLOCATOR_LABELS = {
    "contiguous-max": "Orca (Max)",
    "contiguous-pow2": "Orca (Pow2)",
    "contiguous-oracle": "Orca (Oracle)",
    "paged": "vLLM",
}
# vLLM paper (Kwon et al., SOSP 2023), Figure 2: share of KV-cache memory holding token states.
PUBLISHED_FIGURE2_TOKEN_STATES = {
    "Orca (Max)": 0.204,
    "Orca (Pow2)": 0.268,
    "Orca (Oracle)": 0.382,
    "vLLM": 0.963,
}
# vLLM paper §6.3: memory saved by sharing on Alpaca (OPT-13B), over n / width 2, 4, 6.
PUBLISHED_SHARING_SAVINGS = {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)}
# A 13B model on a 40 GB GPU leaves room for about 15.7K token slots of KV cache (vLLM Fig. 2 setting).
FIGURE2_NUM_SLOTS = 15_744

Printer = Callable[[str], None]


def summarize(result: SimResult) -> dict:
    """A run's scalar metrics (every DESIGN.md §5 key) plus per-request means, without the
    per-request arrays."""
    summary = {
        key: value
        for key, value in result.to_dict().items()
        if key not in ("waste_per_request_tokens", "block_table_len")
    }
    waste = np.asarray(result.waste_per_request_tokens, dtype=np.float64)
    tables = np.asarray(result.block_table_len, dtype=np.float64)
    summary["mean_waste_per_request_tokens"] = float(waste.mean()) if waste.size else 0.0
    summary["mean_block_table_len"] = float(tables.mean()) if tables.size else 0.0
    # Clamped: the shares are floats summing to 1, so a waste-free run may come out as -1e-17.
    summary["waste"] = max(0.0, 1.0 - result.token_states - result.free)
    return summary


def run_simulation(workload: Workload, config: SimConfig, *, progress: bool = False) -> SimResult:
    """`simulate`, after checking the config's names so that a typo is a clear error here."""
    if config.allocator not in ALLOCATORS:
        raise InvalidArgumentError(
            f"allocator must be one of {', '.join(ALLOCATORS)}, got {config.allocator!r}"
        )
    if config.placement not in ("first-fit", "buddy"):
        raise InvalidArgumentError(f"placement must be 'first-fit' or 'buddy', got {config.placement!r}")
    if config.preemption not in ("recompute", "swap"):
        raise InvalidArgumentError(f"preemption must be 'recompute' or 'swap', got {config.preemption!r}")
    return simulate(workload, config, progress=progress)


def _runs(
    label: str, configs: Sequence[tuple[str, Workload, SimConfig]], progress: bool
) -> dict[str, SimResult]:
    results: dict[str, SimResult] = {}
    with Progress(len(configs), label, enabled=progress) as bar:
        for name, workload, config in configs:
            results[name] = run_simulation(workload, config)
            bar.update(1, name)
    return results


# ---------------------------------------------------------------- allocators side by side


def compare_allocators(
    workload: Workload, config: SimConfig, *, allocators: Sequence[str] = ALLOCATORS, progress: bool = False
) -> dict:
    """The same workload and pool under each allocator: the five shares and the occupancy."""
    runs = [
        (ALLOCATOR_LABELS.get(name, name), workload, dataclasses.replace(config, allocator=name))
        for name in allocators
    ]
    results = _runs("compare", runs, progress)
    return {
        "workload": wl.describe(workload),
        "config": dataclasses.asdict(config),
        "results": {label: summarize(result) for label, result in results.items()},
    }


def render_compare(data: Mapping[str, Any], *, title: str = "Allocators on the same memory") -> str:
    config = data["config"]
    heading = (
        f"{title}: {data['workload']['name']}, pool {config['num_slots']:,} token slots, "
        f"max_model_len {config['max_model_len']}, block size {config['block_size']} (paged), "
        f"placement {config['placement']} (contiguous), arrival {config['arrival']}"
    )
    results = data["results"]
    lines = []
    paged = results.get(ALLOCATOR_LABELS["paged"])
    if paged is not None:
        for label, result in results.items():
            if (
                result is paged
                or not result["mean_resident_requests"]
                or not result["generated_tokens_per_step"]
            ):
                continue
            lines.append(
                f"Paging vs {label}: {paged['mean_resident_requests'] / result['mean_resident_requests']:.1f}x "
                f"the resident requests, {paged['generated_tokens_per_step'] / result['generated_tokens_per_step']:.1f}x "
                f"the tokens per step"
            )
    return "\n\n".join(
        [
            shares_table(results, title=heading),
            occupancy_table(
                results,
                title="Utilization = token states; waste = reserved + internal + external; "
                "'while queued' = over the steps at which a request was waiting",
            ),
            *(["\n".join(lines)] if lines else []),
        ]
    )


# ---------------------------------------------------------------- vLLM Figure 2


def figure2(
    *,
    num_requests: int = 2000,
    seed: int = 0,
    placements: Sequence[str] = ("buddy", "first-fit"),
    progress: bool = False,
) -> dict:
    """The paper's Figure 2 setting: max length 2048, ~15.7K slots, ShareGPT-like lengths, saturated.

    The contiguous policies run under each placement; the first one (buddy, as Orca) gives the
    headline ``results``, every one is kept in ``results_by_placement``.
    """
    if not placements:
        raise InvalidArgumentError("figure2 needs at least one placement")
    workload = wl.sharegpt_like(num_requests, seed=seed, max_model_len=2048)
    by_placement: dict[str, dict] = {}
    paged_summary: dict | None = None
    with Progress(len(placements) * 3 + 1, "figure2", enabled=progress) as bar:
        for placement in placements:
            config = SimConfig(
                num_slots=FIGURE2_NUM_SLOTS,
                max_model_len=2048,
                block_size=16,
                arrival="saturated",
                placement=placement,
                seed=seed,
            )
            results = {}
            for allocator in ALLOCATORS:
                if allocator == "paged":
                    # Placement only matters to the contiguous policies: run paging once.
                    if paged_summary is None:
                        paged_summary = summarize(
                            run_simulation(workload, dataclasses.replace(config, allocator="paged"))
                        )
                        bar.update(1, "paged")
                    results[ALLOCATOR_LABELS[allocator]] = paged_summary
                else:
                    results[ALLOCATOR_LABELS[allocator]] = summarize(
                        run_simulation(workload, dataclasses.replace(config, allocator=allocator))
                    )
                    bar.update(1, f"{allocator} {placement}")
            by_placement[placement] = results
    headline = SimConfig(
        num_slots=FIGURE2_NUM_SLOTS,
        max_model_len=2048,
        block_size=16,
        arrival="saturated",
        placement=placements[0],
        seed=seed,
    )
    return {
        "workload": wl.describe(workload),
        "config": dataclasses.asdict(headline),
        "results": by_placement[placements[0]],
        "results_by_placement": by_placement,
        "published_token_states": dict(PUBLISHED_FIGURE2_TOKEN_STATES),
    }


def render_figure2(data: Mapping[str, Any]) -> str:
    config = data["config"]
    placements = list(data["results_by_placement"])
    title = (
        f"vLLM Figure 2 setting: {data['workload']['name']} (mean prompt "
        f"{data['workload']['prompt_tokens_mean']:.0f} / output {data['workload']['output_tokens_mean']:.0f} "
        f"tokens), {config['num_slots']:,} slots, max_model_len {config['max_model_len']}, saturated; "
        f"contiguous placement {config['placement']}"
    )
    rows = []
    for label, published in data["published_token_states"].items():
        ours = [data["results_by_placement"][placement][label]["token_states"] for placement in placements]
        queued = data["results"][label].get("shares_while_queued", {}).get("token_states")
        rows.append(
            [
                label,
                *(percent(value) for value in ours),
                percent(queued) if queued is not None else "-",
                percent(published),
                f"{100 * (ours[0] - published):+.1f} pts",
            ]
        )
    return "\n\n".join(
        [
            shares_table(data["results"], title=title, published_token_states=data["published_token_states"]),
            format_table(
                [
                    "system",
                    *(f"ours, {placement}" for placement in placements),
                    f"ours, {placements[0]}, while queued",
                    "published",
                    f"difference ({placements[0]})",
                ],
                rows,
                title="Token states beside the published Figure 2 (docs/experiments.md explains the gaps)",
                note="'while queued': averaged only over the steps at which a request was waiting "
                "(the steady state, without the final drain)",
            ),
        ]
    )


# ---------------------------------------------------------------- block-size sweep


def _crossing(
    block_sizes: Sequence[float], waste: Sequence[float], table_len: Sequence[float]
) -> tuple[float, float] | None:
    """Where waste per request (growing with the block size) meets block-table length (falling),
    interpolated linearly in log2(block size) and log(value); None if they never cross."""
    for index in range(len(block_sizes) - 1):
        gap_here = math.log(max(waste[index], 1e-9)) - math.log(max(table_len[index], 1e-9))
        gap_next = math.log(max(waste[index + 1], 1e-9)) - math.log(max(table_len[index + 1], 1e-9))
        if gap_here <= 0 <= gap_next and gap_next != gap_here:
            fraction = -gap_here / (gap_next - gap_here)
            x_here, x_next = math.log2(block_sizes[index]), math.log2(block_sizes[index + 1])
            block_size = 2 ** (x_here + fraction * (x_next - x_here))
            value = math.exp(
                math.log(max(table_len[index], 1e-9))
                + fraction
                * (math.log(max(table_len[index + 1], 1e-9)) - math.log(max(table_len[index], 1e-9)))
            )
            return block_size, value
    return None


def block_size_sweep(
    workload: Workload,
    config: SimConfig,
    *,
    block_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
    progress: bool = False,
) -> dict:
    """Paged allocation at each block size on the same pool: utilization, waste per finished
    request (which tracks block_size / 2) and block-table length (which falls as 1 / block_size).

    The crossing is where the two per-request costs are equal, one token slot of waste against
    one table entry: the classic page-size trade-off, whose optimum sqrt(2 * mean length) it
    approximates.
    """
    runs = [
        (str(block_size), workload, dataclasses.replace(config, allocator="paged", block_size=block_size))
        for block_size in block_sizes
    ]
    results = _runs("sweep", runs, progress)
    rows = []
    for block_size, result in zip(block_sizes, results.values()):
        summary = summarize(result)
        rows.append(
            {
                "block_size": int(block_size),
                "token_states": summary["token_states"],
                "waste": summary["waste"],
                "mean_waste_per_request_tokens": summary["mean_waste_per_request_tokens"],
                "waste_over_half_block": summary["mean_waste_per_request_tokens"] / (block_size / 2.0),
                "mean_block_table_len": summary["mean_block_table_len"],
                "mean_resident_requests": summary["mean_resident_requests"],
                "generated_tokens_per_step": summary["generated_tokens_per_step"],
                "preemptions": summary["preemptions"],
            }
        )
    crossing = _crossing(
        [row["block_size"] for row in rows],
        [row["mean_waste_per_request_tokens"] for row in rows],
        [row["mean_block_table_len"] for row in rows],
    )
    return {
        "workload": wl.describe(workload),
        "config": dataclasses.asdict(config),
        "rows": rows,
        "crossing_block_size": crossing[0] if crossing else None,
        "crossing_value": crossing[1] if crossing else None,
        "results": {str(row["block_size"]): summarize(result) for row, result in zip(rows, results.values())},
    }


def render_sweep(data: Mapping[str, Any]) -> str:
    config = data["config"]
    rows = [
        [
            row["block_size"],
            percent(row["token_states"]),
            percent(row["waste"]),
            row["mean_waste_per_request_tokens"],
            row["block_size"] / 2,
            f"{row['waste_over_half_block']:.2f}",
            row["mean_block_table_len"],
            row["mean_resident_requests"],
            row["preemptions"],
        ]
        for row in data["rows"]
    ]
    crossing = data.get("crossing_block_size")
    note = (
        f"Waste per request equals block-table length at block size ~{crossing:.0f} "
        f"({data['crossing_value']:.1f} tokens = entries per request)"
        if crossing
        else "Waste per request and block-table length do not cross in this range"
    )
    note += (
        "\nFor lengths spread evenly over a block the expected waste is (block_size - 1) / 2, "
        "hence ratios a little under 1."
    )
    return format_table(
        [
            "block size",
            "utilization",
            "waste",
            "waste/request (tok)",
            "block/2",
            "ratio",
            "table len",
            "mean resident",
            "preemptions",
        ],
        rows,
        title=(
            f"Block-size sweep: {data['workload']['name']}, pool {config['num_slots']:,} slots, "
            f"arrival {config['arrival']}"
        ),
        note=note,
    )


# ---------------------------------------------------------------- sharing: parallel sampling and beam search


def _beam_parents(
    rng: np.random.Generator, scores: np.ndarray, width: int, vocab_size: int, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """One beam-search step over a random language model: each beam's next-token log-probs are a
    log-softmax of Gaussian logits; the ``width`` best (beam score + token log-prob) survive.
    Returns (parent beam index [width], new scores [width])."""
    logits = rng.standard_normal((len(scores), vocab_size)) * temperature
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    candidates = scores[:, None] + log_probs  # [beams, vocab]
    flat_best = np.argpartition(candidates.ravel(), -width)[-width:]
    flat_best = flat_best[np.argsort(candidates.ravel()[flat_best])[::-1]]
    return flat_best // vocab_size, candidates.ravel()[flat_best]


def _group_block_usage(
    manager: Any,
    prompt_tokens: int,
    output_tokens: int,
    width: int,
    kind: str,
    rng: np.random.Generator,
    next_id: int,
    vocab_size: int,
    temperature: float,
) -> tuple[float, float, int]:
    """Run one request group on the manager; returns (sum over steps of physical blocks in use,
    sum of logical blocks, ids consumed). Logical = what the group would hold without sharing."""
    block_size = manager.block_size
    parent = next_id
    next_id += 1
    manager.add_sequence(parent, num_tokens=prompt_tokens)
    beams = [parent]
    for _ in range(width - 1):
        manager.fork(parent, next_id)
        beams.append(next_id)
        next_id += 1
    scores = np.zeros(width)
    physical_sum = 0.0
    logical_sum = 0.0
    for _ in range(output_tokens):
        if kind == "beam":
            parents, scores = _beam_parents(rng, scores, width, vocab_size, temperature)
            new_beams = []
            for parent_index in parents:
                manager.fork(beams[parent_index], next_id)
                new_beams.append(next_id)
                next_id += 1
            manager.free_batch(beams)
            beams = new_beams
        manager.append_tokens_batch(beams, num_tokens=1)
        physical_sum += manager.stats()["num_blocks_in_use"]
        logical_sum += sum(-(-manager.num_tokens(seq) // block_size) for seq in beams)
    manager.free_batch(beams)
    return physical_sum, logical_sum, next_id


def sharing_savings(
    *,
    kinds: Sequence[str] = ("parallel", "beam"),
    widths: Sequence[int] = (2, 4, 6),
    workload_names: Sequence[str] = ("alpaca", "sharegpt"),
    num_requests: int = 100,
    block_size: int = 16,
    seed: int = 0,
    vocab_size: int = 256,
    temperature: float = 2.0,
    check_invariants: bool = False,
    progress: bool = False,
) -> dict:
    """Share of KV blocks saved by copy-on-write sharing against every sequence holding its own.

    Each request group runs on a real `pagedkv.KvCacheManager`: the prompt is added once and
    forked into ``width`` sequences. Parallel sampling: every sample decodes ``output_tokens``
    tokens. Beam search: at each step every beam is scored over a random language model and the
    ``width`` best continuations survive -- each forks from its parent beam and the old beams are
    freed, so beams share the blocks of their common ancestry. Savings are time-averaged:
    1 - sum(physical blocks in use) / sum(blocks the same sequences would hold unshared).
    """
    import pagedkv

    rng = np.random.default_rng(seed)
    rows = []
    total = len(kinds) * len(widths) * len(workload_names)
    with Progress(total, "sharing", enabled=progress) as bar:
        for workload_name in workload_names:
            workload = wl.make_workload(workload_name, num_requests=num_requests, seed=seed)
            max_len = int(np.max(workload.prompt_tokens + workload.output_tokens))
            for kind in kinds:
                for width in widths:
                    # Enough blocks for the widest group at its longest: beams fork before the
                    # old beams are freed, so up to 2 * width sequences exist for a moment.
                    num_blocks = 2 * width * (-(-max_len // block_size) + 1)
                    manager = pagedkv.KvCacheManager(num_blocks=num_blocks, block_size=block_size)
                    physical = logical = 0.0
                    next_id = 0
                    for prompt, output in zip(
                        workload.prompt_tokens.tolist(), workload.output_tokens.tolist()
                    ):
                        group_physical, group_logical, next_id = _group_block_usage(
                            manager, prompt, output, width, kind, rng, next_id, vocab_size, temperature
                        )
                        physical += group_physical
                        logical += group_logical
                        if check_invariants:
                            manager.check_invariants()
                    stats = manager.stats()
                    rows.append(
                        {
                            "workload": workload_name,
                            "kind": kind,
                            "width": int(width),
                            "blocks_saved": 1.0 - physical / logical,
                            "mean_physical_blocks": physical / max(1, int(workload.output_tokens.sum())),
                            "mean_logical_blocks": logical / max(1, int(workload.output_tokens.sum())),
                            "cow_copies": int(stats["cow_copies"]),
                            "forks": int(stats["forks"]),
                        }
                    )
                    bar.update(1, f"{workload_name} {kind} {width}")
    return {
        "block_size": block_size,
        "num_requests": num_requests,
        "rows": rows,
        "published": {kind: list(bounds) for kind, bounds in PUBLISHED_SHARING_SAVINGS.items()},
    }


def render_sharing(data: Mapping[str, Any]) -> str:
    rows = []
    for row in data["rows"]:
        low, high = data["published"].get(row["kind"], (None, None))
        published = (
            f"{100 * low:.1f}-{100 * high:.1f} %" if row["workload"] == "alpaca" and low is not None else "-"
        )
        rows.append(
            [
                row["workload"],
                row["kind"],
                row["width"],
                percent(row["blocks_saved"]),
                published,
                row["mean_logical_blocks"],
                row["mean_physical_blocks"],
                row["cow_copies"],
            ]
        )
    return format_table(
        [
            "workload",
            "kind",
            "n / width",
            "blocks saved",
            "published (Alpaca)",
            "unshared blocks",
            "shared blocks",
            "CoW copies",
        ],
        rows,
        title=(
            f"Sharing savings (real KvCacheManager, block size {data['block_size']}, "
            f"{data['num_requests']} groups per row; blocks averaged over decode steps)"
        ),
    )


# ---------------------------------------------------------------- copy-on-write in one picture


def copy_on_write(
    *, prompt_tokens: int = 1000, num_samples: int = 4, generated_tokens: int = 100, block_size: int = 16
) -> dict:
    """``num_samples`` samples forked from one prompt hold the prompt's blocks once; decoding
    copies only the shared, partly filled last block (once per sample but the last)."""
    import pagedkv

    blocks_per_prompt = -(-prompt_tokens // block_size)
    manager = pagedkv.KvCacheManager(
        num_blocks=num_samples * (blocks_per_prompt + generated_tokens // block_size + 2),
        block_size=block_size,
    )
    manager.add_sequence(0, num_tokens=prompt_tokens)
    for sample in range(1, num_samples):
        manager.fork(0, sample)
    manager.check_invariants()
    samples = list(range(num_samples))
    after_fork = manager.stats()["num_blocks_in_use"]
    shared_refcount = manager.refcount(int(manager.block_table(0)[0]))
    for _ in range(generated_tokens):
        manager.append_tokens_batch(samples, num_tokens=1)
    manager.check_invariants()
    copies = manager.take_copy_ops()
    after_decode = manager.stats()["num_blocks_in_use"]
    unshared_after_decode = sum(-(-manager.num_tokens(sample) // block_size) for sample in samples)
    stages = [
        {
            "stage": f"prompt forked into {num_samples} samples",
            "tokens_per_sample": prompt_tokens,
            "blocks_in_use": after_fork,
            "cache_token_slots": after_fork * block_size,
            "unshared_blocks": num_samples * blocks_per_prompt,
        },
        {
            "stage": f"after {generated_tokens} tokens per sample",
            "tokens_per_sample": prompt_tokens + generated_tokens,
            "blocks_in_use": after_decode,
            "cache_token_slots": after_decode * block_size,
            "unshared_blocks": unshared_after_decode,
        },
    ]
    return {
        "prompt_tokens": prompt_tokens,
        "num_samples": num_samples,
        "block_size": block_size,
        "first_block_refcount_after_fork": shared_refcount,
        "copy_ops": copies.tolist(),
        "stages": stages,
    }


def render_copy_on_write(data: Mapping[str, Any]) -> str:
    rows = [
        [
            stage["stage"],
            stage["tokens_per_sample"],
            stage["blocks_in_use"],
            stage["cache_token_slots"],
            stage["unshared_blocks"] * data["block_size"],
            percent(1 - stage["blocks_in_use"] / stage["unshared_blocks"]),
        ]
        for stage in data["stages"]
    ]
    return format_table(
        ["stage", "tokens/sample", "blocks in use", "cache slots", "slots if unshared", "saved"],
        rows,
        title=(
            f"Copy-on-write: {data['num_samples']} samples of a {data['prompt_tokens']}-token prompt "
            f"(block size {data['block_size']}, real KvCacheManager)"
        ),
        note=(
            f"Prompt blocks have refcount {data['first_block_refcount_after_fork']}; decoding copied "
            f"{len(data['copy_ops'])} shared partial block(s) (src, dst): {data['copy_ops']}"
        ),
    )


# ---------------------------------------------------------------- paged attention equals contiguous attention


def attention_check(
    *,
    seq_lens: Sequence[int] = (1, 17, 100, 333, 1000),
    block_size: int = 16,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    seed: int = 0,
    backend: str = "numpy",
    tolerance: float = 1e-5,
) -> dict:
    """Write random keys and values through real block tables whose blocks are scattered over the
    pool, run paged attention over them, and compare with contiguous attention on the same tensors.
    Raises `InvariantViolation` when any output differs by more than ``tolerance``."""
    import pagedkv
    from pagedkv import attention
    from pagedkv.errors import InvariantViolation

    # The cuda backend takes and returns CuPy arrays; the others NumPy arrays.
    if backend == "cuda":
        import cupy

        to_device, to_host = cupy.asarray, cupy.asnumpy
    else:

        def to_device(array: np.ndarray) -> np.ndarray:
            return array

        def to_host(array: np.ndarray) -> np.ndarray:
            return np.asarray(array)

    rng = np.random.default_rng(seed)
    total_blocks = sum(-(-length // block_size) for length in seq_lens)
    manager = pagedkv.KvCacheManager(num_blocks=total_blocks + 8, block_size=block_size)
    # Grow all sequences a block at a time, as decoding interleaves them, so that each table's
    # blocks are scattered over the pool rather than one run.
    for index, length in enumerate(seq_lens):
        manager.add_sequence(index, num_tokens=min(length, block_size))
    growing = True
    while growing:
        growing = False
        for index, length in enumerate(seq_lens):
            missing = length - manager.num_tokens(index)
            if missing > 0:
                manager.append_tokens(index, num_tokens=min(missing, block_size))
                growing = True
    cache_shape = (manager.num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = to_device(np.zeros(cache_shape, dtype=np.float32))
    v_cache = to_device(np.zeros(cache_shape, dtype=np.float32))
    keys, values = [], []
    for index, length in enumerate(seq_lens):
        k = rng.standard_normal((length, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((length, num_kv_heads, head_dim)).astype(np.float32)
        attention.write_kv(
            to_device(k),
            to_device(v),
            k_cache,
            v_cache,
            to_device(manager.slot_mapping([index], length)),
            backend=backend,
        )
        keys.append(k)
        values.append(v)
    seq_ids = list(range(len(seq_lens)))
    block_tables, lens = manager.batch_block_tables(seq_ids)
    q = rng.standard_normal((len(seq_lens), num_q_heads, head_dim)).astype(np.float32)
    paged = to_host(
        attention.paged_attention(
            to_device(q), k_cache, v_cache, to_device(block_tables), to_device(lens), backend=backend
        )
    )
    rows = []
    for index, length in enumerate(seq_lens):
        reference = attention.contiguous_attention(q[index], keys[index], values[index], backend="numpy")
        table = manager.block_table(index)
        rows.append(
            {
                "seq_len": int(length),
                "blocks": int(table.size),
                "scattered": bool(np.any(np.diff(table) != 1)) if table.size > 1 else False,
                "max_abs_diff": float(np.max(np.abs(paged[index] - reference))),
            }
        )
    worst = max(row["max_abs_diff"] for row in rows)
    result = {
        "backend": backend,
        "block_size": block_size,
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "tolerance": tolerance,
        "rows": rows,
        "max_abs_diff": worst,
        "equal": worst <= tolerance,
    }
    if worst > tolerance:
        raise InvariantViolation(
            f"paged attention differs from contiguous attention by {worst:.3g} "
            f"(> {tolerance:g}) on the {backend} backend"
        )
    return result


def render_attention_check(data: Mapping[str, Any]) -> str:
    rows = [
        [row["seq_len"], row["blocks"], row["scattered"], f"{row['max_abs_diff']:.2e}"]
        for row in data["rows"]
    ]
    return format_table(
        ["seq len", "blocks", "scattered blocks", "max |paged - contiguous|"],
        rows,
        title=(
            f"Paged attention = contiguous attention ({data['backend']} backend, fp32, block size "
            f"{data['block_size']}, {data['num_q_heads']} query / {data['num_kv_heads']} KV heads of "
            f"{data['head_dim']})"
        ),
        note=f"max difference {data['max_abs_diff']:.2e} <= tolerance {data['tolerance']:g}: equal",
    )


# ---------------------------------------------------------------- exhaustion and recovery


def _recovery_seconds(
    summary: Mapping[str, Any], cost_model: CostModel, block_size: int, baseline_prefill_tokens: int
) -> dict:
    """Time a run's preemptions add on top of the step clock, priced by the cost model.

    Recompute: the re-prefilled tokens, priced as prefills of the mean recomputed context (a
    swap run falls back to recompute when the host tier is full, so both runs may have some).
    Swap: the blocks copied in both directions, priced per byte and per copy.
    """
    if "recomputed_tokens" in summary:
        recomputed_tokens = int(summary["recomputed_tokens"])
    else:
        recomputed_tokens = max(int(summary["prefill_tokens"]) - baseline_prefill_tokens, 0)
    recompute_preemptions = int(summary.get("recompute_preemptions", summary["preemptions"]))
    recompute_s = 0.0
    if recompute_preemptions and recomputed_tokens:
        mean_context = max(1, round(recomputed_tokens / recompute_preemptions))
        recompute_s = recompute_preemptions * cost_model.recompute_s(mean_context)
    if "swapped_out_blocks" in summary:
        swapped_blocks = int(summary["swapped_out_blocks"]) + int(summary.get("swapped_in_blocks", 0))
    else:
        swapped_blocks = int(summary.get("swapped_blocks", 0))
    bytes_moved = swapped_blocks * block_size * cost_model.model.kv_bytes_per_token
    swap_s = (
        bytes_moved / cost_model.hardware.host_link_bytes_per_s
        + swapped_blocks * cost_model.copies_per_block() * cost_model.hardware.per_transfer_latency_s
    )
    return {
        "recomputed_tokens": recomputed_tokens,
        "recompute_overhead_s": recompute_s,
        "copied_blocks": swapped_blocks,
        "bytes_moved": bytes_moved,
        "swap_overhead_s": swap_s,
        "preemption_overhead_s": recompute_s + swap_s,
    }


def recovery(
    workload: Workload, config: SimConfig, *, cost_model: CostModel | None = None, progress: bool = False
) -> dict:
    """Run out of blocks on purpose and recover, once by recompute and once by swap.

    Both runs use the same device pool; the swap run gets a host tier as large as the device
    pool unless the config sets one. End-to-end time = the simulated clock (steps x step time,
    plus idle gaps between trace arrivals) + the preemption overhead from the cost model (an H200
    with Llama-3-8B by default); tokens per second follow.
    """
    cost_model = cost_model or CostModel()
    host_slots = config.num_host_slots or config.num_slots
    runs = [
        ("recompute", workload, dataclasses.replace(config, allocator="paged", preemption="recompute")),
        (
            "swap",
            workload,
            dataclasses.replace(config, allocator="paged", preemption="swap", num_host_slots=host_slots),
        ),
    ]
    start_s = time.perf_counter()
    results = _runs("recovery", runs, progress)
    wall_s = time.perf_counter() - start_s
    baseline_prefill_tokens = int(np.sum(workload.prompt_tokens))
    rows = {}
    for policy, result in results.items():
        summary = summarize(result)
        summary.update(_recovery_seconds(summary, cost_model, config.block_size, baseline_prefill_tokens))
        end_to_end_s = summary["simulated_seconds"] + summary["preemption_overhead_s"]
        summary["end_to_end_s"] = end_to_end_s
        summary["generated_tokens_per_s"] = (
            summary["generated_tokens"] / end_to_end_s if end_to_end_s > 0 else 0.0
        )
        rows[policy] = summary
    return {
        "workload": wl.describe(workload),
        "config": dataclasses.asdict(config),
        "cost_model": {
            "model": dataclasses.asdict(cost_model.model),
            "hardware": dataclasses.asdict(cost_model.hardware),
        },
        "results": rows,
        "simulation_wall_s": wall_s,
    }


def render_recovery(data: Mapping[str, Any]) -> str:
    config = data["config"]
    rows = []
    for policy, result in data["results"].items():
        rows.append(
            [
                policy,
                result["preemptions"],
                result["finished_requests"],
                result["steps"],
                result["recomputed_tokens"],
                result["copied_blocks"],
                result["bytes_moved"] / 2**20,
                result["preemption_overhead_s"],
                result["generated_tokens_per_s"],
            ]
        )
    model = data["cost_model"]
    return format_table(
        [
            "policy",
            "preemptions",
            "finished",
            "steps",
            "recomputed tokens",
            "blocks copied",
            "MiB moved",
            "overhead (s)",
            "tokens/s",
        ],
        rows,
        title=(
            f"Exhaustion and recovery: {data['workload']['name']}, pool {config['num_slots']:,} slots, "
            f"block size {config['block_size']}, arrival {config['arrival']}"
        ),
        note=(
            f"Time = simulated clock (steps x {config['step_time_s']} s, plus idle gaps between arrivals) + "
            f"preemption overhead priced by the cost model "
            f"({model['model']['name']} on {model['hardware']['name']})."
        ),
    )


# ---------------------------------------------------------------- prefix caching on shared system prompts


def prefix_caching(workload: Workload, config: SimConfig, *, progress: bool = False) -> dict:
    """The same shared-system-prompt workload with prefix caching off and on (paged allocator).

    Hit rate = prefix-cache hit tokens / prompt tokens looked up. Memory saved = 1 - pool in use
    (everything but free and external fragmentation, time-averaged) with caching / without.
    Prefill saved = 1 - prefill tokens computed with caching / without.
    """
    runs = [
        (
            "caching off",
            workload,
            dataclasses.replace(config, allocator="paged", enable_prefix_caching=False),
        ),
        ("caching on", workload, dataclasses.replace(config, allocator="paged", enable_prefix_caching=True)),
    ]
    results = {label: summarize(result) for label, result in _runs("prefix caching", runs, progress).items()}
    off, on = results["caching off"], results["caching on"]

    def in_use(summary: Mapping[str, Any]) -> float:
        return 1.0 - summary["free"] - summary["external_fragmentation"]

    return {
        "workload": wl.describe(workload),
        "config": dataclasses.asdict(config),
        "results": results,
        "hit_rate": on["prefix_hit_tokens"] / on["prefix_query_tokens"] if on["prefix_query_tokens"] else 0.0,
        "memory_saved": 1.0 - in_use(on) / in_use(off) if in_use(off) > 0 else 0.0,
        "prefill_tokens_saved": 1.0 - on["prefill_tokens"] / off["prefill_tokens"]
        if off["prefill_tokens"]
        else 0.0,
    }


def render_prefix_caching(data: Mapping[str, Any]) -> str:
    config = data["config"]
    rows = []
    for label, result in data["results"].items():
        hit_rate = (
            result["prefix_hit_tokens"] / result["prefix_query_tokens"]
            if result["prefix_query_tokens"]
            else 0.0
        )
        rows.append(
            [
                label,
                percent(hit_rate),
                percent(1.0 - result["free"] - result["external_fragmentation"]),
                result["prefill_tokens"],
                result["mean_resident_requests"],
                result["generated_tokens_per_step"],
                result["steps"],
            ]
        )
    return format_table(
        ["run", "hit rate", "pool in use", "prefill tokens", "mean resident", "tokens/step", "steps"],
        rows,
        title=(
            f"Prefix caching: {data['workload']['name']}, pool {config['num_slots']:,} slots, block size "
            f"{config['block_size']}, arrival {config['arrival']}"
        ),
        note=(
            f"hit rate {percent(data['hit_rate'])}, memory saved {percent(data['memory_saved'])}, "
            f"prefill tokens saved {percent(data['prefill_tokens_saved'])}"
        ),
    )


# ---------------------------------------------------------------- the demo: the whole story in under a minute


DEMO_SECTIONS = ("attention", "allocators", "block_size_sweep", "copy_on_write", "recovery", "prefix_caching")


def demo(
    *,
    out: Printer = print,
    progress: bool = True,
    num_requests: int = 1000,
    seed: int = 0,
    attention_backend: str = "numpy",
) -> dict:
    """``pagedkv demo``: six sections, each printed as soon as it is done; returns them all.

    (a) paged attention equals contiguous attention; (b) one synthetic workload under contiguous
    and paged allocation with identical memory; (c) waste per request tracks block_size / 2;
    (d) copy-on-write keeps 4 samples of a 1,000-token prompt near 1,000 tokens of cache;
    (e) exhaustion and recovery by recompute and by swap; (f) prefix caching on shared system
    prompts.
    """
    sections: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    workload = wl.synthetic(num_requests, seed=seed)
    same_memory = SimConfig(
        num_slots=FIGURE2_NUM_SLOTS, max_model_len=2048, block_size=16, arrival="saturated", seed=seed
    )

    def section(
        key: str, heading: str, run: Callable[[], dict], render: Callable[[Mapping[str, Any]], str]
    ) -> None:
        start_s = time.perf_counter()
        sections[key] = run()
        seconds[key] = time.perf_counter() - start_s
        out(f"\n=== {heading} ({seconds[key]:.1f} s)\n")
        out(render(sections[key]))

    section(
        "attention",
        "(a) paged attention equals contiguous attention",
        lambda: attention_check(backend=attention_backend),
        render_attention_check,
    )
    section(
        "allocators",
        "(b) one workload, identical memory: contiguous reservation vs paged blocks",
        lambda: compare_allocators(workload, same_memory, progress=progress),
        render_compare,
    )
    section(
        "block_size_sweep",
        "(c) block-size sweep: waste per request ~ block_size / 2",
        lambda: block_size_sweep(workload, same_memory, progress=progress),
        render_sweep,
    )
    section(
        "copy_on_write",
        "(d) copy-on-write: 4 samples of a 1,000-token prompt",
        copy_on_write,
        render_copy_on_write,
    )
    # A pool of a quarter of the memory, so that the decode phase runs out of blocks.
    tight = dataclasses.replace(same_memory, num_slots=FIGURE2_NUM_SLOTS // 4)
    section(
        "recovery",
        "(e) exhaustion and recovery: recompute vs swap",
        lambda: recovery(wl.synthetic(max(50, num_requests // 2), seed=seed), tight, progress=progress),
        render_recovery,
    )
    chat = wl.system_prompt(max(50, num_requests // 2), seed=seed)
    chat_config = dataclasses.replace(same_memory, num_slots=4 * FIGURE2_NUM_SLOTS, arrival="trace")
    section(
        "prefix_caching",
        "(f) prefix caching: 16 shared system prompts of 1,024 tokens",
        lambda: prefix_caching(chat, chat_config, progress=progress),
        render_prefix_caching,
    )
    sections["seconds"] = seconds
    out(f"\nDemo done in {sum(seconds.values()):.1f} s.")
    return sections
