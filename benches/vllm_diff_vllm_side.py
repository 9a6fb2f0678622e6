"""vLLM's side of the vLLM differential: its real ``KVCacheManager`` driven the way its
scheduler drives it (``benches/vllm_chunked_prefix.py`` documents the run). vLLM is imported
when a side is built, so this module imports without it."""

from __future__ import annotations

from typing import Any

from vllm_diff_config import Windows


class VllmSide:
    """vLLM v1's ``KVCacheManager`` (one full-attention group, or the hybrid coordinator over a
    full-attention group and sliding-window groups; its ``BlockPool``), driven the way its
    scheduler drives it: ``get_computed_blocks`` + ``allocate_slots(...,
    full_sequence_must_fit=True)`` at admission, ``allocate_slots(req, n,
    num_lookahead_tokens=k)`` per later chunk or decode step (``None``: preempt),
    ``num_computed_tokens`` moved by the caller after each pass (and lowered for rejected
    drafts), ``cache_blocks`` when async or speculative output arrives, ``free`` on finish or
    preemption."""

    def __init__(
        self, num_blocks: int, block_size: int, windows: Windows = (), watermark_blocks: int = 0
    ) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request, RequestStatus

        def spec(window: int | None) -> Any:
            shape = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16)
            if window is None:
                return FullAttentionSpec(**shape)
            return SlidingWindowSpec(**shape, sliding_window=window)

        config = KVCacheConfig(
            num_blocks=num_blocks + 1,  # block 0 is vLLM's null block
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"layer.{g}"], spec(w)) for g, w in enumerate(windows or (None,))
            ],
        )
        self.num_groups = len(config.kv_cache_groups)
        self.max_model_len = 1 << 20
        self.mgr = KVCacheManager(
            config,
            max_model_len=self.max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
        )
        # vLLM sizes its watermark as a fraction of the pool; set the block count directly so
        # both sides hold back the same number.
        self.mgr.watermark_blocks = watermark_blocks
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(block_size, hash_fn)
        self.params = SamplingParams(max_tokens=self.max_model_len)
        self.request_cls = Request
        self.running_status = RequestStatus.RUNNING
        self.num_blocks = num_blocks
        self.reqs: dict[int, Any] = {}
        self.revived = 0  # cached-evictable hit blocks the last admission took back
        self.evictable_copies = 0  # of its hit blocks, those with two evictable copies

    def match(self, tokens: list[int]) -> int:
        req = self.request_cls("probe", tokens, self.params, None, block_hasher=self.hasher)
        return int(self.mgr.get_computed_blocks(req)[1])

    def admit(self, rid: int, tokens: list[int], num_scheduled: int) -> int | None:
        req = self.request_cls(str(rid), tokens, self.params, None, block_hasher=self.hasher)
        blocks, hit, _ = self.mgr.get_computed_blocks(req)
        # hit blocks no request holds are cached-evictable: admitting takes them back
        hit_blocks = [b for group in blocks.blocks for b in group if not b.is_null]
        self.revived = sum(b.ref_cnt == 0 for b in hit_blocks)
        self.evictable_copies = self._evictable_copies(hit_blocks)
        chunk = min(num_scheduled, len(tokens) - hit)
        out = self.mgr.allocate_slots(req, chunk, hit, blocks, full_sequence_must_fit=True)
        if out is None:
            return None
        req.num_computed_tokens = hit + chunk  # the pass ran
        req.status = self.running_status  # the watermark applies to waiting requests only
        self.reqs[rid] = req
        return int(hit)

    def _evictable_copies(self, hit_blocks: list[Any]) -> int:
        """Hit blocks whose content also sits on another cached-evictable block: which copy
        a manager revives decides which one keeps its place in the eviction order."""
        index = self.mgr.block_pool.cached_block_hash_to_block._cache
        count = 0
        for b in hit_blocks:
            copies = index.get(b.block_hash)
            if isinstance(copies, dict):
                count += sum(c.ref_cnt == 0 for c in copies.values()) >= 2
        return count

    def has_duplicate_copies(self) -> bool:
        """Whether vLLM's index holds two blocks of one content (it indexes every copy)."""
        index = self.mgr.block_pool.cached_block_hash_to_block._cache
        return any(isinstance(copies, dict) and len(copies) >= 2 for copies in index.values())

    def tables(self, rid: int) -> list[list[int | None]]:
        """Each group's block table; ``None`` for the null block (a released position)."""
        null = self.mgr.block_pool.null_block.block_id
        return [[None if b == null else b for b in t] for t in self.mgr.get_block_ids(str(rid))]

    def allocate(self, rid: int, num_tokens: int, lookahead: int = 0, in_flight: int = 0) -> bool:
        """The scheduler's ``allocate_slots`` for a running request; on success the pass runs
        (``num_computed_tokens`` moves by ``num_tokens``, drafts included)."""
        req = self.reqs[rid]
        req.num_in_flight_tokens = in_flight
        if self.mgr.allocate_slots(req, num_tokens, num_lookahead_tokens=lookahead) is None:
            return False
        req.num_computed_tokens += num_tokens
        return True

    def provide(
        self, rid: int, token_ids: list[int], num_computed: int | None = None, in_flight: int = 0
    ) -> None:
        """Sampled (or accepted draft) ids arrive: the scheduler appends them, lowers
        ``num_computed_tokens`` for rejected drafts and calls ``cache_blocks`` on what is
        processed (its ``update_from_output`` under async scheduling or spec decoding);
        ``in_flight``: tokens of a later step still in flight."""
        req = self.reqs[rid]
        if token_ids:
            req.append_output_token_ids(token_ids)
        if num_computed is not None:
            req.num_computed_tokens = num_computed
        req.num_in_flight_tokens = in_flight
        self.mgr.cache_blocks(req, req.num_computed_tokens - req.num_in_flight_tokens)

    def append_known(self, rid: int, token: int) -> None:
        """A sampled id the scheduler knows before it schedules the token (synchronous)."""
        self.reqs[rid].append_output_token_ids(token)

    def free(self, rid: int) -> None:
        self.mgr.free(self.reqs.pop(rid))

    def num_computed(self, rid: int) -> int:
        return int(self.reqs[rid].num_computed_tokens)

    def in_use(self) -> int:
        return int(self.num_blocks - self.mgr.block_pool.get_num_free_blocks())
