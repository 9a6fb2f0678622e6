"""The simulator's names, in one place: allocators, placements, workloads, known traces.

Plain tuples and dicts with no NumPy import, so that the command line can offer them as choices
without paying for NumPy before a command runs.
"""

from __future__ import annotations

__all__ = [
    "ALLOCATORS",
    "PAGED",
    "CONTIGUOUS_ALLOCATORS",
    "ALLOCATOR_LABELS",
    "PLACEMENTS",
    "PREEMPTIONS",
    "SYNTHETIC_WORKLOADS",
    "KNOWN_TRACES",
    "PREFIX_TRACES",
    "TRACE_WORKLOADS",
    "PREFIX_TRACE_WORKLOADS",
    "SCHEDULING_POLICIES",
    "WORKLOAD_CHOICES",
    "allocator_label",
]

PAGED = "paged"
# Contiguous reservation per request: for the longest possible request (max), for a power-of-two
# guess of its length (pow2), or for its exact final length (oracle) -- the vLLM paper's three
# Orca variants.
CONTIGUOUS_ALLOCATORS = ("contiguous-max", "contiguous-pow2", "contiguous-oracle")
ALLOCATORS = (PAGED, *CONTIGUOUS_ALLOCATORS)
# How tables and plots name each allocator: the option name with what it stands for, one name
# per allocator everywhere (the paper calls the contiguous ones Orca and the paged one vLLM).
ALLOCATOR_LABELS = {
    "paged": "paged (vLLM)",
    "contiguous-max": "contiguous-max (Orca Max)",
    "contiguous-pow2": "contiguous-pow2 (Orca Pow2)",
    "contiguous-oracle": "contiguous-oracle (Orca Oracle)",
}
# Address-space allocators of the contiguous policies.
PLACEMENTS = ("first-fit", "buddy")
PREEMPTIONS = ("recompute", "swap")
SYNTHETIC_WORKLOADS = ("synthetic", "sharegpt", "lognormal", "system-prompt", "alpaca", "many-tenants")
# Short names of the real traces (--workload azure-conv), by file name in a traces folder.
KNOWN_TRACES = {
    "azure-conv": "azure_llm_2023_conv.csv",
    "azure-code": "azure_llm_2023_code.csv",
}
TRACE_WORKLOADS = tuple(KNOWN_TRACES)
# The Mooncake prefix-sharing traces of `pagedkv cluster` (--workload mooncake-conversation), by
# path in a traces folder (JSONL: timestamp, lengths and chained prefix-block ids).
PREFIX_TRACES = {
    "mooncake-conversation": "mooncake/conversation_trace.jsonl",
    "mooncake-synthetic": "mooncake/synthetic_trace.jsonl",
}
PREFIX_TRACE_WORKLOADS = tuple(PREFIX_TRACES)
WORKLOAD_CHOICES = SYNTHETIC_WORKLOADS + TRACE_WORKLOADS + PREFIX_TRACE_WORKLOADS
# Admission orders of the waiting queue (docs/scheduling.md).
SCHEDULING_POLICIES = ("fcfs", "lpm", "dfs")


def allocator_label(allocator: str) -> str:
    """The name tables and plots give ``allocator`` (its own name when unknown)."""
    return ALLOCATOR_LABELS.get(allocator, allocator)
