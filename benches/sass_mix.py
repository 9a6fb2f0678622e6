"""Static SASS instruction mix of kernel instances, no GPU needed: what the compiler made of them.

    pip install nvidia-cuda-nvrtc nvidia-cuda-nvdisasm
    python benches/sass_mix.py                      # the decode kernel, fp16, head_dim 128, groups 1-8
    python benches/sass_mix.py --kind bfloat16 --arch sm_90 --ops FFMA,FMUL,FADD,LDG,SHFL

Each instance is compiled by NVRTC to a cubin (the same options the cuda backend uses) and
disassembled by nvdisasm; the table counts instructions by opcode (the text before the first
'.'), static counts over the whole kernel, so unrolled loop bodies count once per unrolled copy.
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
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm(), f.name], capture_output=True, text=True, check=True).stdout
    counts: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        # "        /*0090*/                   FFMA R4, R2, R3, R4 ;" (optionally predicated "@P0")
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            counts[m.group(1)] += 1
    return counts


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
    print(f"{'instance':<62} {'regs':>4} {'spill':>5} {'total':>6} " + " ".join(f"{o:>6}" for o in ops))
    for group in instances.GROUP_INSTANCES:
        inst = instances.decode(args.kind, args.head_dim, args.block_size, group)
        result = nvrtc.compile_source(inst.source, [inst.name], args.arch)
        res = result.resources[result.lowered_names[inst.name]]
        counts = opcode_counts(result.cubin)
        print(
            f"{inst.name:<62} {res.registers:>4} {res.spill_stores_bytes:>5} {sum(counts.values()):>6} "
            + " ".join(f"{counts.get(o, 0):>6}" for o in ops)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
