"""The pagedkv exception hierarchy.

Defined in Python (not in the extension) so that an error can be both a ``PagedKvError`` and
the built-in it refines (``KeyError``, ``ValueError``); the Rust bindings raise these classes.
"""

from __future__ import annotations

__all__ = [
    "PagedKvError",
    "OutOfBlocksError",
    "UnknownSequenceError",
    "SequenceExistsError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "DoubleFreeError",
    "StaleHandleError",
    "SequenceSwappedOutError",
    "InvariantViolation",
    "CudaUnavailableError",
    "KernelCompileError",
]


class PagedKvError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class OutOfBlocksError(PagedKvError):
    """Not enough free blocks now (device tier, or host tier on swap-out): retry later."""


class UnknownSequenceError(PagedKvError, KeyError):
    """The sequence id is not live in this manager."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class SequenceExistsError(PagedKvError):
    """The sequence id is already live in this manager."""


class InvalidArgumentError(PagedKvError, ValueError):
    """Malformed input, including a request that can never fit the pool."""


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type. Also a ``TypeError``: the calls that raise it (the event
    encoder and publisher) raised a bare ``TypeError`` before they raised pagedkv errors."""


class DoubleFreeError(InvalidArgumentError):
    """A block was released more often than it was referenced: ``BlockPool.release`` of a
    handle whose block is already free. Nothing changed. An ``InvalidArgumentError`` too (what
    it was raised as before it had its own class)."""


class StaleHandleError(InvalidArgumentError):
    """A ``BlockHandle`` outlived its tenancy: its block was freed and handed out again since
    the handle was taken, so the handle no longer owns a reference. Nothing changed (the new
    tenant's reference is intact). An ``InvalidArgumentError`` too."""


class SequenceSwappedOutError(PagedKvError):
    """The sequence is swapped out to the host tier; swap it in before appending or forking."""


class InvariantViolation(PagedKvError):
    """An allocator invariant does not hold. This is a pagedkv bug: please report it."""


class CudaUnavailableError(PagedKvError):
    """A piece of the CUDA toolchain the call needs is missing (NVRTC, CuPy, a device)."""


class KernelCompileError(PagedKvError):
    """The CUDA compiler rejected a kernel source; the message carries the compiler log."""
