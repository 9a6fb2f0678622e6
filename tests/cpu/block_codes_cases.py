"""Random block-quantized matrices for the two projection kernels' tests: codes spanning a code
format's whole range, fp16-representable scales and offsets (as GGUF files store them)."""

from __future__ import annotations

import numpy as np
from pagedkv.models.block_codes import BlockCodes

# code format -> [lowest, highest + 1) of its codes
CODE_RANGES = {"i8": (-128, 128), "u4": (0, 16), "i4": (-8, 8)}


def random_codes(n: int, k: int, block: int, seed: int, fmt: str = "i8", offsets: bool = True) -> BlockCodes:
    """An ``[n, k]`` matrix in blocks of ``block`` with codes of format ``fmt`` (zero offsets when
    ``offsets`` is false)."""
    rng = np.random.default_rng(seed)
    nb = k // block
    return BlockCodes(
        codes=rng.integers(*CODE_RANGES[fmt], size=(n, k)).astype(np.int8),
        scales=(rng.standard_normal((n, nb)) / 64).astype(np.float16).astype(np.float32),
        offsets=(rng.standard_normal((n, nb)) / 8 * offsets).astype(np.float16).astype(np.float32),
        block=block,
    )
