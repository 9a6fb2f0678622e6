"""Type stubs for the compiled extension ``pagedkv._core`` (checked by ``mypy.stubtest``).

Token ids and sequence ids go in as a list or tuple of ints or a 1-D integer NumPy array;
block tables come out as NumPy int32, slots as int64, block copies as int32 ``[N, 2]``.
Malformed input raises ``pagedkv.InvalidArgumentError`` and changes nothing.
"""

from collections.abc import Iterable, Sequence
from typing import TypeAlias, final

import numpy as np
import numpy.typing as npt

from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = [
    "BlockHandle",
    "CacheAwareQueue",
    "BlockPool",
    "FullAttention",
    "KvCacheManager",
    "MambaState",
    "PromptHashes",
    "SlidingWindow",
    "__version__",
    "cpu_add_rms_norm",
    "cpu_copy_block_bytes",
    "cpu_copy_blocks",
    "cpu_matmul_bf16",
    "cpu_matmul_blocks",
    "cpu_matmul_dot",
    "cpu_paged_attention",
    "cpu_paged_prefill_attention",
    "cpu_quant_paged_attention",
    "cpu_quant_paged_prefill_attention",
    "cpu_quant_write_kv",
    "cpu_rms_norm",
    "cpu_rope_interleaved",
    "cpu_silu_mul",
    "cpu_swap_block_bytes",
    "cpu_swap_blocks",
    "cpu_write_kv",
    "encode_event_batch",
    "record_frames",
    "reduce_block_hash",
    "simulate",
    "token_block_digests",
]

__version__: str

_TokenIds: TypeAlias = list[int] | tuple[int, ...] | npt.NDArray[np.integer]
_SeqIds: TypeAlias = list[int] | tuple[int, ...] | npt.NDArray[np.integer]

