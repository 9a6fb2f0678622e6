"""The decode comparison's arithmetic and printout.

Each run of ``decode_comparison`` measures pagedkv's engine, llama.cpp's single stream and
llama.cpp's batched decode back to back; a ratio is always taken within one run (the machine's
load moves between runs far more than within one), against llama.cpp's faster thread setting in
that run. Over the runs the summary gives each ratio's median and its range. The same ratios of
tokens per second of process CPU time (``per_cpu_s``) are steadier on a shared machine: a process
that waits for a core is not charged for the wait (llama.cpp's threads are charged for spinning).
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["print_decode_comparison", "run_ratios", "summarize_runs"]

# Per batch: pagedkv over llama.cpp's single stream, pagedkv over llama.cpp batched at that batch,
# and llama.cpp batched over its own single stream.
RATIO_KEYS = ("ratio_to_llama_cpp", "ratio_to_llama_cpp_batched", "llama_cpp_batched_over_single")


def _fastest(rows: list[dict[str, Any]], rate: str = "tokens_per_s") -> dict[str, Any] | None:
    ran = [r for r in rows if rate in r]
    return max(ran, key=lambda r: r[rate]) if ran else None


def _fastest_batched(
    rows: list[dict[str, Any]], batch: str, rate: str = "tokens_per_s"
) -> dict[str, Any] | None:
    """The faster thread setting's row of llama.cpp's batch API at ``batch`` sequences."""
    ran = [r["batches"][batch] | {"threads": r["threads"]} for r in rows if batch in r.get("batches", {})]
    return _fastest(ran, rate)


def run_ratios(run: dict[str, Any], rate: str = "tokens_per_s") -> dict[str, Any]:
    """One run's baselines and ratios of ``rate``: ``run`` holds ``pagedkv`` ({batch: row}),
    ``llama_cpp_single`` and ``llama_cpp_batched`` (one row per thread setting, or a ``skipped``
    note each); llama.cpp's baselines are its faster thread setting by ``rate``."""
    single = _fastest(run["llama_cpp_single"], rate)
    out: dict[str, Any] = {"llama_cpp": single, "llama_cpp_batched": {}} | {key: {} for key in RATIO_KEYS}
    for batch, row in run["pagedkv"].items():
        batched = _fastest_batched(run["llama_cpp_batched"], batch, rate)
        if batched is not None:
            out["llama_cpp_batched"][batch] = batched
        if rate not in row:
            continue
        if single is not None:
            out["ratio_to_llama_cpp"][batch] = row[rate] / single[rate]
        if batched is not None:
            out["ratio_to_llama_cpp_batched"][batch] = row[rate] / batched[rate]
            if single is not None:
                out["llama_cpp_batched_over_single"][batch] = batched[rate] / single[rate]
    return out


def _ratio_summary(per_run: list[dict[str, Any]], batches: list[str]) -> dict[str, Any]:
    """Each ratio family's median per batch over the runs, and its [min, max] under ``ratio_ranges``."""
    summary: dict[str, Any] = {"ratio_ranges": {}}
    for key in RATIO_KEYS:
        values = {b: [r[key][b] for r in per_run if b in r[key]] for b in batches}
        summary[key] = {b: _median(v) for b, v in values.items() if v}
        summary["ratio_ranges"][key] = {b: [min(v), max(v)] for b, v in values.items() if v}
    return summary


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs (tokens/s and every within-run ratio) and each ratio's [min, max]."""
    per_run = [run_ratios(run) for run in runs]
    batches = list(runs[0]["pagedkv"])
    result: dict[str, Any] = {
        "pagedkv": {b: _rate_medians([run["pagedkv"][b] for run in runs]) for b in batches}
    }
    singles = [r["llama_cpp"] for r in per_run if r["llama_cpp"] is not None]
    if singles:
        result["llama_cpp"] = _rate_medians(singles)
    else:
        result["llama_cpp"] = {"skipped": _skip_reason(runs[0]["llama_cpp_single"])}
    batched = {
        b: [r["llama_cpp_batched"][b] for r in per_run if b in r["llama_cpp_batched"]] for b in batches
    }
    if any(batched.values()):
        result["llama_cpp_batched"] = {b: _rate_medians(rows) for b, rows in batched.items() if rows}
    else:
        result["llama_cpp_batched"] = {"skipped": _skip_reason(runs[0]["llama_cpp_batched"])}
    result |= _ratio_summary(per_run, batches)
    per_cpu = [run_ratios(run, "tokens_per_cpu_s") for run in runs]
    result["per_cpu_s"] = _ratio_summary(per_cpu, batches)
    result["runs"] = [
        run | {key: r[key] for key in RATIO_KEYS} | {"per_cpu_s": {key: c[key] for key in RATIO_KEYS}}
        for run, r, c in zip(runs, per_run, per_cpu, strict=True)
    ]
    return result


