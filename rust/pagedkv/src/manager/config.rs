//! [`ManagerConfig`]: how to build a [`super::KvCacheManager`]; [`AdmitOptions`] and
//! [`SlotOptions`]: what an admission or a per-chunk allocation asks (docs/design.md, Per-chunk
//! allocation).

use super::group_spec::KvGroupSpec;
use crate::error::{invalid, Result};
use crate::prefix::hash::BlockHash;
use crate::TokenId;

/// How to build a [`KvCacheManager`](crate::KvCacheManager).
///
/// ```
/// use pagedkv::ManagerConfig;
/// let cfg = ManagerConfig { num_blocks: 256, block_size: 16, ..Default::default() };
/// assert!(!cfg.enable_prefix_caching);
/// assert_eq!(cfg.num_host_blocks, 0);
/// assert!(!cfg.enable_kv_events);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerConfig {
    /// Device blocks in a fresh pool (ignored by `KvCacheManager::with_pool`).
    pub num_blocks: usize,
    /// Token slots per block (ignored by `KvCacheManager::with_pool`).
    pub block_size: usize,
    /// Reuse cached full blocks across sequences with a common prefix (docs/design.md,
    /// Prefix cache).
    pub enable_prefix_caching: bool,
    /// Blocks in the host swap tier; 0 means no host tier (docs/design.md, Swap tier).
    pub num_host_blocks: usize,
    /// Host blocks of the offload tier: evicted prefix blocks keep their content there and
    /// come back as hits (docs/offload.md). 0, the default, means no offload tier; needs
    /// `enable_prefix_caching`.
    pub num_offload_blocks: usize,
    /// Seed of the keyed block hash (reproducible runs).
    pub hash_seed: u64,
    /// Capacity of the KV-event queue; when full, the oldest event is dropped and counted.
    pub max_events: usize,
    /// Record KV events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) for
    /// `take_events`. Off by default, as in vLLM (`enable_kv_cache_events`): when off, no event
    /// is built, so admission pays nothing for them.
    pub enable_kv_events: bool,
    /// The KV-cache groups, each with its own block table per sequence on the one pool
    /// (docs/design.md, KV groups). The default is one full-attention group.
    pub kv_groups: Vec<KvGroupSpec>,
    /// The longest sequence the model serves, in tokens: `allocate_slots` never allocates past
    /// it, and a window group's admission cap counts at most it (vLLM's `max_model_len`).
    /// `usize::MAX` (the default) means unbounded.
    pub max_model_len: usize,
    /// The most tokens scheduled but not yet processed at once (one batch per concurrent step),
    /// which a window group's admission cap adds to its window (vLLM's
    /// `max_in_flight_tokens`). `None` (the default) means `max_model_len`, vLLM's "no cap".
    pub max_in_flight_tokens: Option<usize>,
    /// Blocks an admission must leave available (vLLM's admission watermark,
    /// `int(watermark * num_blocks)`); 0 by default. Applied to admissions only.
    pub watermark_blocks: usize,
    /// Reserve block 0 of the pool as vLLM's null block (released positions then show as 0 in
    /// the integer views, and block ids equal vLLM's for the same pool size). Needs block 0 of
    /// the pool free (a pool of its own). Off by default (released positions show as -1).
    pub reserve_null_block: bool,
    /// Keep the log of table entries placed since the last `take_new_block_ids` (what a model
    /// runner patches its tables from, and vLLM's list of blocks to zero). Off by default: when
    /// off nothing is recorded.
    pub record_new_block_ids: bool,
}

impl ManagerConfig {
    /// `max_in_flight_tokens`, or `max_model_len` when unset.
    pub(crate) fn in_flight_cap(&self) -> usize {
        self.max_in_flight_tokens.unwrap_or(self.max_model_len)
    }

    /// InvalidArgument unless the per-chunk limits are usable (a model length of at least one
    /// token).
    pub(crate) fn validate_limits(&self) -> Result<()> {
        if self.max_model_len == 0 {
            return invalid("max_model_len must be at least 1 token");
        }
        Ok(())
    }
}

/// A prompt to admit: its token ids (prefix-cached when caching is on), or only its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prompt<'a> {
    /// The prompt's token ids.
    Tokens(&'a [TokenId]),
    /// A prompt of this many tokens whose ids are not given (never prefix-cached).
    Len(usize),
}

