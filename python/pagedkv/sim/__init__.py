"""Trace replay under paged and contiguous allocators: workloads, traces, experiments, reports.

The replay engine is ``pagedkv.sim.engine`` (Rust, driven from Python); the other modules build
workloads for it, run the experiments of the PagedAttention story and print their results.
"""
