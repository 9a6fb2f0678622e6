"""The vLLM paper's Figure 2 setting, our token-state shares beside the published ones."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import workloads as wl
from pagedkv.sim.engine import SimConfig
from pagedkv.sim.experiments.common import (
    ALLOCATOR_LABELS,
    ALLOCATORS,
    FIGURE2_NUM_SLOTS,
    PUBLISHED_FIGURE2_TOKEN_STATES,
    run_simulation,
    summarize,
)
from pagedkv.sim.progress import Progress
from pagedkv.sim.reports import Number, Percent, format_table, shares_table


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
                *(Percent(value) for value in ours),
                Percent(queued),
                Percent(published),
                Number(100 * (ours[0] - published), "+.1f", " pts"),
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
