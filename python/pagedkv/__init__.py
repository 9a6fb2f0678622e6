"""pagedkv: a paged KV-cache allocator with PagedAttention kernels, a simulator and a visualizer."""

from pagedkv._core import BlockPool, KvCacheManager, __version__
from pagedkv.errors import (
    InvalidArgumentError,
    InvariantViolation,
    OutOfBlocksError,
    PagedKvError,
    SequenceExistsError,
    SequenceSwappedOutError,
    UnknownSequenceError,
)
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = [
    "__version__",
    "PagedKvError",
    "OutOfBlocksError",
    "UnknownSequenceError",
    "SequenceExistsError",
    "SequenceSwappedOutError",
    "InvalidArgumentError",
    "InvariantViolation",
    "BlockPool",
    "KvCacheManager",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KvEvent",
]
