"""``TransferResult``: how one request's read ended on the decode side."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import TransferError

__all__ = ["TransferResult"]


@dataclass(frozen=True)
class TransferResult:
    """request_id: the decode side's id (``remote_request_id``: the prefill side's);
    num_tokens: the tokens the params covered; blocks_read: blocks read and verified (their
    checksum matched); blocks_skipped: positions skipped (already held, or not needed);
    failed_block_ids: per KV group, the decode side's blocks that did not arrive intact (never
    to be attended over: recompute them); num_valid_tokens: tokens from the start whose KV the
    decode side now holds in every group (``ReadPlan.num_valid_tokens``); error: why blocks
    failed (None when none did); read_s / verify_s / copy_s: the transport's time, the
    checksums' and (staged reads) the copy out of the staging range's."""

    request_id: str
    remote_request_id: str
    num_tokens: int
    blocks_read: int
    blocks_skipped: int
    failed_block_ids: tuple[tuple[int, ...], ...]
    num_valid_tokens: int
    error: TransferError | None = None
    read_s: float = 0.0
    verify_s: float = 0.0
    copy_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Every block arrived intact (or none was needed)."""
        return self.error is None

    @property
    def num_failed(self) -> int:
        return sum(len(g) for g in self.failed_block_ids)

    def raise_for_error(self) -> None:
        """Raise ``error`` if there is one."""
        if self.error is not None:
            raise self.error
