"""``QuantizedKvCache``: one quantized cache tensor (the keys, or the values, of one layer).

The blocks are one uint8 array ``data [num_blocks, block_bytes]``: each row holds a block's codes
and every scale that decodes them (``kv_cache_dtype.block_layout``), so copy-on-write, swap and
offload move rows of bytes as they are. An int4 cache also holds ``residual``, an ``"int8"``
``QuantizedKvCache`` of ``num_residual_slots`` blocks (``RESIDUAL_FORMAT``): one slot per running
sequence, holding the tokens of its last block, quantized to 8 bits as they are written, until
that block fills and is *sealed* (re-quantized to int4; docs/quantized_kv.md). Slots copy and
swap as any quantized block does. ``shape`` is the logical ``[num_blocks, block_size,
num_kv_heads, head_dim]`` of an unquantized cache, so paged metadata checks read the same way.

The functions of ``pagedkv.attention`` take a ``QuantizedKvCache`` wherever they take a cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.attention.kv_cache_dtype import QUANTIZED_DTYPES, RESIDUAL_FORMAT, BlockLayout, block_layout
from pagedkv.errors import InvalidArgumentError

__all__ = ["QuantizedKvCache"]


@dataclass(frozen=True, eq=False)
class QuantizedKvCache:
    """A quantized cache tensor; build one with ``QuantizedKvCache.empty``.

    data: uint8 ``[num_blocks, block_bytes]`` (NumPy, or CuPy for backend='cuda'), C-contiguous.
    kv_cache_dtype: "int8" | "fp8_e4m3" | "int4". role: "key" | "value" (int4 keys are quantized
    per channel over a block's tokens, values per token).
    residual (int4 only): the residual slots, a ``RESIDUAL_FORMAT`` (``"int8"``) cache of the same
    role and geometry whose block ``s`` is slot ``s`` (its ``data`` on the same device as
    ``data``); None for the 8-bit dtypes.
    """

    data: Any
    kv_cache_dtype: str
    role: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    residual: Any = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in QUANTIZED_DTYPES:
            raise InvalidArgumentError(
                f"QuantizedKvCache.kv_cache_dtype must be one of {QUANTIZED_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        layout = block_layout(
            self.kv_cache_dtype, self.role, self.block_size, self.num_kv_heads, self.head_dim
        )
        object.__setattr__(self, "_layout", layout)
        if self.kv_cache_dtype == "int4":
            r = self.residual
            if not isinstance(r, QuantizedKvCache):
                raise InvalidArgumentError(
                    "an int4 QuantizedKvCache needs a residual: a QuantizedKvCache of "
                    f"{RESIDUAL_FORMAT!r} (0 slots allowed), got {type(r).__name__}"
                )
            want = (RESIDUAL_FORMAT, self.role, self.block_size, self.num_kv_heads, self.head_dim)
            got = (r.kv_cache_dtype, r.role, r.block_size, r.num_kv_heads, r.head_dim)
            if got != want:
                raise InvalidArgumentError(
                    f"an int4 cache's residual must be (kv_cache_dtype, role, block_size, "
                    f"num_kv_heads, head_dim) = {want}, got {got}"
                )
        if self.kv_cache_dtype != "int4" and self.residual is not None:
            raise InvalidArgumentError(f"a {self.kv_cache_dtype} QuantizedKvCache has no residual")

    @classmethod
    def empty(
        cls,
        kv_cache_dtype: str,
        role: str,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_residual_slots: int = 0,
        xp: Any = np,
    ) -> QuantizedKvCache:
        """A zero-filled cache of ``num_blocks`` blocks (and, int4, ``num_residual_slots`` residual
        slots); ``xp``: numpy or cupy."""
        layout = block_layout(kv_cache_dtype, role, block_size, num_kv_heads, head_dim)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        if (
            isinstance(num_residual_slots, bool)
            or not isinstance(num_residual_slots, int)
            or num_residual_slots < 0
        ):
            raise InvalidArgumentError(
                f"num_residual_slots must be a non-negative int, got {num_residual_slots!r}"
            )
        data = xp.zeros((num_blocks, layout.block_bytes), dtype=np.uint8)
        residual = None
        if kv_cache_dtype == "int4":
            residual = cls.empty(
                RESIDUAL_FORMAT, role, num_residual_slots, block_size, num_kv_heads, head_dim, xp=xp
            )
        return cls(data, kv_cache_dtype, role, block_size, num_kv_heads, head_dim, residual)

    @property
    def layout(self) -> BlockLayout:
        layout: BlockLayout = self.__dict__["_layout"]
        return layout

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[0]) if getattr(self.data, "ndim", 0) == 2 else 0

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical ``(num_blocks, block_size, num_kv_heads, head_dim)``."""
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def ndim(self) -> int:
        return 4

    @property
    def num_residual_slots(self) -> int:
        return 0 if self.residual is None else self.residual.num_blocks

    @property
    def nbytes(self) -> int:
        """Bytes held: the blocks and (int4) the residual slots."""
        return int(self.data.nbytes) + (0 if self.residual is None else int(self.residual.nbytes))
