"""KV transfer between instances: a request's blocks from a prefill instance's caches to a decode
instance's, block ids to block ids, per KV group, over NIXL (docs/transfer.md).

The prefill side: ``TransferSource(regions, engine_id=..., free_request=..., port=...)``,
``offer(request_id, block_ids, num_tokens) -> KvTransferParams`` when a request's prefill is done,
``poll()`` every step (frees on the decode side's notification or when the lease runs out).
The decode side: ``TransferSink(regions, engine_id=...)``, ``start(params, dst_block_ids,
skip=...)``, ``poll() -> [TransferResult]``, ``get_block_ids_with_load_errors()``.
``source_block_ids`` / ``destination_block_ids`` read the block ids off a ``KvCacheManager``.

Needs the ``transfer`` extra: xxhash (the checksums) and NIXL (loaded when a side is made;
``TransportUnavailableError`` without it).
"""

from pagedkv.transfer.leases import PendingSends
from pagedkv.transfer.manager_blocks import destination_block_ids, source_block_ids
from pagedkv.transfer.params import KvTransferParams
from pagedkv.transfer.read_plan import ReadPlan
from pagedkv.transfer.regions import KvRegions, RegionSpec, RemoteLayout
from pagedkv.transfer.result import TransferResult
from pagedkv.transfer.sink import TransferSink
from pagedkv.transfer.source import Released, TransferSource

__all__ = [
    "KvRegions",
    "KvTransferParams",
    "PendingSends",
    "ReadPlan",
    "RegionSpec",
    "Released",
    "RemoteLayout",
    "TransferResult",
    "TransferSink",
    "TransferSource",
    "destination_block_ids",
    "source_block_ids",
]
