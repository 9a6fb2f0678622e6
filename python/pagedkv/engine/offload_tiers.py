"""The engine's offload tiers: the host offload tier's K/V arrays, and a ``pagedkv.offload``
store below it (``EngineConfig(offload=store)``), written through and read on admission.

The manager decides (``docs/offload.md``): an evicted prefix block is kept in a host block (an
offload op), and a later prompt's hit on it gets a fresh device block (a load op). This module
moves the data, in the documented order: offload ops as soon as they are recorded (before any
device block they read is written), then, right before the pass, copy-on-write copies, load
ops and the store's blocks.

The store tier: blocks go to the store on the ``OffloadWorker``'s thread (``submit_put``
queues a copy; a full queue drops the put rather than wait), keyed by their chained hash and the
engine's layout identity (model, layers, heads, head size, block size, dtype) as the salt, so
that engines with another layout never read each other's entries. When depends on the policy
(``EngineConfig.offload_policy``): ``"compute"`` saves every full block right after the pass
that computed it (``save_computed``: the K/V are copied out of the device caches before the
next step can reuse the block), so that replicas sharing the store see a prefix at once;
``"evict"`` only writes through what the host tier takes. Either way a block is queued once: a
bounded set of the hashes already queued or loaded from the store skips repeats, and the worker
asks the store (``contains``) before it writes.

On admission, after the device and host hits, the following blocks of the prompt are looked
up in the store within ``offload_deadline_s``: what arrives in time, whole and of the right
shape, from the first block on, is written into the fresh blocks and counted as computed;
everything else is a miss, recomputed by the pass. No store failure raises in the step: a
corrupted entry, an unreachable or restarted Redis, a full disk are misses; a failed save is
counted by the worker.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pagedkv.attention import swap_blocks

if TYPE_CHECKING:
    from pagedkv.engine.kv_store import PagedKvStore
    from pagedkv.offload import OffloadWorker
    from pagedkv.offload.worker import Prefetch

__all__ = ["SEEN_CAPACITY", "ComputedRow", "OffloadTiers", "layout_identity", "model_fingerprint"]

# Hashes remembered as queued or loaded (least recently used forgotten first): 65,536 x ~100
# bytes of dict entry; a forgotten one costs a ``contains`` on the worker, never a second write.
SEEN_CAPACITY = 1 << 16


def model_fingerprint(model: Any) -> str:
    """A digest of the model's constants and a sample of its first layer's weights: two models
    of the same shape but other weights must not share stored K/V."""
    h = hashlib.blake2b(repr(model.config).encode(), digest_size=16)
    layers = getattr(getattr(model.model, "weights", None), "layers", None)
    if layers:
        layer = layers[0]
        for name in sorted(getattr(layer, "__dict__", {})):
            value = getattr(layer, name)
            if isinstance(value, np.ndarray):
                h.update(name.encode())
                h.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8)[: 1 << 16].tobytes())
    return h.hexdigest()


def layout_identity(
    model_name: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int
) -> bytes:
    """The salt of the engine's store keys: what must agree for a stored block to be usable."""
    return (
        f"pagedkv-kv-v1|{model_name}|L{num_layers}|H{num_kv_heads}|D{head_dim}|B{block_size}|float32".encode()
    )


class ComputedRow(Protocol):
    """Positions ``start..end`` of ``seq``'s tokens a pass computed (the scheduler's ``Row``;
    a protocol here, as the scheduler imports this module)."""

    @property
    def seq(self) -> Any: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


