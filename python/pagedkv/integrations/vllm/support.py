"""What of vLLM's configuration pagedkv's vLLM manager supports: the group kinds, block sizes
and options it answers as vLLM's manager does; everything else refused at construction with
``UnsupportedVllmFeatureError`` naming it (docs/integrations/vllm.md, Supported, and refused)."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
)

import pagedkv
from pagedkv.errors import InvalidArgumentError, UnsupportedVllmFeatureError
from pagedkv.integrations.vllm.hisparse import check_hisparse


def _check_retention(retention: int | None, scheduler_block_size: int, groups: list[Any]) -> None:
    """vLLM's own refusals of a retention interval (ValueError, as vLLM's coordinator raises
    them, before any group is looked at): one without a window (or Mamba) group to act on, one
    negative or not a multiple of the scheduler block size."""
    if retention is None:
        return
    if not any(isinstance(g.kv_cache_spec, (SlidingWindowSpec, MambaSpec)) for g in groups):
        if retention != 0:
            raise InvalidArgumentError(
                f"prefix_cache_retention_interval={retention} is set but this model has no "
                "sliding-window or Mamba KV cache group, so retention has no effect (set it to 0)"
            )
        return
    if retention < 0 or retention % scheduler_block_size:
        raise InvalidArgumentError(
            f"prefix_cache_retention_interval ({retention}) must be non-negative and a multiple "
            f"of scheduler_block_size ({scheduler_block_size})"
        )


def mamba_group(i: int, spec: Any) -> Any:
    """The core's state group for vLLM's ``MambaSpec`` group ``i`` (align mode, no speculative
    blocks; prefill check-points are per call, ``checkpoint_alignment``), or the unsupported
    option named."""
    if spec.mamba_cache_mode != "align":
        raise UnsupportedVllmFeatureError(
            f"KV-cache group {i}: MambaSpec with mamba_cache_mode={spec.mamba_cache_mode!r} "
            "(only 'align' is supported)"
        )
    if spec.num_speculative_blocks:
        raise UnsupportedVllmFeatureError(
            f"KV-cache group {i}: MambaSpec with num_speculative_blocks={spec.num_speculative_blocks}"
        )
    return pagedkv.MambaState()


def checkpoint_alignment(kv_cache_config: KVCacheConfig) -> int | None:
    """The prefill check-point alignment of the config's Mamba groups (vLLM's
    ``num_prefill_checkpoint_blocks`` with a ``prefill_checkpoint_alignment``; mamba.py), None
    when they take no check-points. The core applies one rule to every state group: Mamba
    groups that differ in it are refused by name."""
    alignments = {
        (getattr(g.kv_cache_spec, "num_prefill_checkpoint_blocks", 0) > 0)
        and getattr(g.kv_cache_spec, "prefill_checkpoint_alignment", None)
        or None
        for g in kv_cache_config.kv_cache_groups
        if isinstance(g.kv_cache_spec, MambaSpec)
    }
    if len(alignments) > 1:
        raise UnsupportedVllmFeatureError(
            "Mamba groups that differ in their prefill check-points (num_prefill_checkpoint_blocks, "
            f"prefill_checkpoint_alignment): {sorted(map(str, alignments))}"
        )
    return next(iter(alignments), None)


def check_config(
    kv_cache_config: KVCacheConfig,
    scheduler_block_size: int,
    hash_block_size: int,
    dcp_world_size: int,
    pcp_world_size: int,
    metrics_collector: Any,
) -> tuple[int, list[Any]]:
    """The pool's block size and pagedkv's group list (the decoder's: cross-attention groups
    are held beside it, cross_attention.py), or the unsupported feature named."""
    groups = kv_cache_config.kv_cache_groups
    retention = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
    _check_retention(retention, scheduler_block_size, groups)
    check_hisparse(kv_cache_config)  # before the groups: its pieces are refused by name
    if not groups:
        raise UnsupportedVllmFeatureError("a KV-cache config without KV-cache groups")
    kv_groups: list[Any] = []
    block_sizes = set()
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        # Exact classes: vLLM's subclasses (MLA, chunked local attention, Mamba, cross
        # attention, encoder-only, sinks, ...) change what a block holds or which are kept.
        if type(spec) is FullAttentionSpec:
            if getattr(spec, "sliding_window", None) is not None or getattr(
                spec, "attention_chunk_size", None
            ):
                raise UnsupportedVllmFeatureError(
                    f"KV-cache group {i}: a FullAttentionSpec with a sliding window or attention "
                    "chunks (a hybrid allocator disabled)"
                )
            kv_groups.append(pagedkv.FullAttention())
        elif type(spec) is SlidingWindowSpec:
            extra = getattr(spec, "extra_retained_tokens", 0)
            if extra:
                # vLLM's engine sets it for multi-module MTP (its prefill lookahead less one):
                # the window then keeps that many more tokens' blocks, which the core's window
                # release does not.
                raise UnsupportedVllmFeatureError(
                    f"KV-cache group {i}: a SlidingWindowSpec with extra_retained_tokens={extra} "
                    "(multi-module MTP beside sliding-window layers)"
                )
            kv_groups.append(pagedkv.SlidingWindow(spec.sliding_window))
        elif type(spec) is MambaSpec:
            kv_groups.append(mamba_group(i, spec))
        elif type(spec) is CrossAttentionSpec:
            pass  # the encoder's blocks: a core of their own on the same pool (cross_attention.py)
        else:
            raise UnsupportedVllmFeatureError(
                f"KV-cache group {i}: {type(spec).__name__} (pagedkv's vLLM manager supports "
                "FullAttentionSpec, SlidingWindowSpec, CrossAttentionSpec and align-mode "
                "MambaSpec groups; encoder-only and other group kinds are not supported)"
            )
        block_sizes.add(spec.block_size)
    if not kv_groups:
        raise UnsupportedVllmFeatureError(
            "CrossAttentionSpec (cross-attention) groups without a decoder group"
        )
    if len(block_sizes) != 1:
        raise UnsupportedVllmFeatureError(f"KV-cache groups with different block sizes {sorted(block_sizes)}")
    (block_size,) = block_sizes
    if scheduler_block_size != block_size or hash_block_size != block_size:
        raise UnsupportedVllmFeatureError(
            f"scheduler block size {scheduler_block_size} / hash block size {hash_block_size} "
            f"other than the KV block size {block_size}"
        )
    # EAGLE's dropped hit block, lookahead hashing and prefill lookahead: draft.py.
    if dcp_world_size != 1 or pcp_world_size != 1:
        raise UnsupportedVllmFeatureError("decode/prefill context parallelism (DCP/PCP)")
    if metrics_collector is not None:
        raise UnsupportedVllmFeatureError("KV-cache residency metrics (metrics_collector)")
    # pagedkv indexes every full block of a window group (vLLM's dense retention, None); vLLM's
    # sparse retention (0, or an interval) keeps only some, so hits would differ. Without a
    # window group vLLM ignores 0 (and refuses an interval: _check_retention).
    has_window = any(isinstance(g, pagedkv.SlidingWindow) for g in kv_groups)
    if retention is not None and (retention != 0 or has_window):
        raise UnsupportedVllmFeatureError(
            f"prefix_cache_retention_interval={retention} (sparse prefix-cache retention; "
            "pagedkv's vLLM manager retains every block: set it to None)"
        )
    return block_size, kv_groups
