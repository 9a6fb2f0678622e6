//! The paged policy: the real [`KvCacheManager`] hands out blocks on demand; groups share their
//! prompt blocks through `fork` (copy-on-write); requests with a common prefix share cached
//! blocks when prefix caching is on.

use pagedkv::{
    BlockHash, DrainedEvents, Error, KvCacheManager, ManagerConfig, Result, SeqId, Tier, TokenId,
};

use crate::config::SimConfig;
use crate::frames::{FrameCell, FramePool, FrameSequence};
use crate::group::Group;
use crate::memory::{Admission, FinishedFigures, KvMemory};
use crate::metrics::{classify_block, SlotShares};
use crate::rng::SplitMix64;
use crate::tokens::{output_token, PromptSource};
use crate::workload::RequestSpec;

/// Blocks a group of `n` sequences forked from a `prompt_tokens` prompt holds when each of its
/// sequences has `seq_tokens` tokens: the prompt's full blocks once, the rest once per sequence.
pub(crate) fn group_blocks(
    n: usize,
    prompt_tokens: usize,
    seq_tokens: usize,
    block_size: usize,
) -> usize {
    let per_seq = seq_tokens.div_ceil(block_size);
    if n == 1 {
        return per_seq;
    }
    let shared = prompt_tokens / block_size;
    shared + n * (per_seq - shared)
}

pub(crate) struct PagedMemory {
    kv: KvCacheManager,
    block_size: usize,
    num_blocks: usize,
    /// Pool slots beyond the last whole block (external fragmentation, always).
    remainder_slots: usize,
    watermark_blocks: usize,
    num_host_blocks: usize,
    caching: bool,
    /// Whether blocks can be shared (groups or prefix caching): then accounting deduplicates.
    sharing: bool,
    /// `seen[b] == epoch`: block b already counted in this pass.
    seen: Vec<u32>,
    epoch: u32,
    seq_buf: Vec<SeqId>,
    token_buf: Vec<TokenId>,
    /// Where prompt token ids come from (the workload's prefixes and trace blocks).
    prompts: PromptSource,
}

impl PagedMemory {
    /// `record_events`: keep the prefix cache's KV events for [`KvMemory::take_cache_events`]
    /// (a cache-aware scheduler follows the cache through them).
    pub fn new(
        config: &SimConfig,
        has_groups: bool,
        prompts: PromptSource,
        record_events: bool,
    ) -> Result<Self> {
        let num_blocks = config.num_blocks();
        let kv = KvCacheManager::new(ManagerConfig {
            num_blocks,
            block_size: config.block_size,
            enable_prefix_caching: config.enable_prefix_caching,
            num_host_blocks: config.num_host_blocks(),
            hash_seed: config.seed,
            // Events are drained after every admission and step, so the queue stays short; a
            // dropped event would desynchronize the scheduler's index (checked in
            // `take_cache_events`).
            max_events: if record_events { usize::MAX } else { 0 },
            enable_kv_events: record_events,
            ..ManagerConfig::default()
        })?;
        Ok(PagedMemory {
            kv,
            block_size: config.block_size,
            num_blocks,
            remainder_slots: config.num_slots - num_blocks * config.block_size,
            watermark_blocks: config.watermark_blocks(),
            num_host_blocks: config.num_host_blocks(),
            caching: config.enable_prefix_caching,
            sharing: has_groups || config.enable_prefix_caching,
            seen: vec![0; num_blocks],
            epoch: 0,
            seq_buf: Vec::new(),
            token_buf: Vec::new(),
            prompts,
        })
    }

    /// Blocks the group needs at most to hold `seq_tokens` per sequence, for a request that can
    /// never run (error) check: in an empty pool.
    pub fn blocks_for(spec: &RequestSpec, seq_tokens: usize, block_size: usize) -> usize {
        group_blocks(spec.group_size, spec.prompt_tokens, seq_tokens, block_size)
    }

    fn fits(&self, needed_blocks: usize, alone: bool) -> bool {
        let free = self.kv.num_available_blocks();
        free >= needed_blocks && (alone || free - needed_blocks >= self.watermark_blocks)
    }

