"""pagedkv's KV-cache events as vLLM's own event objects, field for field.

The manager gives the core each request's own block hashes (vLLM's ``request.block_hashes``,
bytes); the core keys blocks and events by their first 16 bytes (``pagedkv.reduce_block_hash``)
and knows nothing of the request beyond its tokens. vLLM's ``BlockStored`` carries more: the
request's LoRA, the extra keys each block was hashed with (LoRA name, multimodal identifiers and
offsets, cache salt, prompt-embedding digests), its session. So the manager drains the core's
events right after every core call made for one request (``collect``): a block stored there was
stored for that request, and its event is written from the request as vLLM's block pool writes
it (vLLM's own ``generate_block_hash_extra_keys`` / ``to_event_extra_keys``), with vLLM's hash
values (``maybe_convert_block_hash`` of the bytes).

A Mamba group (align mode) holds one state block per scheduled chunk, its other positions null;
vLLM's block pool reports each caching call on it as one ``BlockStored`` over the whole range of
blocks the call covered (from the request's previous caching end: its hit at admission, then the
end of its last store), whose hashes are the state blocks' only, its parent the hash before the
range and its tokens the range's; the core reports the state block alone, and the translator
widens it to vLLM's range.

What a router fed by either manager sees differs only where the two pools differ
(docs/integrations/vllm.md, KV events): vLLM indexes a second copy of one content and reports
each copy's store and removal; pagedkv keeps one copy per content and reports it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import (
    KVCacheSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.request import Request

import pagedkv
from pagedkv.errors import InvariantViolation


def _plain(request: Request) -> bool:
    """Whether no block of ``request`` has extra hash keys (the common case, answered without
    vLLM's per-block walk)."""
    return (
        request.lora_request is None
        and not request.mm_features
        and not request.cache_salt
        and getattr(request, "prompt_embeds", None) is None
    )


class EventTranslator:
    """Drains the core's events as vLLM's (see the module docstring)."""

    def __init__(
        self,
        core: Any,
        block_size: int,
        group_specs: Sequence[KVCacheSpec],
        num_hash_lookahead_tokens: int = 0,
        state_groups: Sequence[int] = (),
        state_cached_blocks: dict[str, int] | None = None,
    ) -> None:
        self._core = core
        self._block_size = block_size
        # Lookahead hashing (draft.py): each hash covers the tokens after its block, and vLLM's
        # store events carry them (``lookahead_token_ids``) with the extra keys of that window.
        self._lookahead = num_hash_lookahead_tokens
        # Per group: the spec kind and window vLLM's manager writes into its store events.
        self._group_metadata = [
            (get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec))
            for spec in group_specs
        ]
        self._out: list[Any] = []
        # vLLM's hash value of every block (by group and reduced hash) whose store was reported
        # and whose removal was not yet: a removal names the block by the core's reduced hash.
        self._stored: dict[tuple[int, int], Any] = {}
        # Per request id: the reduced hashes of its blocks so far (to find a stored run's
        # position in the request). Dropped when the request is freed.
        self._reduced: dict[str, list[int]] = {}
        # The Mamba (state) groups, and the manager's record of each request's state blocks
        # cached so far (vLLM's per-group ``num_cached_block``, the same in every state group;
        # mamba.py keeps it): where a state group's next store range starts. The manager
        # advances it only after draining the stores of the call that cached them.
        self._state_groups = tuple(state_groups)
        self._state_cached = {} if state_cached_blocks is None else state_cached_blocks

    def forget(self, request_id: str) -> None:
        """The request is gone: its position cache goes too."""
        self._reduced.pop(request_id, None)

    def _position(self, request: Request, first: int) -> int:
        """The index in ``request.block_hashes`` of the block whose reduced hash is ``first``."""
        reduced = self._reduced.setdefault(request.request_id, [])
        hashes = request.block_hashes
        if len(reduced) < len(hashes):
            reduce = pagedkv.reduce_block_hash
            reduced.extend(reduce(h) for h in hashes[len(reduced) :])
        try:
            # The run just stored is at the end of what was computed: search from the back.
            return len(reduced) - 1 - reduced[::-1].index(first)
        except ValueError:
            raise InvariantViolation(
                f"request {request.request_id!r}: a stored block's hash is not one of its own"
            ) from None

    def stored_event(
        self,
        request: Request,
        start: int,
        end: int,
        group_idx: int,
        stored: Sequence[int] | None = None,
    ) -> BlockStored:
        """vLLM's ``BlockStored`` for blocks ``start..end`` of ``request`` (block indices), as
        vLLM's ``BlockPool._build_block_stored_event`` writes it; ``stored``: the indices of the
        range's blocks that were stored (a state group's; default: every block), which alone
        have hashes and extra keys in it."""
        bs = self._block_size
        hashes = request.block_hashes
        lookahead = self._lookahead
        lookahead_ids: list[list[int]] | None = None
        blocks = range(start, end) if stored is None else stored
        extra: list[Any]
        if lookahead:
            # vLLM's keys cover each block and its lookahead tokens (its block pool's
            # _generate_event_extra_keys), whatever the request.
            extra, mm_idx, lookahead_ids = [], 0, []
            tokens = request.all_token_ids
            for i in blocks:
                block_end = (i + 1) * bs
                keys, mm_idx = generate_lookahead_block_hash_extra_keys(
                    request, i * bs, block_end, block_end + lookahead, mm_idx
                )
                extra.append(keys)
                lookahead_ids.append(list(tokens[block_end : block_end + lookahead]))
        elif _plain(request):
            extra = [None] * len(blocks)
        else:
            extra, mm_idx = [], 0
            for i in blocks:
                keys, mm_idx = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, mm_idx)
                extra.append(keys)
        lora = request.lora_request
        kind, window = self._group_metadata[group_idx]
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(hashes[i]) for i in blocks],
            parent_block_hash=None if start == 0 else maybe_convert_block_hash(hashes[start - 1]),
            token_ids=request.all_token_ids[start * bs : end * bs],
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_GPU,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra),
            group_idx=group_idx,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            session_id=request.session_id,
            lookahead_token_ids=lookahead_ids,
        )

    def report_hit(self, request: Request, num_blocks: int, num_groups: int) -> None:
        """vLLM's ``kv_cache_report_mode == "full"``: a store event for the blocks of a
        prefix-cache hit, one per group (the blocks are not stored again)."""
        for g in range(num_groups):
            self._out.append(self.stored_event(request, 0, num_blocks, g))

    def collect(self, request: Request | None, cached_tokens: int = 0) -> None:
        """Translates the core's events since the last drain; stores are ``request``'s, made by
        a call that cached its first ``cached_tokens`` tokens (where a state group's store range
        ends: vLLM's caching call covers its full blocks, whichever of them holds a state)."""
        stored = self._stored
        for event in self._core.take_events():
            if isinstance(event, pagedkv.BlockStored):
                group = 0 if event.group_idx is None else event.group_idx
                if request is None:
                    raise InvariantViolation("the core stored blocks outside a request's call")
                start = self._position(request, event.block_hashes[0])
                if group in self._state_groups:
                    out = self._state_stored(request, start, event.block_hashes, group, cached_tokens)
                else:
                    out = self.stored_event(request, start, start + len(event.block_hashes), group)
                for key, value in zip(event.block_hashes, out.block_hashes, strict=True):
                    stored[group, key] = value
                self._out.append(out)
            elif isinstance(event, pagedkv.BlockRemoved):
                group = 0 if event.group_idx is None else event.group_idx
                self._out.append(
                    BlockRemoved(
                        block_hashes=[stored.pop((group, h), h) for h in event.block_hashes],
                        medium=event.medium,
                        group_idx=group,
                    )
                )
            else:
                stored.clear()
                self._out.append(AllBlocksCleared())

    def _state_stored(
        self, request: Request, first: int, reduced: Sequence[int], group: int, cached_tokens: int
    ) -> BlockStored:
        """vLLM's store event for a state group's blocks ``reduced`` (core hashes; the first at
        block ``first``): the range from the request's previous caching end to this call's (the
        last stored block's end at least: after a connector's tokens the stored state can be
        theirs, before the null positions of the chunk computed after them)."""
        stored = [first] + [self._position(request, h) for h in reduced[1:]]
        start = self._state_cached.get(request.request_id, first)
        if not start <= first:
            raise InvariantViolation(
                f"request {request.request_id!r}: a state block stored at {first}, before its "
                f"group's caching end {start}"
            )
        end = max(stored[-1] + 1, cached_tokens // self._block_size)
        return self.stored_event(request, start, end, group, stored)

    def take(self) -> list[Any]:
        """vLLM's events since the last call (the core's not yet drained included)."""
        self.collect(None)
        out, self._out = self._out, []
        return out
