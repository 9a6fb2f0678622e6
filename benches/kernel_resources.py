"""Registers, spills, shared memory and predicted occupancy of the attention kernels, no GPU needed.

    python benches/kernel_resources.py                       # sm_90, block 16, every kind and head dim
    python benches/kernel_resources.py --arch sm_90 --block-size 16 --kind float16 --head-dim 128

Each instance is compiled by NVRTC exactly as the cuda backend compiles it (``nvrtc.compile_source``,
``--ptxas-options=-v``); the table is ptxas's report for it, and ``CTAs/SM`` is what the
occupancy rules predict from those registers and that shared memory
(``split_planning.ctas_per_sm_from_resources``, the SM 9.0 limits): a prediction, which the
device's occupancy API (``DecodeWorkspace.ctas_per_sm()`` on a GPU) confirms or corrects.
docs/decode_kernel.md quotes this table.
"""

from __future__ import annotations

import argparse
import sys

from pagedkv.attention.split_planning import ctas_per_sm_from_resources
from pagedkv.kernels import instances, nvrtc


def rows(kind: str, head_dim: int, block_size: int) -> list[instances.Instance]:
    """The CUDA-core decode instance of every group, the tensor-core decode one and the prefill
    one where they exist."""
    picks = [instances.decode(kind, head_dim, block_size, g) for g in instances.GROUP_INSTANCES]
    if kind in instances.DECODE_MMA_KINDS and head_dim in instances.DECODE_MMA_HEAD_DIMS:
        picks.append(instances.decode_mma(kind, head_dim, block_size))
    if kind in instances.PREFILL_KINDS and head_dim in instances.PREFILL_HEAD_DIMS:
        picks.append(instances.prefill(kind, head_dim, block_size))
    return picks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kind", choices=list(instances.KERNEL_TYPES), help="default: every kind")
    parser.add_argument("--head-dim", type=int, choices=instances.HEAD_DIMS, help="default: every head dim")
    parser.add_argument("--block-size", type=int, default=16, choices=instances.BLOCK_SIZES)
    parser.add_argument("--arch", default=nvrtc.DEFAULT_ARCH)
    args = parser.parse_args(argv)
    kinds = [args.kind] if args.kind else list(instances.KERNEL_TYPES)
    head_dims = [args.head_dim] if args.head_dim else list(instances.HEAD_DIMS)
    print(f"NVRTC {'.'.join(map(str, nvrtc.version()))}, {args.arch}, block {args.block_size}")
    print(f"{'instance':<64} {'regs':>4} {'spill':>5} {'smem':>6} {'CTAs/SM':>7}")
    for kind in kinds:
        for head_dim in head_dims:
            for inst in rows(kind, head_dim, args.block_size):
                result = nvrtc.compile_source(inst.source, [inst.name], args.arch)
                res = result.resources[result.lowered_names[inst.name]]
                ctas = ctas_per_sm_from_resources(
                    res.registers, res.shared_bytes, instances.threads_per_cta(inst)
                )
                spill = res.spill_stores_bytes + res.spill_loads_bytes
                line = f"{inst.name:<64} {res.registers:>4} {spill:>5} {res.shared_bytes:>6} {ctas:>7}"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