@final
class BlockHandle:
    """One tenancy of a block of a ``BlockPool``, from ``BlockPool.allocate`` (not
    constructible): the block id and the block's generation when it was allocated."""

    @property
    def block_id(self) -> int: ...
    @property
    def generation(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class FullAttention:
    """A KV-cache group of full-attention layers: the group keeps every block."""

    def __new__(cls) -> FullAttention: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[type[FullAttention], tuple[()]]: ...

@final
class SlidingWindow:
    """A KV-cache group of sliding-window layers: each token sees itself and the ``window - 1``
    tokens before it; blocks wholly before ``num_computed_tokens - window + 1`` are released
    (``-1`` in the group's block tables). ``window >= 1``."""

    def __new__(cls, window: int) -> SlidingWindow: ...
    @property
    def window(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[type[SlidingWindow], tuple[int]]: ...

@final
class MambaState:
    """A KV-cache group of recurrent (Mamba) layers, vLLM's ``MambaSpec`` in its ``"align"``
    mode without speculative blocks: each allocation gives the group one block, at the chunk's
    last token (the chunk's other new positions are null), released once the processed
    watermark passes it by a token; a hit is the rightmost cached state block, alone. A manager
    with one refuses lookahead slots, watermark rollbacks and ``truncate``."""

    def __new__(cls) -> MambaState: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[type[MambaState], tuple[()]]: ...

@final
class PromptHashes:
    """A prompt's chained block hashes kept in Rust (``KvCacheManager.prompt_hashes``): hashed
    once, handed to ``CacheAwareQueue.push`` and to ``add_sequence(..., prompt_hashes=...)``."""

    def __len__(self) -> int: ...
    def to_list(self) -> list[int]: ...

@final
class CacheAwareQueue:
    """The cache-aware waiting queue (docs/scheduling.md): requests ordered by ``policy``
    (``"fcfs"``, ``"lpm"``, ``"dfs"``) over a manager's prefix cache, followed through its KV
    events; no request is passed over by more than ``aging_bound`` admissions."""

    def __new__(cls, policy: str = "lpm", aging_bound: int = 2048) -> CacheAwareQueue: ...
    @property
    def policy(self) -> str: ...
    @property
    def aging_bound(self) -> int: ...
    def __len__(self) -> int: ...
    def push(self, request_id: int, block_hashes: list[int] | PromptHashes, max_hit_blocks: int) -> int: ...
    def push_prompt(self, request_id: int, kv: KvCacheManager, token_ids: _TokenIds) -> int: ...
    def peek(self) -> int | None: ...
    def admitted(self, request_id: int) -> None: ...
    def may_admit_other(self, rank: int) -> bool: ...
    def other_admitted(self, rank: int) -> None: ...
    def remove(self, request_id: int) -> bool: ...
    def hit_blocks(self, request_id: int) -> int | None: ...
    def rank(self, request_id: int) -> int | None: ...
    def apply_events(self, events: list[Any]) -> None: ...
    def apply_manager_events(self, kv: KvCacheManager) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def check_invariants(self) -> None: ...

_KvGroup: TypeAlias = FullAttention | SlidingWindow | MambaState
_KvGroups: TypeAlias = list[_KvGroup] | tuple[_KvGroup, ...]

@final
class BlockPool:
    """``num_blocks`` physical blocks of ``block_size`` token slots with atomic refcounts;
    lock-free and thread-safe, shareable by several ``KvCacheManager``s (one per thread)."""

    def __new__(cls, num_blocks: int = 1024, block_size: int = 16) -> BlockPool: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_free_list_blocks(self) -> int:
        """Blocks on the pool's free list (managers' cached-evictable blocks not included)."""
    @property
    def num_free_blocks(self) -> int:
        """``num_free_list_blocks`` under the name docs/design.md fixes for the pool."""
    def allocate(self, num_blocks: int) -> list[BlockHandle]:
        """Takes ``num_blocks`` blocks off the free list for the caller's own use; one handle
        (one reference) each. ``OutOfBlocksError`` when fewer are free."""
    def retain(self, handle: BlockHandle) -> int:
        """Adds a reference; returns the new refcount. ``StaleHandleError`` once freed."""
    def release(self, handle: BlockHandle) -> bool:
        """Drops a reference; ``True`` when the block was freed. ``DoubleFreeError`` when it is
        already free, ``StaleHandleError`` when it was handed out again since."""
    def refcount(self, block_id: int) -> int: ...
    def check_invariants(self) -> None:
        """Raises ``InvariantViolation`` if the free list is inconsistent."""

@final
class KvCacheManager:
    """Copy-on-write block tables per sequence over a block pool, with optional prefix caching
    (``enable_prefix_caching``) and a host swap tier (``num_host_blocks > 0``). Defaults:
    1024 blocks of 16 tokens, or the ``pool``'s. Safe to use from several Python threads."""

    def __new__(
        cls,
        num_blocks: int | None = None,
        block_size: int | None = None,
        enable_prefix_caching: bool = False,
        num_host_blocks: int = 0,
        *,
        pool: BlockPool | None = None,
        hash_seed: int = 0,
        max_events: int | None = None,
        enable_kv_events: bool = False,
        num_host_cache_blocks: int = 0,
        kv_groups: _KvGroups | None = None,
        num_offload_blocks: int | None = None,
        max_model_len: int | None = None,
        max_in_flight_tokens: int | None = None,
        watermark_blocks: int = 0,
        null_block: int = -1,
        record_new_block_ids: bool = False,
    ) -> KvCacheManager:
        """``num_host_cache_blocks`` > 0 adds the host cache: evicted prefix blocks keep their
        content in host blocks and come back as hits (needs prefix caching; see
        ``take_offload_ops`` / ``take_load_ops``); ``num_offload_blocks`` is its deprecated
        alias (a ``DeprecationWarning``). ``kv_groups``: one block table per group and sequence,
        all on one pool (default: one ``FullAttention()`` group); docs/design.md, KV groups.
        Per-chunk allocation (docs/design.md, Per-chunk allocation): ``max_model_len`` (default
        unbounded), ``max_in_flight_tokens`` (default ``max_model_len``) and ``watermark_blocks``
        are vLLM's admission limits; ``null_block=0`` reserves block 0 as vLLM's null block
        (released positions then show 0); ``record_new_block_ids`` keeps the log
        ``take_new_block_ids`` drains."""
    def add_sequence(
        self,
        seq_id: int,
        token_ids: _TokenIds | None = None,
        *,
        num_tokens: int | None = None,
        extra_key: str | bytes | int | np.integer | None = None,
        num_scheduled: int | None = None,
        reserve_prompt: bool = True,
        require_full_prompt: bool = True,
        num_lookahead_tokens: int = 0,
        block_extra_keys: Sequence[str | bytes | int | np.integer | None] | None = None,
        block_hashes: Sequence[int | bytes] | None = None,
        apply_watermark: bool = True,
        prompt_hashes: PromptHashes | list[int] | None = None,
        reserved_blocks: int = 0,
        num_external_computed_tokens: int = 0,
        diverged_hit: bool = False,
        prefill_checkpoint: tuple[int, int] | None = None,
    ) -> int:
        """Admits a prompt (``token_ids`` ``[n]``, or only ``num_tokens``: never hashed);
        returns how many of its tokens were served from the prefix cache. ``num_scheduled``:
        how many of the new (non-hit) tokens the next pass computes (``None``: all).
        ``reserve_prompt=False``: blocks for the hit and the scheduled tokens only, after vLLM's
        admission check (then ``allocate_slots`` each step); ``require_full_prompt=False``
        checks only that the scheduled chunk fits, not the whole prompt (vLLM's
        ``full_sequence_must_fit=False``). ``num_lookahead_tokens``:
        speculative slots, never hashed. ``block_extra_keys``: one extra key per block;
        ``block_hashes``: the caller's chained hashes of the full blocks (ints, or bytes reduced
        by ``reduce_block_hash``). ``apply_watermark``: leave ``watermark_blocks`` available;
        ``reserved_blocks``: leave that many more available (vLLM's ``reserved_blocks``, for
        in-flight async KV loads; the allocation's check only). ``prompt_hashes``: pagedkv's
        own hashes of the prompt computed earlier (``prompt_hashes(tokens)``), read instead of
        hashing the prompt again. ``num_external_computed_tokens``: how many of the first
        scheduled tokens are computed elsewhere (vLLM's KV connector; per chunk only): window
        groups release what their windows leave at the hit plus these before the admission is
        sized, so those positions are never allocated (more than the scheduled tokens after
        the hit: ``InvalidArgumentError``). ``diverged_hit``: the hit is the full-attention
        groups' own run where a ``MambaState`` group's own hit lags it (vLLM's diverged hit,
        restored by the connector's tokens): the state groups' hit positions are released and
        each one's own hit block is counted, never taken, when cached-evictable (per chunk, with
        external tokens, full-attention and state groups only: else ``InvalidArgumentError``)."""
    def allocate_slots(
        self,
        seq_id: int,
        num_new_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        num_in_flight_tokens: int = 0,
        num_computed_tokens: int | None = None,
        prefill_checkpoint: tuple[int, int] | None = None,
    ) -> bool:
        """vLLM's per-chunk ``allocate_slots``: slots for the tokens scheduled now plus
        lookahead; the window release at ``num_computed - num_in_flight_tokens`` first (it
        stands). ``num_computed_tokens``: the caller's watermark (lower rolls rejected drafts
        back). False (nothing else changed) when blocks are short."""
    def provide_token_ids(
        self,
        seq_id: int,
        token_ids: _TokenIds,
        *,
        num_computed_tokens: int | None = None,
        block_extra_keys: Sequence[str | bytes | int | np.integer | None] | None = None,
        block_hashes: Sequence[int | bytes] | None = None,
    ) -> None:
        """Ids of the tokens after the known ones (async scheduling); blocks then full,
        computed and known are indexed now. ``num_computed_tokens`` (the scheduler's
        watermark after rejected drafts) rolls the watermark back first."""
    def take_new_block_ids(
        self,
    ) -> tuple[
        npt.NDArray[np.uint64],
        npt.NDArray[np.int32],
        npt.NDArray[np.int32],
        npt.NDArray[np.int32],
        npt.NDArray[np.bool_],
    ]:
        """Table entries placed since the last call (``record_new_block_ids=True``):
        (seq_ids, groups, positions, block_ids, fresh), each ``[N]``, in the order placed;
        ``block_ids[fresh]`` is vLLM's list of newly allocated blocks to zero."""
    def num_slots(self, seq_id: int) -> int:
        """The sequence's capacity in token slots (table length x block size)."""
    @property
    def null_block(self) -> int:
        """What tables show at a released position: -1, or 0 (``null_block=0``)."""
    def append_tokens(
        self, seq_id: int, token_ids: _TokenIds | None = None, *, num_tokens: int | None = None
    ) -> None:
        """Grows the sequence (by ``num_tokens``, default 1, when no ids are given); a shared,
        partly filled last block is copied first (see ``take_copy_ops``)."""
    def can_append(self, seq_id: int, num_tokens: int = 1) -> bool: ...
    def append_tokens_batch(
        self, seq_ids: _SeqIds, token_ids: _TokenIds | None = None, *, num_tokens: int = 1
    ) -> None:
        """One engine step, all or nothing; ``token_ids`` is ``[B * num_tokens]`` row-major."""
    def free_batch(self, seq_ids: _SeqIds) -> None: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def free_last_group_first(self, seq_id: int) -> None: ...
    def release_skipped_blocks(self, seq_id: int, processed_tokens: int) -> None:
        """vLLM's ``remove_skipped_blocks``: every sliding-window group releases what a processed
        watermark of ``processed_tokens`` puts out of its window (at most the sequence's
        computed tokens, else ``InvalidArgumentError``)."""
    def block_table(self, seq_id: int, *, group: int = 0) -> npt.NDArray[np.int32]:
        """int32 ``[num_blocks_of_seq]`` of KV-cache group ``group``, a fresh array; ``-1`` at a
        position a sliding-window group released."""
    def num_tokens(self, seq_id: int) -> int: ...
    def advance_computed(self, seq_ids: _SeqIds, num_tokens: int) -> None:
        """Schedules the next ``num_tokens`` tokens of each sequence (chunked prefill), all or
        none; full blocks enter the prefix index once computed."""
    def num_computed_tokens(self, seq_id: int) -> int: ...
    def match_prefix(
        self,
        tokens: _TokenIds,
        *,
        extra_key: str | bytes | int | np.integer | None = None,
        block_extra_keys: Sequence[str | bytes | int | np.integer | None] | None = None,
        block_hashes: Sequence[int | bytes] | None = None,
        prompt_hashes: PromptHashes | list[int] | None = None,
    ) -> int:
        """The hit ``add_sequence`` would return now; no side effect at all."""
    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keeps the first ``num_tokens`` tokens (rollback of rejected draft tokens)."""
    def pin_prefix(
        self, tokens: _TokenIds, *, extra_key: str | bytes | int | np.integer | None = None
    ) -> int:
        """Pins the cached blocks of the longest cached prefix; returns the tokens pinned."""
    def unpin_prefix(
        self, tokens: _TokenIds, *, extra_key: str | bytes | int | np.integer | None = None
    ) -> None:
        """Releases the most recent pin of ``tokens`` (``InvalidArgumentError`` if none)."""
    def batch_block_tables(
        self, seq_ids: _SeqIds, *, group: int = 0
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """(int32 ``[B, max_blocks]`` padded with -1, int32 ``[B]`` lengths in tokens) of
        group ``group``; released positions are -1 too."""
    def csr_page_table(
        self, seq_ids: _SeqIds, *, group: int = 0
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """FlashInfer's paged-KV layout: (kv_indptr int32 ``[B + 1]``, kv_indices int32 ``[nnz]``,
        kv_last_page_len int32 ``[B]``: tokens in each sequence's last block, 0 when empty)."""
    def slot_mapping(self, seq_ids: _SeqIds, num_new_tokens: int, *, group: int = 0) -> npt.NDArray[np.int64]:
        """int64 ``[B * num_new_tokens]``: slots of each sequence's last tokens in group
        ``group`` (-1 for a token at a released position)."""
    def take_copy_ops(self) -> npt.NDArray[np.int32]:
        """int32 ``[N, 2]`` pending copy-on-write copies (src, dst); cleared by the call."""
    def take_offload_ops(self) -> npt.NDArray[np.int32]:
        """int32 ``[N, 2]`` pending offload ops (device_block, host_block): device blocks the
        host cache keeps; run them first, before copies, swaps, loads and the pass. Cleared by
        the call."""
    def take_load_ops(self) -> npt.NDArray[np.int32]:
        """int32 ``[N, 2]`` pending load ops (host_block, device_block): host-cache hits, run
        after the offload ops and before the pass. Cleared by the call."""
    def offload_block_hash(self, host_block: int) -> int | None:
        """The chained hash of what host-cache block ``host_block`` holds (None:
        nothing); after running ``take_offload_ops`` in order, the key to write it through with."""
    def prefix_block_hashes(
        self, tokens: _TokenIds, *, extra_key: str | bytes | int | np.integer | None = None
    ) -> list[int]:
        """The chained 128-bit hash of each full block of ``tokens``, as the prefix index
        and KV events key them; no side effect."""
    def prompt_hashes(
        self, tokens: _TokenIds, *, extra_key: str | bytes | int | np.integer | None = None
    ) -> PromptHashes:
        """``prefix_block_hashes`` kept in Rust: hashed once at arrival, handed to the queue and
        to ``add_sequence(..., prompt_hashes=...)``, which reads them instead of hashing again."""
    def cached_block(self, block_hash: bytes | int, *, group: int = 0) -> int | None:
        """The block of KV-cache group ``group`` the prefix cache holds under ``block_hash``
        (in use or cached-evictable), or None: a look-up by that one hash (vLLM's
        ``get_cached_block``). ``block_hash``: bytes (reduced as ``reduce_block_hash``) or
        pagedkv's own int hash. The first call stops chaining index entries."""
    def longest_cached_block(
        self, block_hashes: Sequence[bytes | int], max_blocks: int, *, group: int = 0
    ) -> tuple[int, int] | None:
        """A state group's hit (vLLM's ``MambaManager.find_longest_cache_hit``, align mode):
        the rightmost ``i < min(max_blocks, len(block_hashes))`` whose hash group ``group``
        holds a block under, as ``(i + 1, block)``, or None. Searched from the right; one
        block, not a chain. ``block_hashes`` as in ``cached_block``."""
    def group_hits(self, block_hashes: Sequence[bytes | int], max_tokens: int) -> list[int]:
        """Each group's own hit in tokens (at most ``max_tokens``), each group on its own, not
        reconciled (vLLM's ``find_longest_cache_hit_per_group``): full attention's leading run
        of cached hashes, a window group's run before the hit point, a state group's rightmost
        cached block. ``block_hashes`` as in ``cached_block``."""
    def new_step(self) -> None:
        """A scheduler step starts (vLLM's ``new_step_starts``): from the first call on, an
        admission whose hit ends at a state block cached since the last call is refused
        (``OutOfBlocksError``)."""
    def refcount(self, block_id: int) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_host_blocks(self) -> int: ...
    @property
    def num_host_cache_blocks(self) -> int: ...
    @property
    def num_offload_blocks(self) -> int:
        """The deprecated name of ``num_host_cache_blocks``."""
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def kv_groups(self) -> list[_KvGroup]: ...
    @property
    def pool(self) -> BlockPool:
        """The pool this manager allocates from (its own, or the one given as ``pool=``):
        managers built on it later reclaim this one's cached blocks, and it theirs."""
    @property
    def usage(self) -> float:
        """In-use blocks / num_blocks, in [0, 1]."""
    @property
    def num_available_blocks(self) -> int:
        """Allocatable now: pool free-list blocks + this manager's cached-evictable blocks."""
    @property
    def num_free_list_blocks(self) -> int:
        """Blocks on the pool's free list (shared with other managers on the pool)."""
    @property
    def num_free_blocks(self) -> int:
        """``num_available_blocks`` (free list + cached-evictable) under the name
        docs/design.md fixes for the manager; not the pool's ``num_free_blocks``."""
    @property
    def num_free_host_blocks(self) -> int: ...
    @property
    def num_sequences(self) -> int: ...
    def blocks_needed_for_prompt(self, num_tokens: int) -> int:
        """``ceil(num_tokens / block_size)`` in each KV-cache group, prefix hits ignored."""
    def is_swapped_out(self, seq_id: int) -> bool: ...
    def stats(self) -> dict[str, int | float]: ...
    def check_invariants(self) -> None:
        """Raises ``InvariantViolation`` if any allocator invariant does not hold."""
    def swap_out(self, seq_ids: int | _SeqIds) -> npt.NDArray[np.int32]:
        """int32 ``[N, 2]`` (device_block, host_block) copies; one id or a fork group."""
    def swap_in(self, seq_ids: int | _SeqIds) -> npt.NDArray[np.int32]:
        """int32 ``[N, 2]`` (host_block, device_block) copies."""
    def reset_prefix_cache(self) -> bool: ...
    def evict_blocks(self, block_ids: Iterable[int]) -> int:
        """Drops these blocks' prefix-index entries (held ones stay private, cached ones are freed)."""
    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """Drains the KV events (vLLM's schema; block hashes as Python ints), oldest first."""
    def take_event_batch(
        self, ts: float, data_parallel_rank: int | None = None, raw_hashes: bool = False
    ) -> tuple[int, bytes]:
        """Drains the same events as ``take_events`` encoded as one vLLM ``EventBatch`` (the bytes
        ``pagedkv.events.encode_batch(take_events(), ts, ...)`` returns) without building event
        objects: ``(number of events, payload)``."""
    def take_event_digests(self) -> list[tuple[str, list[int], int | None, list[int]]]:
        """Drains the same events as ``take_events`` as ``(kind, block_hashes, parent_block_hash,
        block_digests)``: each stored block's token ids become one ``token_block_digests``."""
    def __contains__(self, seq_id: object, /) -> bool: ...
    def __len__(self) -> int: ...

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

# Trace-replay simulator (Python face: pagedkv.sim.engine). Arrays are 1-D [R]: int64 lengths,
# float64 arrival seconds; `config` maps pagedkv.sim.engine.SimConfig field names to values.
def simulate(
    prompt_tokens: npt.NDArray[np.int64],
    output_tokens: npt.NDArray[np.int64],
    arrival_s: npt.NDArray[np.float64],
    group_size: npt.NDArray[np.int64] | None,
    group_kind: str,
    prefix_id: npt.NDArray[np.int64] | None,
    prefix_tokens: npt.NDArray[np.int64] | None,
    config: dict[str, object],
    progress: Callable[[int, int, int], object] | None = None,
    *,
    block_tokens: int | None = None,
    block_offsets: npt.NDArray[np.int64] | None = None,
    block_ids: npt.NDArray[np.int64] | None = None,
) -> dict[str, Any]: ...
def record_frames(
    prompt_tokens: npt.NDArray[np.int64],
    output_tokens: npt.NDArray[np.int64],
    arrival_s: npt.NDArray[np.float64],
    group_size: npt.NDArray[np.int64] | None,
    group_kind: str,
    prefix_id: npt.NDArray[np.int64] | None,
    prefix_tokens: npt.NDArray[np.int64] | None,
    config: dict[str, object],
    max_steps: int,
    *,
    block_tokens: int | None = None,
    block_offsets: npt.NDArray[np.int64] | None = None,
    block_ids: npt.NDArray[np.int64] | None = None,
) -> dict[str, Any]: ...
def encode_event_batch(
    events: list[Any], ts: float, data_parallel_rank: int | None = None, raw_hashes: bool = False
) -> bytes:
    """vLLM's KV-event ``EventBatch`` as msgpack bytes (``pagedkv.events.encode_batch``)."""

def token_block_digests(
    token_ids: _TokenIds, block_size: int, *, extra_key: str | bytes | int | np.integer | None = None
) -> npt.NDArray[np.uint64]:
    """uint64 ``[len // block_size]``: XXH3-64 of each full block's ids (little-endian u32),
    seeded by XXH3-64 of ``extra_key``'s bytes when given: what ``take_event_digests`` reports."""

# Private (tests): which reader lists of ids take, "cpython-3.10" / "cpython-3.12" (read in
# place, the layout proved at import) or "api" (through the C API).
def _int_list_reader() -> str: ...
def reduce_block_hash(block_hash: bytes) -> int:
    """A caller's block hash (vLLM's ``request.block_hashes`` bytes) reduced to the 128 bits the
    prefix index keys blocks by: its first 16 bytes, little-endian, zero-padded."""

# The Rust CPU data plane (pagedkv-cpu), behind backend="cpu" (pagedkv.attention.cpu_backend).
# dtypes: float32, float16, uint16 holding bfloat16 bits; caches C-contiguous, read or written in
# place; every index checked before the first write (InvalidArgumentError); the GIL is released.
def cpu_paged_attention(
    q: npt.NDArray[Any],
    k_cache: npt.NDArray[Any],
    v_cache: npt.NDArray[Any],
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    scale: float | None = None,
    window: int | None = None,
) -> npt.NDArray[Any]: ...
def cpu_paged_prefill_attention(
    q: npt.NDArray[Any],
    k_cache: npt.NDArray[Any],
    v_cache: npt.NDArray[Any],
    block_tables: npt.NDArray[np.int32]
    | tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]],
    seq_lens: npt.NDArray[np.int32],
    query_start_loc: npt.NDArray[np.int32],
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
) -> npt.NDArray[Any]: ...
def cpu_write_kv(
    k: npt.NDArray[Any],
    v: npt.NDArray[Any],
    k_cache: npt.NDArray[Any],
    v_cache: npt.NDArray[Any],
    slot_mapping: npt.NDArray[np.int64],
) -> None: ...
def cpu_copy_blocks(
    k_caches: list[npt.NDArray[Any]], v_caches: list[npt.NDArray[Any]], copy_ops: npt.NDArray[np.int32]
) -> None: ...

