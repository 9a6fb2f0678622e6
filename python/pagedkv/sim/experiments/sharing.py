"""Blocks saved by copy-on-write sharing: parallel sampling and beam search on a real manager."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pagedkv.sim import workloads as wl
from pagedkv.sim.experiments.common import (
    PUBLISHED_SHARING_SAVINGS,
)
from pagedkv.sim.progress import Progress
from pagedkv.sim.reports import Percent, format_table


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
                        workload.prompt_tokens.tolist(), workload.output_tokens.tolist(), strict=True
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


def compare_with_published(blocks_saved: float, bounds: Sequence[float] | None) -> str:
    """``"within"`` the published range, ``"below by 3.1 pts"``, ``"above by 2.0 pts"``, or ``"-"``
    without a published range."""
    if bounds is None:
        return "-"
    low, high = bounds
    if blocks_saved < low:
        return f"below by {100 * (low - blocks_saved):.1f} pts"
    if blocks_saved > high:
        return f"above by {100 * (blocks_saved - high):.1f} pts"
    return "within"


def render_sharing(data: Mapping[str, Any]) -> str:
    rows = []
    outside = 0
    for row in data["rows"]:
        bounds = data["published"].get(row["kind"]) if row["workload"] == "alpaca" else None
        verdict = compare_with_published(row["blocks_saved"], bounds)
        outside += verdict not in ("-", "within")
        rows.append(
            [
                row["workload"],
                row["kind"],
                row["width"],
                Percent(row["blocks_saved"]),
                f"{100 * bounds[0]:.1f}-{100 * bounds[1]:.1f} %" if bounds else "-",
                verdict,
                row["mean_logical_blocks"],
                row["mean_physical_blocks"],
                row["cow_copies"],
            ]
        )
    note = "Published: vLLM paper section 6.3, OPT-13B on Alpaca, the range over n / width 2, 4 and 6. " + (
        f"{outside} row(s) fall outside it: our workloads are length-matched stand-ins and our beam "
        "search scores a random model, so beams diverge differently (docs/experiments.md)."
        if outside
        else "Every Alpaca row lies within it."
    )
    return format_table(
        [
            "workload",
            "kind",
            "n / width",
            "blocks saved",
            "published (Alpaca)",
            "ours vs published",
            "unshared blocks",
            "shared blocks",
            "CoW copies",
        ],
        rows,
        title=(
            f"Sharing savings (real KvCacheManager, block size {data['block_size']}, "
            f"{data['num_requests']} groups per row; blocks averaged over decode steps)"
        ),
        note=note,
    )