    /// Token ids of `group`'s sequence `member` at positions `from..to`.
    fn fill_tokens(&mut self, group: &Group, member: usize, from: usize, to: usize) {
        self.token_buf.clear();
        let prompt = group.spec.prompt_tokens;
        self.prompts.extend(
            &group.spec,
            group.request,
            from.min(prompt),
            to.min(prompt),
            &mut self.token_buf,
        );
        self.token_buf
            .extend((from.max(prompt)..to).map(|pos| output_token(group.request, member, pos)));
    }

    /// Appends one token to every sequence in `groups` (one batch call).
    fn append_batch(&mut self, groups: &[Group]) -> Result<Option<usize>> {
        self.seq_buf.clear();
        self.token_buf.clear();
        for group in groups {
            self.seq_buf.extend_from_slice(&group.members);
            if self.caching {
                let pos = group.num_tokens();
                self.token_buf
                    .extend((0..group.members.len()).map(|k| output_token(group.request, k, pos)));
            }
        }
        if self.seq_buf.is_empty() {
            return Ok(None);
        }
        let outcome = if self.caching {
            self.kv
                .append_tokens_batch(&self.seq_buf, &self.token_buf, 1)
        } else {
            self.kv.append_len_batch(&self.seq_buf, 1)
        };
        match outcome {
            Ok(()) => Ok(None),
            Err(Error::OutOfBlocks {
                tier: Tier::Device,
                needed_blocks,
                available_blocks,
            }) => Ok(Some(needed_blocks.saturating_sub(available_blocks).max(1))),
            Err(e) => Err(e),
        }
    }

    /// Counts each distinct block of `groups` once; returns the shares of allocated slots and
    /// the number of distinct blocks.
    fn count_distinct(&mut self, groups: &[Group], shares: &mut SlotShares) -> Result<usize> {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.seen.iter_mut().for_each(|s| *s = 0);
            self.epoch = 1;
        }
        let bs = self.block_size;
        let mut distinct = 0;
        for group in groups {
            let (tokens, final_len) = (group.num_tokens(), group.final_len());
            for &seq in &group.members {
                for (index, &block) in self.kv.block_table(seq)?.iter().enumerate() {
                    let mark = &mut self.seen[block as usize];
                    if *mark != self.epoch {
                        *mark = self.epoch;
                        distinct += 1;
                        let (filled, reserved, internal) =
                            classify_block(index, bs, tokens, final_len);
                        shares.token_slots += filled;
                        shares.reserved_slots += reserved;
                        shares.internal_slots += internal;
                    }
                }
            }
        }
        Ok(distinct)
    }
}

/// An operation that the admission check guaranteed to fit failed: a simulator bug.
fn expect_fits<T>(result: Result<T>, what: &str) -> Result<T> {
    result.map_err(|e| match e {
        Error::OutOfBlocks { .. } => Error::InvariantViolation(format!(
            "{what} ran out of blocks after the admission check: {e}"
        )),
        other => other,
    })
}

impl KvMemory for PagedMemory {
    fn try_admit(
        &mut self,
        group: &mut Group,
        next_seq_id: &mut SeqId,
        alone: bool,
    ) -> Result<Option<Admission>> {
        let n = group.spec.group_size;
        let prompt = group.spec.prompt_tokens;
        let generated = group.generated;
        if !self.fits(
            Self::blocks_for(&group.spec, prompt + generated + 1, self.block_size),
            alone,
        ) {
            return Ok(None);
        }
        group.members = (0..n as u64).map(|k| *next_seq_id + k).collect();
        *next_seq_id += n as u64;
        let first = group.members[0];
        // The sequence (group leader) that holds the shared part: the whole context for a plain
        // request, the prompt for a group (its members then fork and add their own tokens).
        let leader_len = if n == 1 { prompt + generated } else { prompt };
        let hit_tokens = if self.caching {
            self.fill_tokens(group, 0, 0, leader_len);
            let tokens = std::mem::take(&mut self.token_buf);
            let hits = expect_fits(self.kv.add_sequence(first, &tokens, None), "admission");
            self.token_buf = tokens;
            hits?
        } else {
            expect_fits(self.kv.add_sequence_len(first, leader_len), "admission")?
        };
        if n > 1 {
            for &child in &group.members[1..] {
                self.kv.fork(first, child)?;
            }
            if generated > 0 {
                for k in 0..n {
                    let seq = group.members[k];
                    if self.caching {
                        self.fill_tokens(group, k, prompt, prompt + generated);
                        let tokens = std::mem::take(&mut self.token_buf);
                        let r =
                            expect_fits(self.kv.append_tokens(seq, &tokens), "recomputing a group");
                        self.token_buf = tokens;
                        r?;
                    } else {
                        expect_fits(self.kv.append_len(seq, generated), "recomputing a group")?;
                    }
                }
            }
        }
        if let Some(short) = self.append_batch(std::slice::from_ref(group))? {
            return Err(Error::InvariantViolation(format!(
                "admitted group of request {} is {short} blocks short of its first token",
                group.request
            )));
        }
        let context = prompt + n * generated;
        Ok(Some(Admission {
            query_tokens: if self.caching { leader_len } else { 0 },
            hit_tokens,
            prefill_tokens: context - hit_tokens,
        }))
    }