# A quantized cache as the bindings take it: (data uint8 [num_blocks, block_bytes], residual
# [num_residual_slots, block_size, num_kv_heads, head_dim] or None, kv_cache_dtype, role,
# block_size, num_kv_heads, head_dim).
_QuantCache: TypeAlias = tuple[npt.NDArray[np.uint8], npt.NDArray[Any] | None, str, str, int, int, int]

def cpu_quant_paged_attention(
    q: npt.NDArray[Any],
    k_cache: _QuantCache,
    v_cache: _QuantCache,
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    residual_slots: npt.NDArray[np.int32] | None = None,
    scale: float | None = None,
    window: int | None = None,
) -> npt.NDArray[Any]: ...
def cpu_quant_paged_prefill_attention(
    q: npt.NDArray[Any],
    k_cache: _QuantCache,
    v_cache: _QuantCache,
    block_tables: npt.NDArray[np.int32] | tuple[npt.NDArray[np.int32], ...],
    seq_lens: npt.NDArray[np.int32],
    query_start_loc: npt.NDArray[np.int32],
    residual_slots: npt.NDArray[np.int32] | None = None,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
) -> npt.NDArray[Any]: ...
def cpu_quant_write_kv(
    k: npt.NDArray[Any],
    v: npt.NDArray[Any],
    k_cache: _QuantCache,
    v_cache: _QuantCache,
    slot_mapping: npt.NDArray[np.int64],
    residual_slots: npt.NDArray[np.int32] | None = None,
) -> None: ...
def cpu_copy_block_bytes(caches: list[npt.NDArray[np.uint8]], copy_ops: npt.NDArray[np.int32]) -> None: ...
def cpu_swap_block_bytes(
    src: npt.NDArray[np.uint8], dst: npt.NDArray[np.uint8], mapping: npt.NDArray[np.int32]
) -> int: ...
def cpu_matmul_bf16(
    x: npt.NDArray[np.float32], w: npt.NDArray[np.uint16], n: int
) -> npt.NDArray[np.float32]: ...
def cpu_matmul_blocks(
    x: npt.NDArray[np.float32],
    codes: npt.NDArray[np.uint8],
    scales: npt.NDArray[np.float32],
    offsets: npt.NDArray[np.float32],
    n: int,
    block: int,
    code_format: str,
) -> npt.NDArray[np.float32]: ...
def cpu_matmul_dot(
    x: npt.NDArray[np.float32],
    codes: npt.NDArray[np.uint8],
    scales: npt.NDArray[np.float32],
    offsets: npt.NDArray[np.float32],
    n: int,
    block: int,
    code_format: str,
) -> npt.NDArray[np.float32]: ...
def cpu_rms_norm(
    x: npt.NDArray[np.float32], weight: npt.NDArray[np.float32], eps: float
) -> npt.NDArray[np.float32]: ...
def cpu_add_rms_norm(
    x: npt.NDArray[np.float32], delta: npt.NDArray[np.float32], weight: npt.NDArray[np.float32], eps: float
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]: ...
def cpu_silu_mul(gate_up: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...
def cpu_rope_interleaved(
    x: npt.NDArray[np.float32],
    cos: npt.NDArray[np.float32],
    sin: npt.NDArray[np.float32],
    first_head: int = 0,
    num_heads: int | None = None,
) -> npt.NDArray[np.float32]: ...
def cpu_swap_blocks(
    src_cache: npt.NDArray[Any], dst_cache: npt.NDArray[Any], mapping: npt.NDArray[np.int32]
) -> int: ...