def _rate_medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each rate every row has, and the thread setting most rows ran with."""
    out: dict[str, Any] = {
        rate: _median([r[rate] for r in rows])
        for rate in ("tokens_per_s", "tokens_per_cpu_s")
        if all(rate in r for r in rows)
    }
    if all("threads" in r for r in rows):
        out["threads"] = statistics.mode(r["threads"] for r in rows)
    return out


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _skip_reason(rows: list[dict[str, Any]]) -> str:
    return next((r["skipped"] for r in rows if "skipped" in r), "no row")


def _ratio(result: dict[str, Any], key: str, batch: str, what: str) -> list[str]:
    """``["2.10x <what> [1.90-2.40]"]`` (median and range over the runs), or ``[]`` when not measured."""
    ratio = result.get(key, {}).get(batch)
    if ratio is None:
        return []
    low, high = result.get("ratio_ranges", {}).get(key, {}).get(batch, [ratio, ratio])
    return [f"{ratio:.2f}x {what} [{low:.2f}-{high:.2f}]"]


def _equals(parts: list[str]) -> str:
    return " = " + ", ".join(parts) if parts else ""


def print_decode_comparison(result: dict[str, Any]) -> None:
    runs = result.get("runs", [])
    print(f"pagedkv weights: {result.get('weights', 'fp32')} (PAGEDKV_WEIGHTS; docs/cpu_data_plane.md)")
    print(
        f"decode: {len(runs)} run(s), pagedkv and llama.cpp alternating, engine threads: "
        f"{result.get('threads', '?')}; medians over the runs, [min-max] of the within-run ratios"
    )
    for i, run in enumerate(runs, 1):
        pagedkv = " / ".join(f"{r['tokens_per_s']:.1f}" for r in run["pagedkv"].values())
        single = ", ".join(
            f"{r['tokens_per_s']:.1f} ({r['threads']} thr)" for r in run["llama_cpp_single"] if "threads" in r
        )
        batched = "; ".join(
            " / ".join(f"{b['tokens_per_s']:.1f}" for b in r["batches"].values()) + f" ({r['threads']} thr)"
            for r in run["llama_cpp_batched"]
            if "batches" in r
        )
        sizes = "/".join(run["pagedkv"])
        llama = f"llama.cpp single {single or '-'}; batched {batched or '-'}"
        print(f"  run {i}: pagedkv {sizes}: {pagedkv} tok/s; {llama}")
    for batch, r in result["pagedkv"].items():
        parts = _ratio(result, "ratio_to_llama_cpp", batch, "llama.cpp's single stream")
        parts += _ratio(result, "ratio_to_llama_cpp_batched", batch, f"llama.cpp batched at {batch}")
        print(f"pagedkv decode batch {batch:>3}: {r['tokens_per_s']:.1f} tok/s{_equals(parts)}")
        cpu = result.get("per_cpu_s", {})
        parts = _ratio(cpu, "ratio_to_llama_cpp", batch, "single")
        parts += _ratio(cpu, "ratio_to_llama_cpp_batched", batch, f"batched at {batch}")
        if parts:
            print(f"    per CPU-second: {', '.join(parts)}")
    llama = result["llama_cpp"]
    if "tokens_per_s" in llama:
        print(f"llama.cpp single stream: {llama['tokens_per_s']:.1f} tok/s ({llama['threads']} threads)")
    else:
        print(f"llama.cpp: {llama['skipped']}")
    batched = result.get("llama_cpp_batched", {"skipped": "not measured"})
    if "skipped" in batched:
        print(f"llama.cpp batched: {batched['skipped']}")
    else:
        for batch, row in batched.items():
            scale = _ratio(result, "llama_cpp_batched_over_single", batch, "its single stream")
            scale += _ratio(
                result.get("per_cpu_s", {}), "llama_cpp_batched_over_single", batch, "per CPU-second"
            )
            print(
                f"llama.cpp batched at {batch:>3}: {row['tokens_per_s']:.1f} tok/s ({row['threads']} threads)"
                f"{_equals(scale)}"
            )
    k = result["attention_kernel"]
    print(
        f"attention kernel: {k['attention_gb_per_s']:.2f} GB/s of K/V vs copy {k['copy_gb_per_s']:.2f} GB/s "
        f"({k['attention_over_copy']:.2f}x)"
    )
