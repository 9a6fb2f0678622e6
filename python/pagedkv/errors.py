"""The pagedkv exception hierarchy: every exception class pagedkv defines lives here.

Defined in Python (not in the extension) so that an error can be both a ``PagedKvError`` and
the built-in it refines (``KeyError``, ``ValueError``); the Rust bindings raise these classes.
The package raises no bare ``ValueError`` or ``RuntimeError``: each refusal is one of these
(``tests/python/test_errors_module.py`` checks both).

Groups: the allocator's (the Rust core's ``Error`` variants, one class each), the data plane's
(CUDA, NVRTC, the emulation harness), the models' (loading a GGUF file, its chat template),
the simulator's (traces, plots), the command line's, the events' (a closed publisher), and KV
transfer's between instances (``pagedkv.transfer``).
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
    "NvrtcUnavailable",
    "NvrtcCompileError",
    "EmulationBuildError",
    "KernelLaunchError",
    "ModelLoadError",
    "UnsupportedModelError",
    "ChatTemplateError",
    "TraceError",
    "TraceNotFoundError",
    "PlotUnavailableError",
    "CliError",
    "ClosedError",
    "TransferError",
    "TransportUnavailableError",
    "WorkerError",
    "UnsupportedVllmFeatureError",
]


class PagedKvError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class OutOfBlocksError(PagedKvError):
    """Not enough free blocks now (device tier, or swap tier on swap-out): retry later."""


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
    """The sequence is swapped out to the swap tier; swap it in before appending or forking."""


class InvariantViolation(PagedKvError):
    """An invariant of pagedkv does not hold (the allocator's, the engine's, or the package's own
    files'). This is a pagedkv bug: please report it."""


class CudaUnavailableError(PagedKvError):
    """A piece of the CUDA toolchain the call needs is missing (NVRTC, CuPy, a device)."""


class KernelCompileError(PagedKvError):
    """The CUDA compiler rejected a kernel source; the message carries the compiler log."""


class NvrtcUnavailable(CudaUnavailableError):
    """libnvrtc was not found (install nvidia-cuda-nvrtc)."""


class NvrtcCompileError(KernelCompileError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


class EmulationBuildError(PagedKvError):
    """The emulated backend could not build a kernel (no C++ compiler, or a compile error)."""


class KernelLaunchError(PagedKvError):
    """An emulated launch failed inside the harness (deadlock, bad launch shape)."""


class ModelLoadError(PagedKvError):
    """The model file cannot be read: missing, not GGUF, truncated, or missing a required key."""


class UnsupportedModelError(InvalidArgumentError):
    """The GGUF file is valid but names an architecture or tensor type that is not supported."""


class ChatTemplateError(PagedKvError):
    """The model's chat template cannot render these messages: a syntax error, an undefined
    value, a sandbox violation, ``raise_exception`` called by the template, or a render past its
    time, loop or size budget (``pagedkv.models.chat_template``)."""


class TraceError(InvalidArgumentError):
    """A trace file is malformed; the message names the file and the line."""


class TraceNotFoundError(TraceError, FileNotFoundError):
    """The trace file (or the folder of the shared traces) does not exist."""


class PlotUnavailableError(PagedKvError, ImportError):
    """matplotlib is not installed (``pip install matplotlib``)."""


class CliError(PagedKvError):
    """A bad combination of command-line options (the message says which)."""


class ClosedError(PagedKvError, RuntimeError):
    """The object was closed (an event publisher): nothing more goes through it. Also a
    ``RuntimeError``, what it was raised as before it had its own class."""


class TransferError(PagedKvError):
    """A KV transfer between instances failed (``pagedkv.transfer``): the peer is unreachable or
    died, its cache layout does not match, the transport reported an error, the transfer ran
    past its deadline, or a block arrived with a checksum that does not match. The blocks it
    names are reported failed (to be recomputed), never used."""


class TransportUnavailableError(TransferError, ImportError):
    """The KV transfer transport (NIXL) is not installed: ``pip install 'pagedkv[transfer]'``.
    Also an ``ImportError``."""


class WorkerError(TransferError):
    """A disaggregated serving worker process (``pagedkv.disagg``) died, or did not answer in
    time."""


class UnsupportedVllmFeatureError(InvalidArgumentError):
    """A vLLM feature ``pagedkv.integrations.vllm``'s manager does not implement was asked for
    (raised at construction, or on the first call that needs it): never a silently different
    schedule. Also a ``ValueError``."""
