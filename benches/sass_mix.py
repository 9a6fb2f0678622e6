"""Static SASS instruction mix of kernel instances, no GPU needed: what the compiler made of them.

    pip install nvidia-cuda-nvrtc nvidia-cuda-nvdisasm
    python benches/sass_mix.py                      # the decode kernel, fp16, head_dim 128, groups 1-8
    python benches/sass_mix.py --kind bfloat16 --arch sm_90 --ops FFMA,FMUL,FADD,LDG,SHFL

Each instance is compiled by NVRTC to a cubin (the same options the cuda backend uses) and
disassembled by nvdisasm; the table counts instructions by opcode (the text before the first
'.'), static counts over the whole kernel, so unrolled loop bodies count once per unrolled copy.
Rows: the CUDA-core decode kernel at every group instance and, for fp16/bf16, the tensor-core
decode kernel (which the launcher runs for group instances 4 and 8). `loop` is the static length
of the tile loop (instructions per thread per tile: the body between the loop head and the
backward branch whose body holds the loop's two block barriers) and `wi/B` the warp-instructions
it issues per byte of K and V (4 warps x loop / tile bytes): the issue cost per KV byte when every
tile takes the main path.
A proxy for issue cost, not a timing: e.g. a q.k dot product as one FFMA chain shows as FFMA only,
the a*b + c*d + ... form as FMUL + FFMA + FADD.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile


def nvdisasm() -> str:
    for base in sys.path:
        for path in glob.glob(os.path.join(base, "nvidia", "*", "bin", "nvdisasm")):
            return path
    raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm")


def opcode_counts(cubin: bytes) -> collections.Counter[str]:
    return _count(disassemble(cubin))


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm(), f.name], capture_output=True, text=True, check=True).stdout


def _count(text: str) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        # "        /*0090*/                   FFMA R4, R2, R3, R4 ;" (optionally predicated "@P0")
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            counts[m.group(1)] += 1
    return counts


def tile_loop_length(text: str, barriers: int = 2) -> int:
    """Instructions in the longest loop (backward branch to a label) whose body holds exactly
    `barriers` BAR.SYNC: the decode kernels' tile loop. 0 if there is none."""
    labels: dict[str, int] = {}
    pending: list[str] = []
    instrs: list[tuple[int, str]] = []
    for line in text.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            address = int(m.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            instrs.append((address, m.group(2)))
    best = 0
    for address, ins in instrs:
        branch = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ins)
        if branch and labels.get(branch.group(1), address) < address:
            body = [i for a, i in instrs if labels[branch.group(1)] <= a <= address]
            if sum("BAR.SYNC" in i for i in body) == barriers:
                best = max(best, len(body))
    return best


def main(argv: list[str] | None = None) -> int:
    from pagedkv.kernels import instances, nvrtc

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kind", default="float16", choices=list(instances.KERNEL_TYPES))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--arch", default=nvrtc.DEFAULT_ARCH)
    parser.add_argument("--ops", default="FFMA,FMUL,FADD,HFMA2,HMMA,LDG,LDS,STS,SHFL,BAR,MUFU")
    args = parser.parse_args(argv)
    ops = args.ops.split(",")
    print(f"NVRTC {'.'.join(map(str, nvrtc.version()))}, {args.arch}, static SASS counts")
    print(
        f"{'instance':<62} {'regs':>4} {'spill':>5} {'total':>6} {'loop':>5} {'wi/B':>6} "
        + " ".join(f"{o:>6}" for o in ops)
    )
    picks = [
        instances.decode(args.kind, args.head_dim, args.block_size, g) for g in instances.GROUP_INSTANCES
    ]
    if args.kind in instances.DECODE_MMA_KINDS and args.head_dim in instances.DECODE_MMA_HEAD_DIMS:
        picks.append(instances.decode_mma(args.kind, args.head_dim, args.block_size))
    elem_bytes = 4 if args.kind == "float32" else 2
    tile_bytes = 2 * instances.tile_tokens(args.kind, args.head_dim) * args.head_dim * elem_bytes
    warps = instances.DECODE_THREADS // 32
    for inst in picks:
        result = nvrtc.compile_source(inst.source, [inst.name], args.arch)
        res = result.resources[result.lowered_names[inst.name]]
        text = disassemble(result.cubin)
        counts = _count(text)
        loop = tile_loop_length(text)
        print(
            f"{inst.name:<62} {res.registers:>4} {res.spill_stores_bytes:>5} {sum(counts.values()):>6} "
            f"{loop:>5} {warps * loop / tile_bytes:>6.3f} " + " ".join(f"{counts.get(o, 0):>6}" for o in ops)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
