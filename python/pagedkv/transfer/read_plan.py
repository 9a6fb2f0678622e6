"""``ReadPlan``: which of a request's remote blocks the decode side reads, into which of its own
blocks, and what a failure leaves valid.

The caller gives, per KV group, its destination block ids aligned with the params' source ids
(position ``i`` of ``dst_block_ids[g]`` receives ``params.block_ids[g][i]``) and the positions to
skip: blocks it already holds (its prefix-cache hit) or does not need. A skipped position is
never written (a held block may be shared with other sequences). Everything is checked before
anything moves: lengths, ranges, a destination named twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.transfer.params import KvTransferParams

__all__ = ["ReadPlan"]


def _ids(value: object, what: str) -> np.ndarray:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise InvalidArgumentError(f"{what} must be a list or a 1-D integer array")
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"{what} must be a 1-D list of ints")
    return array.astype(np.int64)


@dataclass(frozen=True)
class ReadPlan:
    """The reads of one request, one entry per block read (all groups, in group order).

    src / dst: the peer's and our block ids; checksums: the peer's XXH3-64 of each; group and
    position: the KV group and logical block position of each; index: its place in the params'
    blocks over all groups in order (its row in a staged copy); num_skipped: positions skipped."""

    params: KvTransferParams
    src: np.ndarray
    dst: np.ndarray
    checksums: np.ndarray
    group: np.ndarray
    position: np.ndarray
    index: np.ndarray
    num_skipped: int

    @classmethod
    def build(
        cls,
        params: KvTransferParams,
        dst_block_ids: Sequence[Sequence[int] | np.ndarray],
        skip: Sequence[Iterable[int]] | None,
        local_num_blocks: int,
    ) -> ReadPlan:
        groups = params.num_groups
        if isinstance(dst_block_ids, (str, bytes)) or not isinstance(dst_block_ids, Sequence):
            raise InvalidArgumentError("dst_block_ids is a list with one list of block ids per KV group")
        if len(dst_block_ids) != groups:
            raise InvalidArgumentError(
                f"dst_block_ids has {len(dst_block_ids)} groups; the params have {groups}"
            )
        if skip is not None and (not isinstance(skip, Sequence) or len(skip) != groups):
            raise InvalidArgumentError(f"skip is None or a list of positions for each of the {groups} groups")
        src, dst, sums, group, position, index = [], [], [], [], [], []
        num_skipped = 0
        start = 0
        for g in range(groups):
            want = _ids(dst_block_ids[g], f"dst_block_ids[{g}]")
            n = len(params.block_ids[g])
            if want.shape[0] != n:
                raise InvalidArgumentError(
                    f"dst_block_ids[{g}] has {want.shape[0]} ids; the params name {n} blocks in group {g}"
                )
            keep = np.ones(n, dtype=bool)
            if skip is not None:
                skipped = _ids(list(skip[g]), f"skip[{g}]")
                if skipped.size and (skipped.min() < 0 or skipped.max() >= n):
                    raise InvalidArgumentError(f"skip[{g}] holds positions in [0, {n})")
                keep[skipped] = False
            num_skipped += int(n - keep.sum())
            read = want[keep]
            if read.size and (read.min() < 0 or read.max() >= local_num_blocks):
                raise InvalidArgumentError(
                    f"dst_block_ids[{g}] must be block ids in [0, {local_num_blocks}) at every position "
                    "not skipped (skip a position the decode side holds or does not need)"
                )
            src.append(np.asarray(params.block_ids[g], dtype=np.int64)[keep])
            dst.append(read)
            sums.append(np.asarray(params.checksums[g], dtype=np.uint64)[keep])
            group.append(np.full(read.shape[0], g, dtype=np.int64))
            position.append(params.first_position(g) + np.flatnonzero(keep))
            index.append(start + np.flatnonzero(keep))
            start += n
        all_dst = np.concatenate(dst)
        if np.unique(all_dst).shape[0] != all_dst.shape[0]:
            raise InvalidArgumentError("dst_block_ids names a destination block twice")
        return cls(
            params,
            np.concatenate(src),
            all_dst,
            np.concatenate(sums),
            np.concatenate(group),
            np.concatenate(position).astype(np.int64),
            np.concatenate(index).astype(np.int64),
            num_skipped,
        )

    @property
    def num_reads(self) -> int:
        return int(self.dst.shape[0])

    def descriptor_indices(
        self, num_regions: int, local_blocks: int, remote_blocks: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) int32 descriptor indices: every region's row of every block read,
        region-major and in ascending source id within a region, so runs of consecutive ids on
        both sides sit next to each other and NIXL merges them into one larger read."""
        order = np.argsort(self.src, kind="stable")
        regions = np.arange(num_regions, dtype=np.int64)[:, None]
        local = (regions * local_blocks + self.dst[order][None, :]).ravel()
        remote = (regions * remote_blocks + self.src[order][None, :]).ravel()
        return local.astype(np.int32), remote.astype(np.int32)

    def failed_by_group(self, failed: np.ndarray) -> tuple[tuple[int, ...], ...]:
        """Our block ids of the failed reads (``failed``: a mask over the reads), per group."""
        return tuple(
            tuple(int(b) for b in self.dst[failed & (self.group == g)]) for g in range(self.params.num_groups)
        )

    def num_valid_tokens(self, failed: np.ndarray) -> int:
        """Tokens whose KV the decode side now holds in every group, counted from the start:
        all ``num_tokens`` when nothing failed; else the tokens before the first failed block,
        provided every group was sent from position 0 (full attention); a group sent from later
        (a sliding window) lacks the earlier window a recomputation from that point would
        attend over, so then 0 (recompute the prompt)."""
        if not failed.any():
            return self.params.num_tokens
        if any(self.params.first_position(g) > 0 for g in range(self.params.num_groups)):
            return 0
        return int(self.position[failed].min()) * self.params.block_size