class OffloadTiers:
    """Host offload arrays ``[num_offload_blocks, block_size, num_kv_heads, head_dim]`` per layer
    (K and V), and the store worker when the engine has a store."""

    def __init__(
        self,
        store: PagedKvStore,
        num_offload_blocks: int,
        block_store: object | None,
        identity: bytes,
        deadline_s: float,
        policy: str = "compute",
    ) -> None:
        self.store = store
        shape = (num_offload_blocks, *store.k_caches[0].shape[1:]) if store.k_caches else (0,)
        self.host_k = [np.zeros(shape, np.float32) for _ in store.k_caches]
        self.host_v = [np.zeros(shape, np.float32) for _ in store.v_caches]
        self.identity = identity
        self.deadline_s = deadline_s
        self.policy = policy
        self.worker: OffloadWorker | None = None
        if block_store is not None:
            from pagedkv.offload import OffloadWorker  # only with a store: needs the offload extra

            self.worker = OffloadWorker(block_store, name="engine-offload")  # type: ignore[arg-type]
        self.block_shape = (len(store.k_caches), 2, *store.k_caches[0].shape[1:]) if store.k_caches else (0,)
        # seq_id -> (the hashes asked for, the prefetch): the first waiting prompts' blocks.
        self._prefetched: dict[int, tuple[set[int], Prefetch]] = {}
        self.prefetched_blocks = 0  # store hits a prefetch had loaded
        self.store_hit_blocks = 0
        self.store_misses = 0
        self.puts_submitted = 0  # blocks queued on the worker
        self.puts_dropped = 0  # refused by a full (or closed) worker queue: the step went on
        self.puts_repeated = 0  # skipped: already queued or loaded (the seen-set)
        self.blocks_saved_on_compute = 0  # of puts_submitted, by save_computed
        self._seen: collections.OrderedDict[int, None] = collections.OrderedDict()

    def _seen_before(self, block_hash: int) -> bool:
        if block_hash in self._seen:
            self._seen.move_to_end(block_hash)
            self.puts_repeated += 1
            return True
        return False

    def _remember(self, block_hash: int) -> None:
        self._seen[block_hash] = None
        self._seen.move_to_end(block_hash)
        while len(self._seen) > SEEN_CAPACITY:
            self._seen.popitem(last=False)

    def _submit(self, block_hash: int, payload: np.ndarray) -> bool:
        """Queue one put (a copy the caller made); never raises, never waits."""
        assert self.worker is not None
        try:
            queued = self.worker.submit_put(block_hash, payload, extra_key=self.identity, if_absent=True)
        except Exception:  # noqa: BLE001 - a store put never fails the step
            queued = False
        if queued:
            self.puts_submitted += 1
            self._remember(block_hash)
        else:
            self.puts_dropped += 1
        return queued

    # ---- host tier ------------------------------------------------------------------------

    def offload(self, kv: Any) -> None:
        """Run the manager's pending offload ops (device -> host, every layer) and write each
        host block they filled through to the store."""
        recorded = kv.take_offload_ops()
        if not len(recorded):
            return
        # Ops into the same host block: only the last one's content stays (the tier dropped the
        # earlier entries), and the copy kernels refuse a destination named twice.
        last = {int(h): int(d) for d, h in recorded}
        ops = np.array([[d, h] for h, d in last.items()], np.int32)
        for layer in range(len(self.host_k)):
            swap_blocks(self.store.k_caches[layer], self.host_k[layer], ops, backend=self.store.backend)
            swap_blocks(self.store.v_caches[layer], self.host_v[layer], ops, backend=self.store.backend)
        if self.worker is None:
            return
        for h in last:
            block_hash = kv.offload_block_hash(h)
            # Under "compute" the block was saved when computed, unless the queue dropped it.
            if block_hash is None or self._seen_before(block_hash):
                continue
            payload = np.stack(
                [
                    np.stack([self.host_k[layer][h], self.host_v[layer][h]])
                    for layer in range(len(self.host_k))
                ]
            )
            self._submit(block_hash, payload)

    def save_computed(self, kv: Any, rows: Sequence[ComputedRow]) -> None:
        """Save-on-compute: queue every block the pass just completed (all its tokens computed,
        so the manager indexes it) that is not queued or stored yet. Runs right after the pass,
        before anything can write the blocks again (the next step's offloads, copies, loads).
        The K/V are copied here; the worker writes them off the critical path."""
        if self.worker is None or self.policy != "compute" or not self.host_k:
            return
        bs = self.store.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        picked: set[int] = set()  # two rows completing the same block (equal prompts)
        for row in rows:
            first, full = row.start // bs, row.end // bs
            if full <= first:
                continue  # no block filled up in this row
            seq = row.seq
            # Draft tokens included: a block of drafts holds their K/V (a rejected draft's block
            # leaves the index when truncated, its stored copy is still right for its tokens).
            tokens = np.asarray((seq.token_ids + seq.draft_ids)[: full * bs], dtype=np.int64)
            table = kv.block_table(seq.seq_id)
            for i, block_hash in enumerate(kv.prefix_block_hashes(tokens)[first:full], start=first):
                if block_hash not in picked and not self._seen_before(block_hash):
                    picked.add(block_hash)
                    blocks.append(int(table[i]))
                    hashes.append(block_hash)
        if not blocks:
            return
        ids = np.array(blocks, dtype=np.intp)
        # [blocks, layers, 2, block_size, kv_heads, head_dim]: one gather per layer and K/V,
        # straight into the payloads (each block's payload is a contiguous slice).
        payloads = np.empty((len(blocks), *self.block_shape), np.float32)
        for layer, (k, v) in enumerate(zip(self.store.k_caches, self.store.v_caches, strict=True)):
            np.take(k, ids, axis=0, out=payloads[:, layer, 0])
            np.take(v, ids, axis=0, out=payloads[:, layer, 1])
        for block_hash, payload in zip(hashes, payloads, strict=True):
            if self._submit(block_hash, payload):
                self.blocks_saved_on_compute += 1

    def load(self, load_ops: np.ndarray) -> None:
        """Host -> device copies of host-tier hits (after copy-on-write copies, before the pass)."""
        if len(load_ops):
            for layer in range(len(self.host_k)):
                swap_blocks(
                    self.host_k[layer], self.store.k_caches[layer], load_ops, backend=self.store.backend
                )
                swap_blocks(
                    self.host_v[layer], self.store.v_caches[layer], load_ops, backend=self.store.backend
                )

    # ---- store tier -----------------------------------------------------------------------

    def prefetch(self, kv: Any, waiting: list[tuple[int, np.ndarray]]) -> None:
        """Start loading the store blocks the first waiting prompts will look up (``(seq_id,
        tokens)`` each, in queue order), so that their admission finds them loaded; prefetches
        of sequences no longer among them are dropped (memory stays bounded)."""
        if self.worker is None:
            return
        wanted = {seq_id for seq_id, _ in waiting}
        for seq_id in [s for s in self._prefetched if s not in wanted]:
            self._prefetched.pop(seq_id)[1].take(0.0)
        bs = self.store.block_size
        for seq_id, tokens in waiting:
            if seq_id in self._prefetched:
                continue
            hit, last = kv.match_prefix(tokens), (len(tokens) - 1) // bs
            hashes = kv.prefix_block_hashes(tokens)[hit // bs : last] if hit // bs < last else []
            try:
                self._prefetched[seq_id] = (
                    set(hashes),
                    self.worker.prefetch(hashes, extra_key=self.identity),
                )
            except Exception:  # noqa: BLE001 - a store failure is a miss, never an error in the step
                continue

    def lookup(self, block_hashes: list[int], seq_id: int | None = None) -> list[np.ndarray]:
        """The payloads of the leading ``block_hashes`` the store returns within the deadline
        (from ``seq_id``'s prefetch when it covers them), whole and of this engine's block
        shape; stops at the first miss."""
        pending = self._prefetched.pop(seq_id, None) if seq_id is not None else None
        if self.worker is None or not block_hashes:
            return []
        try:
            if pending is not None and set(block_hashes) <= pending[0]:
                found = pending[1].take(self.deadline_s)
                self.prefetched_blocks += sum(h in found for h in block_hashes)
            else:
                if pending is not None:
                    pending[1].take(0.0)
                found = self.worker.load(block_hashes, self.deadline_s, extra_key=self.identity)
        except Exception:  # noqa: BLE001 - a store failure is a miss, never an error in the step
            found = {}
        out = []
        for h in block_hashes:
            payload = found.get(h)
            if not (
                isinstance(payload, np.ndarray)
                and payload.dtype == np.float32
                and payload.shape == self.block_shape
            ):
                break
            out.append(payload)
        for h in block_hashes[: len(out)]:
            self._remember(h)  # in the store already: never written back
        self.store_hit_blocks += len(out)
        self.store_misses += len(block_hashes) - len(out)
        return out

    def write(self, writes: list[tuple[int, np.ndarray]]) -> None:
        """Store hits into their fresh device blocks (after loads, before the pass)."""
        for block, payload in writes:
            for layer in range(len(self.host_k)):
                self.store.k_caches[layer][block] = payload[layer, 0]
                self.store.v_caches[layer][block] = payload[layer, 1]

    def close(self, timeout_s: float = 5.0) -> bool:
        """Run the queued puts (at most ``timeout_s``) and stop the worker."""
        if self.worker is None:
            return True
        for _, pending in self._prefetched.values():
            pending.take(0.0)
        self._prefetched.clear()
        return self.worker.close(timeout_s)