impl Prompt<'_> {
    /// Tokens in the prompt.
    pub fn len(&self) -> usize {
        match *self {
            Prompt::Tokens(t) => t.len(),
            Prompt::Len(n) => n,
        }
    }

    /// Whether the prompt is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The token ids, when given.
    pub fn tokens(&self) -> Option<&[TokenId]> {
        match *self {
            Prompt::Tokens(t) => Some(t),
            Prompt::Len(_) => None,
        }
    }
}

/// What [`crate::KvCacheManager::add_sequence_with`] asks besides the prompt (docs/design.md,
/// Per-chunk allocation). The default is [`crate::KvCacheManager::add_sequence`]'s admission.
///
/// ```
/// use pagedkv::AdmitOptions;
/// let o = AdmitOptions::default();
/// assert!(o.reserve_prompt && o.require_full_prompt && o.apply_watermark);
/// assert_eq!((o.num_scheduled, o.num_lookahead_tokens), (usize::MAX, 0));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmitOptions<'a> {
    /// Salt / adapter id / multimodal hash mixed into every block hash.
    pub extra_key: Option<&'a [u8]>,
    /// Of the tokens the cache does not serve, how many the caller computes in its next pass
    /// (a budget: more than there are schedules them all).
    pub num_scheduled: usize,
    /// `true`: blocks for the whole prompt now (the reserve contract). `false`: blocks for the
    /// hit plus `num_scheduled` tokens (plus lookahead) only, after vLLM's admission check
    /// (the per-chunk contract).
    pub reserve_prompt: bool,
    /// Per-chunk admission only (ignored when `reserve_prompt`, which takes the whole prompt):
    /// `true` applies vLLM's whole-prompt admission check (`allocate_slots(...,
    /// full_sequence_must_fit=True)`, vLLM's default `scheduler_reserve_full_isl=True`): the
    /// whole prompt must fit after the hit. `false` checks only what vLLM checks with
    /// `full_sequence_must_fit=False`: the scheduled chunk (plus lookahead) and the watermark
    /// must fit now, and the chunk alone the pool; the rest of the prompt may not fit yet
    /// (the caller preempts when a later `allocate_slots` is refused).
    pub require_full_prompt: bool,
    /// Slots past the scheduled tokens for speculative tokens: allocated, never hashed.
    pub num_lookahead_tokens: usize,
    /// One optional extra key per block (multimodal hashes, LoRA name, cache salt), mixed
    /// into that block's hash beside `extra_key`; blocks past the list have none.
    pub block_extra_keys: Option<&'a [Option<&'a [u8]>]>,
    /// The caller's chained hashes of the prompt's full blocks, from the first, used instead
    /// of pagedkv's own; blocks past the list are not indexed until their hashes are given
    /// (`provide_token_ids`).
    pub block_hashes: Option<&'a [BlockHash]>,
    /// pagedkv's own chained hashes of the prompt's first full blocks, exactly as
    /// `prefix_block_hashes(token_ids, extra_key)` returns them (a prefix of that list, or all
    /// of it), computed earlier (a scheduler hashes each request at arrival,
    /// docs/scheduling.md): used instead of hashing those blocks again, at admission and as
    /// later chunks are computed. Unlike `block_hashes` these are not another engine's names:
    /// the admission is the one without them, block for block and event for event. Hits still
    /// compare token ids, so hashes that are not the prompt's cost hits and name blocks wrongly,
    /// never serve wrong content. With `block_hashes` or `block_extra_keys`, without token ids,
    /// or longer than the prompt's full blocks: `InvalidArgument`.
    pub prompt_hashes: Option<&'a [BlockHash]>,
    /// Whether the admission must leave `ManagerConfig::watermark_blocks` available (vLLM
    /// applies its watermark only while other requests are scheduled).
    pub apply_watermark: bool,
    /// Blocks the admission must leave available besides the watermark (vLLM's
    /// `allocate_slots(..., reserved_blocks=n)`: what in-flight async KV loads still need, so a
    /// new load cannot take blocks they rely on). Applies to the allocation's check only, not
    /// to the whole-prompt check (`require_full_prompt`), as in vLLM.
    pub reserved_blocks: usize,
    /// Per-chunk admission only (ignored under `reserve_prompt`, where every group holds the
    /// whole prompt): how many of the first scheduled tokens are already computed elsewhere
    /// (vLLM's `num_external_computed_tokens`: a KV connector loads them). A window group
    /// releases what its window at the hit plus these tokens leaves *before* the admission is
    /// sized: those positions are never allocated (the null entry) and neither check counts
    /// them, as vLLM's `allocate_slots(..., num_external_computed_tokens=e)` skips them. More
    /// than the scheduled tokens the hit leaves (`num_scheduled` capped at the prompt's rest),
    /// or a hit plus these tokens past the pool's blocks: `InvalidArgument`. Changes nothing
    /// else without a window group.
    pub num_external_computed_tokens: usize,
    /// The hit is the full-attention groups' own run of cached blocks, not the hit every group
    /// serves (vLLM's diverged hit, `get_computed_blocks_for_connector`: a KV connector
    /// restores the state groups' missing state at its end). Valid only per chunk, with
    /// `num_external_computed_tokens > 0`, token ids, prefix caching and groups that are full
    /// attention and state groups only (at least one of each): else `InvalidArgument`,
    /// nothing changed. A state group's hit positions are all released then (as with external
    /// tokens on any hit), and vLLM's count for it counts its own hit block (the rightmost
    /// cached one below the hit) when cached-evictable (manager/state_diverged.rs).
    pub diverged_hit: bool,
    /// vLLM's prefill check-points (a Mamba layer's `num_prefill_checkpoint_blocks`): where a
    /// state group also takes a block below the chunk's last (policy.rs,
    /// `prefill_checkpoint`). Per chunk only, without external tokens: else
    /// `InvalidArgument`, nothing changed. `None`: no check-points.
    pub prefill_checkpoint: Option<PrefillCheckpoint>,
}

