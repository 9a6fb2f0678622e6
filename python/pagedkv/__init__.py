"""pagedkv: a paged KV-cache allocator with PagedAttention kernels, a simulator and a visualizer.

The allocator's classes come from the compiled extension ``pagedkv._core``, loaded on their first
use (a module ``__getattr__``, PEP 562) rather than at ``import pagedkv``: the parts of the package
that do not need it (the attention kernels and their launchers, the NumPy reference, the errors and
event types) then import even where the extension cannot load, e.g. a prebuilt ``_core`` carried to
a machine with an older C library. The names and objects are the same either way
(``pagedkv.KvCacheManager is pagedkv._core.KvCacheManager``); where the extension does not load,
the first use of one of its names raises ImportError with the loader's reason.
"""

import typing as _typing

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
from pagedkv.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

if _typing.TYPE_CHECKING:  # what type checkers see; at run time __getattr__ below supplies these names
    from pagedkv._core import (
        BlockHandle,
        BlockPool,
        FullAttention,
        KvCacheManager,
        MambaState,
        SlidingWindow,
        __version__,
        reduce_block_hash,
    )

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
    "MambaState",
    "reduce_block_hash",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KvEvent",
]

_CORE_NAMES = frozenset(
    {
        "__version__",
        "BlockHandle",
        "BlockPool",
        "KvCacheManager",
        "FullAttention",
        "SlidingWindow",
        "MambaState",
        "reduce_block_hash",
    }
)


def __getattr__(name: str) -> _typing.Any:
    if name not in _CORE_NAMES:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    try:
        from pagedkv import _core
    except ImportError as error:
        raise ImportError(
            f"pagedkv.{name} needs the compiled extension pagedkv._core, which does not load: {error}"
        ) from error
    value = getattr(_core, name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_CORE_NAMES})
