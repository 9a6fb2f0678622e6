"""The int4 capacity of residual designs, estimated from the exact byte accounting before any is
built (docs/quantized_kv.md, "Why an int8 residual").

The memory section's admission replay (``pagedkv.benchmarks.memory``: the engine's layout and
block manager, a 2 GiB budget, each sequence a prompt of C - 1 tokens then its first decode
token, int4 with its residual slots set aside) runs with the int4 byte counts of each design
substituted for ``engine/kv_budget.py``'s:

- ``float16``: the residual before, K and V of the open block in float16 per layer;
- ``per-token-values``: design (a), values quantized per token on write with their own side
  parameters (two bfloat16 per (token, head) in the value block instead of a group byte and
  shared side parameters), so the residual holds keys only, in float16;
- ``int8``: design (b), the residual in int8 (an ``int8`` block of K and V per layer), block
  format unchanged: what ``kv_budget`` counts now.

    python benches/quant_residual_designs.py > benches/results/2026-12-06-quant-capacity-v2-designs.json
"""

from __future__ import annotations

import json
from typing import Any

import pagedkv.benchmarks.memory as memory
import pagedkv.engine.kv_budget as kv_budget
from pagedkv.attention import block_bytes
from pagedkv.commands.engine import _header_config
from pagedkv.engine.kv_layout import KvLayout

DESIGNS = ("float16", "per-token-values", "int8")
BUDGET_BYTES = 2 << 30
CONTEXTS = (2048, 8192)
POOL_BLOCK_BYTES = kv_budget.pool_block_bytes  # the real one, before any design replaces it


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def _patched(design: str) -> tuple[Any, Any]:
    def residual(layout: KvLayout, bs: int, heads: int, dim: int, dtype: str) -> int:
        if dtype != "int4":
            return 0
        per_layer = {
            "float16": 2 * block_bytes("float16", bs, heads, dim),
            "per-token-values": block_bytes("float16", bs, heads, dim),
            "int8": 2 * block_bytes("int8", bs, heads, dim),
        }[design]
        return layout.num_groups * layout.layers_per_group * per_layer

    def pool(layout: KvLayout, bs: int, heads: int, dim: int, dtype: str) -> int:
        if dtype != "int4" or design != "per-token-values":
            return POOL_BLOCK_BYTES(layout, bs, heads, dim, dtype)
        key = block_bytes("int4", bs, heads, dim, role="key")
        value = _round16(bs * heads * dim // 2 + bs * heads * 4)  # codes + two bfloat16 per row
        return layout.layers_per_group * (key + value)

    return residual, pool


def main() -> None:
    out: dict[str, Any] = {"budget_bytes": BUDGET_BYTES, "designs": {}}
    saved = (kv_budget.residual_bytes_per_sequence, POOL_BLOCK_BYTES, memory.pool_block_bytes)
    for design in DESIGNS:
        residual, pool = _patched(design)
        kv_budget.residual_bytes_per_sequence = memory.residual_bytes_per_sequence = residual
        kv_budget.pool_block_bytes = memory.pool_block_bytes = pool
        rows = {}
        for model in ("smollm2", "gemma3"):
            config = _header_config(None if model == "smollm2" else "gemma3")
            dtypes = memory._dtypes(config, CONTEXTS, 16, BUDGET_BYTES, ("float16", "int4"))
            int4 = dtypes["int4"]
            rows[model] = {
                "int4_block_bytes": int4["bytes_per_block"],
                "residual_bytes_per_sequence": int4["residual_bytes_per_sequence"],
                **{
                    str(c): {
                        "sequences": int4["contexts"][str(c)]["batch_admitted"],
                        "vs_float16": round(int4["contexts"][str(c)]["vs_float16"], 3),
                    }
                    for c in CONTEXTS
                },
            }
        out["designs"][design] = rows
    kv_budget.residual_bytes_per_sequence, kv_budget.pool_block_bytes, memory.pool_block_bytes = saved
    memory.residual_bytes_per_sequence = saved[0]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