    fn append_one(&mut self, groups: &[Group]) -> Result<Option<usize>> {
        self.append_batch(groups)
    }

    fn beam_step(
        &mut self,
        group: &mut Group,
        rng: &mut SplitMix64,
        next_seq_id: &mut SeqId,
    ) -> Result<()> {
        let width = group.members.len();
        if width < 2 {
            return Ok(());
        }
        // Each new beam extends a uniformly chosen current beam (candidates from one parent
        // often win together, so parents with several children are forked and parents with
        // none are dropped).
        let mut children = vec![0usize; width];
        for _ in 0..width {
            children[rng.next_below(width as u64) as usize] += 1;
        }
        let mut next_members = Vec::with_capacity(width);
        for (j, &count) in children.iter().enumerate() {
            let parent = group.members[j];
            if count > 0 {
                next_members.push(parent);
                for _ in 1..count {
                    let child = *next_seq_id;
                    *next_seq_id += 1;
                    self.kv.fork(parent, child)?;
                    next_members.push(child);
                }
            }
        }
        for (j, &count) in children.iter().enumerate() {
            if count == 0 {
                self.kv.free(group.members[j])?;
            }
        }
        group.members = next_members;
        Ok(())
    }

    fn release(&mut self, group: &mut Group) -> Result<()> {
        self.kv.free_batch(&group.members)?;
        group.members.clear();
        Ok(())
    }