/// What decides a state group's prefill check-point (vLLM's `MambaManager` with
/// `num_prefill_checkpoint_blocks`, block size equal to the hash block size): the chunk
/// `[start, end)` that reaches `prefill_end`, starts on a block boundary and spans a boundary
/// `cp`, the last below `end`, at least a block past `start`, with `cp - start` a multiple of
/// `alignment`, also takes the state block of the position ending at `cp` (the worker writes
/// the state at `cp` there from inside the chunk's pass).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillCheckpoint {
    /// Where the request's prefill ends (vLLM's `max(num_prompt_tokens, num_tokens - 1)`).
    pub prefill_end: usize,
    /// The layer's `prefill_checkpoint_alignment` (at least 1).
    pub alignment: usize,
}

impl Default for AdmitOptions<'_> {
    fn default() -> Self {
        AdmitOptions {
            extra_key: None,
            num_scheduled: usize::MAX,
            reserve_prompt: true,
            require_full_prompt: true,
            num_lookahead_tokens: 0,
            block_extra_keys: None,
            block_hashes: None,
            prompt_hashes: None,
            apply_watermark: true,
            reserved_blocks: 0,
            num_external_computed_tokens: 0,
            diverged_hit: false,
            prefill_checkpoint: None,
        }
    }
}

/// What [`crate::KvCacheManager::allocate_slots_with`] asks besides the new tokens
/// (docs/design.md, Per-chunk allocation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotOptions {
    /// Slots past the new tokens for speculative tokens: allocated, never hashed.
    pub num_lookahead_tokens: usize,
    /// Tokens scheduled by passes still in flight: window release waits for them
    /// (`max(0, c - num_in_flight_tokens)` is the processed watermark).
    pub num_in_flight_tokens: usize,
    /// The caller's computed watermark `c` (vLLM moves it itself; lower than the manager's
    /// after rejected drafts). `None`: the manager's.
    pub num_computed_tokens: Option<usize>,
    /// vLLM's prefill check-points, as [`AdmitOptions::prefill_checkpoint`].
    pub prefill_checkpoint: Option<PrefillCheckpoint>,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        ManagerConfig {
            num_blocks: 1024,
            block_size: 16,
            enable_prefix_caching: false,
            num_host_blocks: 0,
            num_offload_blocks: 0,
            hash_seed: 0,
            max_events: 65_536,
            enable_kv_events: false,
            kv_groups: vec![KvGroupSpec::FullAttention],
            max_model_len: usize::MAX,
            max_in_flight_tokens: None,
            watermark_blocks: 0,
            reserve_null_block: false,
            record_new_block_ids: false,
        }
    }
}
