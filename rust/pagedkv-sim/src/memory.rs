//! The interface between the step loop and an allocation policy (paged or contiguous).

use pagedkv::{BlockHash, DrainedEvents, Error, Result, SeqId};

use crate::frames::FramePool;
use crate::group::Group;
use crate::metrics::SlotShares;
use crate::rng::SplitMix64;

/// What admitting a group cost in prefill work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Admission {
    /// Prompt tokens looked up in the prefix cache (0 without caching).
    pub query_tokens: usize,
    /// Of those, tokens served from cached blocks.
    pub hit_tokens: usize,
    /// Tokens whose KV was computed (prompt, plus generated tokens of a recomputed group,
    /// minus hits).
    pub prefill_tokens: usize,
}

/// Per-request figures taken just before a finished group is released.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct FinishedFigures {
    /// Slots allocated to the group but not holding one of its tokens.
    pub waste_slots: f64,
    /// Block-table length of its first sequence (0 for contiguous reservations).
    pub block_table_len: usize,
}

/// An allocation policy the step loop drives. Every method either succeeds completely or, when
/// it reports "does not fit" (`None` / `false`), changes nothing.
pub(crate) trait KvMemory {
    /// Admits a waiting group: allocates every sequence for its prompt (plus, after a recompute
    /// preemption, its generated tokens) and this step's new token, assigning fresh sequence
    /// ids from `next_seq_id`. `alone`: nothing else holds memory, so admission may dip into
    /// reserves kept for running requests. `None` when it does not fit now.
    fn try_admit(
        &mut self,
        group: &mut Group,
        next_seq_id: &mut SeqId,
        alone: bool,
    ) -> Result<Option<Admission>>;

    /// Appends one token to every sequence of `groups` (all of them, or none when memory runs
    /// out: then `Some(blocks_short)`).
    fn append_one(&mut self, groups: &[Group]) -> Result<Option<usize>>;

    /// One beam-search step on the group's sequences (fork survivors, free dropped beams).
    fn beam_step(
        &mut self,
        group: &mut Group,
        rng: &mut SplitMix64,
        next_seq_id: &mut SeqId,
    ) -> Result<()>;

    /// Frees every sequence of the group.
    fn release(&mut self, group: &mut Group) -> Result<()>;

    /// Moves the group to the host tier; `Some(blocks moved)`, or `None` when the host tier
    /// cannot take it (or there is none).
    fn swap_out(&mut self, group: &mut Group) -> Result<Option<usize>>;

    /// Brings a swapped-out group back and appends this step's token to each sequence;
    /// returns the blocks moved, or `None` when it does not fit now.
    fn try_swap_in(&mut self, group: &mut Group, alone: bool) -> Result<Option<usize>>;

    /// Accounts every slot of the pool (see docs/metrics.md). `head`: the next group waiting to
    /// be admitted, if any.
    fn sample(&mut self, running: &[Group], head: Option<&Group>) -> Result<SlotShares>;

    /// Figures of a finished group, before `release`.
    fn finished_figures(&mut self, group: &Group) -> Result<FinishedFigures>;

    /// Blocks (paged) or block-size cells (contiguous) currently handed out.
    fn used_blocks(&self) -> usize;

    /// Checks the allocator's own invariants (the manager's, or the placement allocator's).
    fn check_invariants(&mut self) -> Result<()>;

    /// Per-cell picture of the pool and every running sequence's table, for the visualizer.
    fn frame_pool(&mut self, running: &[Group]) -> Result<FramePool>;

    /// The chained hashes of the full blocks of `group`'s prompt, as the prefix cache keys
    /// them, into `out` (cleared first). Only an allocator with a prefix cache has them.
    fn prompt_block_hashes(&mut self, group: &Group, out: &mut Vec<BlockHash>) -> Result<()> {
        let _ = (group, out);
        Err(Error::InvariantViolation(
            "this allocator has no prefix cache to hash prompts for".into(),
        ))
    }

    /// Drains the prefix cache's KV events recorded since the last call (none without a cache,
    /// or when events are not recorded).
    fn take_cache_events(&mut self) -> Result<DrainedEvents> {
        Ok(DrainedEvents::default())
    }

    /// Marks prefix-cache blocks by chained hash as wanted by a waiting request (evicted after
    /// every other cached block) or not: queue-aware eviction (docs/scheduling.md). Only an
    /// allocator with a prefix cache has it.
    fn set_eviction_priority(&mut self, block_hashes: &[BlockHash], wanted: bool) -> Result<()> {
        let _ = (block_hashes, wanted);
        Err(Error::InvariantViolation(
            "this allocator has no prefix cache to order evictions of".into(),
        ))
    }
}