    fn swap_out(&mut self, group: &mut Group) -> Result<Option<usize>> {
        if self.num_host_blocks == 0 {
            return Ok(None);
        }
        // A group larger than the whole host tier could never be swapped: recompute it.
        let mut scratch = SlotShares::default();
        if self.count_distinct(std::slice::from_ref(group), &mut scratch)? > self.num_host_blocks {
            return Ok(None);
        }
        match self.kv.swap_out(&group.members) {
            Ok(moved) => {
                group.swapped_blocks = moved.len();
                Ok(Some(moved.len()))
            }
            Err(Error::OutOfBlocks {
                tier: Tier::Host, ..
            }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn try_swap_in(&mut self, group: &mut Group, alone: bool) -> Result<Option<usize>> {
        // Its blocks come back, and each sequence may need one more for this step's token.
        if !self.fits(group.swapped_blocks + group.members.len(), alone) {
            return Ok(None);
        }
        let moved = expect_fits(self.kv.swap_in(&group.members), "swap-in")?;
        group.swapped_blocks = 0;
        if let Some(short) = self.append_batch(std::slice::from_ref(group))? {
            return Err(Error::InvariantViolation(format!(
                "swapped-in group of request {} is {short} blocks short of its next token",
                group.request
            )));
        }
        Ok(Some(moved.len()))
    }

    fn sample(&mut self, running: &[Group], _head: Option<&Group>) -> Result<SlotShares> {
        let bs = self.block_size;
        let mut shares = SlotShares::default();
        let counted_blocks = if self.sharing {
            self.count_distinct(running, &mut shares)?
        } else {
            let mut blocks = 0;
            for group in running {
                let (tokens, final_len) = (group.num_tokens(), group.final_len());
                let held = tokens.div_ceil(bs);
                let allocated = held * bs;
                let will_fill = final_len.min(allocated);
                shares.token_slots += tokens;
                shares.reserved_slots += will_fill - tokens;
                shares.internal_slots += allocated - will_fill;
                blocks += held * group.members.len();
            }
            blocks
        };
        let used = self.used_blocks();
        if counted_blocks != used {
            return Err(Error::InvariantViolation(format!(
                "running sequences hold {counted_blocks} distinct blocks but the manager has {used} in use"
            )));
        }
        // Every free block can serve any request (no placement constraint); only the slots that
        // make no whole block are unusable.
        shares.external_slots = self.remainder_slots;
        shares.free_slots = (self.num_blocks - used) * bs;
        Ok(shares)
    }

    fn finished_figures(&mut self, group: &Group) -> Result<FinishedFigures> {
        let mut shares = SlotShares::default();
        let distinct = self.count_distinct(std::slice::from_ref(group), &mut shares)?;
        Ok(FinishedFigures {
            waste_slots: (distinct * self.block_size - shares.token_slots) as f64,
            block_table_len: self.kv.block_table(group.members[0])?.len(),
        })
    }

    fn used_blocks(&self) -> usize {
        self.num_blocks - self.kv.num_available_blocks()
    }

    fn check_invariants(&mut self) -> Result<()> {
        self.kv.check_invariants()
    }

    fn prompt_block_hashes(&mut self, group: &Group, out: &mut Vec<BlockHash>) -> Result<()> {
        self.fill_tokens(group, 0, 0, group.spec.prompt_tokens);
        *out = self.kv.prefix_block_hashes(&self.token_buf, None);
        Ok(())
    }

    fn set_eviction_priority(&mut self, block_hashes: &[BlockHash], wanted: bool) -> Result<()> {
        self.kv.set_eviction_priority(block_hashes, wanted)
    }

    fn take_cache_events(&mut self) -> Result<DrainedEvents> {
        let events = self.kv.take_drained_events();
        let dropped = self.kv.stats().events_dropped;
        if dropped > 0 {
            return Err(Error::InvariantViolation(format!(
                "the allocator dropped {dropped} KV events: the scheduling index lost track of the cache"
            )));
        }
        Ok(events)
    }

    fn frame_pool(&mut self, running: &[Group]) -> Result<FramePool> {
        let bs = self.block_size;
        let mut cells = vec![
            FrameCell {
                owner: -1,
                tokens: 0,
                reserved: 0
            };
            self.num_blocks
        ];
        let mut tables = Vec::with_capacity(running.len());
        let mut shared = Vec::new();
        for group in running {
            let tokens = group.num_tokens();
            let mut seqs = Vec::with_capacity(group.members.len());
            for &seq in &group.members {
                let table = self.kv.block_table(seq)?;
                for (index, &block) in table.iter().enumerate() {
                    let cell = &mut cells[block as usize];
                    if cell.owner == -1 {
                        let filled = tokens.saturating_sub(index * bs).min(bs);
                        *cell = FrameCell {
                            owner: group.request as i64,
                            tokens: filled,
                            reserved: bs - filled,
                        };
                        let refcount = self.kv.refcount(block)?;
                        if refcount > 1 {
                            shared.push((block, refcount));
                        }
                    }
                }
                seqs.push(FrameSequence {
                    blocks: table.to_vec(),
                    num_tokens: tokens,
                });
            }
            tables.push((group.request, seqs));
        }
        shared.sort_unstable();
        Ok(FramePool {
            cells,
            tables,
            shared,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_blocks_counts_shared_prompt_blocks_once() {
        // 4 samples of a 1000-token prompt, blocks of 16: 62 full prompt blocks shared, then
        // each sample owns its copy of the partial block (1000 % 16 = 8 tokens) and its output.
        assert_eq!(group_blocks(4, 1000, 1001, 16), 62 + 4);
        assert_eq!(group_blocks(1, 1000, 1001, 16), 63);
        assert_eq!(group_blocks(4, 1000, 1040, 16), 62 + 4 * 3);
        // Prompt ending on a block boundary: every sample starts a fresh block.
        assert_eq!(group_blocks(3, 32, 33, 16), 2 + 3);
    }
}
