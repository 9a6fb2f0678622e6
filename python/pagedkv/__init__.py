"""pagedkv: a paged KV-cache allocator with PagedAttention kernels, a simulator and a visualizer."""

from pagedkv._core import (
    BlockHandle,
    BlockPool,
    FullAttention,
    KvCacheManager,
    SlidingWindow,
    __version__,
    reduce_block_hash,
)
from pagedkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvariantViolation,
    OutOfBlocksError,
    PagedKvError,
    SequenceExistsError,
    SequenceSwappedOutError,
    StaleHandleError,
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
    "DoubleFreeError",
    "StaleHandleError",
    "InvariantViolation",
    "BlockHandle",
    "BlockPool",
    "KvCacheManager",
    "FullAttention",
    "SlidingWindow",
    "reduce_block_hash",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KvEvent",
]
