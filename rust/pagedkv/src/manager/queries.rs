//! Read-only views: sequence lookups, block tables for kernels, slot mappings, copy ops,
//! occupancy and stats.

use super::checks::check_distinct;
use super::state::KvCacheManager;
use crate::error::{invalid, try_filled, try_with_capacity, Error, Result};
use crate::prefix::PrefixCache;
use crate::stats::Stats;
use crate::table::BlockTable;
use crate::{BlockId, SeqId};

impl KvCacheManager {
    /// Whether a sequence with this id is live.
    pub fn contains(&self, seq_id: SeqId) -> bool {
        self.seqs.contains_key(&seq_id)
    }

    /// Live sequences (resident and swapped out).
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// The ids of all live sequences (arbitrary order).
    pub fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// The physical block ids of a device-resident sequence, in logical order.
    pub fn block_table(&self, seq_id: SeqId) -> Result<&[BlockId]> {
        Ok(&self.resident(seq_id)?.table.block_ids)
    }

    /// The full [`BlockTable`] of a device-resident sequence.
    pub fn table(&self, seq_id: SeqId) -> Result<&BlockTable> {
        Ok(&self.resident(seq_id)?.table)
    }

    /// Tokens held by a sequence (resident or swapped out).
    pub fn num_tokens(&self, seq_id: SeqId) -> Result<usize> {
        Ok(self
            .seqs
            .get(&seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?
            .table
            .num_tokens)
    }

    /// `ceil(num_tokens / block_size)` in each KV-cache group: blocks a prompt needs, ignoring
    /// prefix-cache hits (saturating).
    pub fn blocks_needed_for_prompt(&self, num_tokens: usize) -> usize {
        let per_group = num_tokens.div_ceil(self.block_size);
        per_group.saturating_mul(self.num_groups())
    }

    /// Block tables of `seq_ids` as one row-major `[B, max_blocks]` i32 matrix padded with -1,
    /// plus `max_blocks` and the sequences' lengths (`[B]`, i32). Each id may appear once (a
    /// repeated id is `InvalidArgument`), so the result is bounded by the live sequences; one
    /// that cannot be allocated is [`Error::OutOfMemory`], never an abort.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence_len(1, 3)?;
    /// kv.add_sequence_len(2, 1)?;
    /// let (tables, max_blocks, lens) = kv.batch_block_tables(&[1, 2])?;
    /// assert_eq!((tables, max_blocks, lens), (vec![0, 1, 2, -1], 2, vec![3, 1]));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn batch_block_tables(&self, seq_ids: &[SeqId]) -> Result<(Vec<i32>, usize, Vec<i32>)> {
        if !self.plain || self.null_reserved {
            return self.batch_block_tables_group(seq_ids, 0);
        }
        let mut max_blocks = 0;
        for &id in seq_ids {
            max_blocks = max_blocks.max(self.resident(id)?.table.block_ids.len());
        }
        check_distinct(seq_ids)?;
        let (mut tables, mut lens) = padded_buffers(seq_ids.len(), max_blocks)?;
        for (row, &id) in seq_ids.iter().enumerate() {
            let table = &self.seqs[&id].table;
            let dst = &mut tables[row * max_blocks..row * max_blocks + table.block_ids.len()];
            for (d, &b) in dst.iter_mut().zip(&table.block_ids) {
                *d = b as i32; // block ids < 2^24
            }
            lens.push(table.num_tokens as i32); // pool capacity <= i32::MAX slots
        }
        Ok((tables, max_blocks, lens))
    }

    /// Slots (`block_id * block_size + offset`) of each sequence's last `num_new_tokens`
    /// tokens, row-major `[B * num_new_tokens]`. Each id may appear once (a repeated id is
    /// `InvalidArgument`); a result that cannot be allocated is [`Error::OutOfMemory`].
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence_len(1, 3)?;                 // blocks [0, 1]
    /// assert_eq!(kv.slot_mapping(&[1], 2)?, vec![1, 2]);
    /// assert!(kv.slot_mapping(&[1], 4).is_err());
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn slot_mapping(&self, seq_ids: &[SeqId], num_new_tokens: usize) -> Result<Vec<i64>> {
        if !self.plain {
            return self.slot_mapping_group(seq_ids, num_new_tokens, 0);
        }
        for &id in seq_ids {
            let table = &self.resident(id)?.table;
            check_new_tokens(id, table.num_tokens, num_new_tokens)?;
            check_slots(
                id,
                table.num_tokens,
                table.block_ids.len() * self.block_size,
            )?;
        }
        check_distinct(seq_ids)?;
        let mut slots = slot_buffer(seq_ids.len(), num_new_tokens)?;
        for &id in seq_ids {
            let table = &self.seqs[&id].table;
            for pos in table.num_tokens - num_new_tokens..table.num_tokens {
                slots.push(table.slot_of(pos, self.block_size));
            }
        }
        Ok(slots)
    }

    /// Drains the pending copy-on-write copies `(src, dst)`, oldest first.
    pub fn take_copy_ops(&mut self) -> Vec<(BlockId, BlockId)> {
        std::mem::take(&mut self.pending_copies)
    }

    /// The refcount of a device block.
    pub fn refcount(&self, block_id: BlockId) -> Result<u32> {
        self.pool.refcount(block_id)
    }

    /// Device blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks this manager could allocate now: the pool's free-list blocks plus its own
    /// cached-evictable blocks (Python: `KvCacheManager.num_available_blocks`, alias
    /// `num_free_blocks`). The pool's `num_free_list_blocks` counts its free list only.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3], None)?;
    /// kv.free(1)?;                                   // the full block stays cached
    /// assert_eq!((kv.num_available_blocks(), kv.pool().num_free_list_blocks()), (4, 3));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn num_available_blocks(&self) -> usize {
        self.pool.num_free_list_blocks() + self.prefix.as_ref().map_or(0, PrefixCache::num_cached)
    }

    /// This manager's in-use blocks / the blocks sequences can use (`num_blocks`, less the
    /// reserved null block), in `[0, 1]`.
    pub fn usage(&self) -> f64 {
        self.num_blocks_in_use as f64 / self.num_usable_blocks().max(1) as f64
    }

    /// A snapshot of counters and occupancy.
    pub fn stats(&self) -> Stats {
        let mut s = Stats {
            num_blocks: self.pool.num_blocks(),
            block_size: self.block_size,
            num_blocks_in_use: self.num_blocks_in_use,
            num_free_list_blocks: self.pool.num_free_list_blocks(),
            num_available_blocks: self.pool.num_free_list_blocks(),
            num_sequences: self.seqs.len(),
            num_swapped_sequences: self.num_swapped,
            num_reserved_blocks: usize::from(self.null_reserved),
            ..Stats::default()
        };
        self.counters.write_to(&mut s);
        if let Some(p) = &self.prefix {
            s.num_cached_blocks = p.num_cached();
            s.num_available_blocks = s.num_free_list_blocks + s.num_cached_blocks;
            s.prefix_query_tokens = p.query_tokens;
            s.prefix_hit_tokens = p.hit_tokens;
            s.prefix_hit_rate = hit_rate(p.query_tokens, p.hit_tokens);
            s.blocks_evicted = p.blocks_evicted;
            s.num_pinned_blocks = p.pins.num_pinned_blocks();
            s.events_dropped = p.events.dropped;
            s.event_queue_bytes = p.events.bytes();
        }
        if let Some(h) = &self.host {
            s.num_host_blocks = h.num_blocks();
            s.num_host_blocks_in_use = h.num_in_use();
        }
        if let Some(t) = &self.offload {
            s.num_offload_blocks = t.num_blocks();
            s.num_offloaded_blocks = t.num_indexed();
            s.blocks_offloaded = t.counters.blocks_offloaded;
            s.blocks_loaded = t.counters.blocks_loaded;
            s.offload_blocks_dropped = t.counters.blocks_dropped;
            s.offload_ops_elided = t.counters.ops_elided;
        }
        s
    }
}

/// Prefix hit tokens per query token; 0 rather than NaN before any query. Shared by both
/// managers' stats.
pub(super) fn hit_rate(query_tokens: u64, hit_tokens: u64) -> f64 {
    if query_tokens == 0 {
        0.0
    } else {
        hit_tokens as f64 / query_tokens as f64
    }
}

/// InvalidArgument when sequence `id`, holding `num_tokens`, has fewer than the
/// `num_new_tokens` a slot mapping asks for (`slot_mapping`).
#[inline]
pub(super) fn check_new_tokens(id: SeqId, num_tokens: usize, num_new_tokens: usize) -> Result<()> {
    if num_new_tokens > num_tokens {
        return invalid(format!(
            "sequence {id} holds {num_tokens} tokens, fewer than num_new_tokens={num_new_tokens}"
        ));
    }
    Ok(())
}

/// InvalidArgument when sequence `id`, declaring `num_tokens`, holds slots for fewer
/// (`num_slots`: admitted per chunk and not yet allocated that far).
#[inline]
pub(super) fn check_slots(id: SeqId, num_tokens: usize, num_slots: usize) -> Result<()> {
    if num_tokens > num_slots {
        return invalid(format!(
            "sequence {id} declares {num_tokens} tokens but holds slots for {num_slots} \
             (allocate_slots first)"
        ));
    }
    Ok(())
}

/// An empty slot mapping with room for `num_new_tokens` slots of each of `num_seqs`
/// sequences; a product past `usize` is OutOfMemory, as a failed allocation is.
#[inline]
pub(super) fn slot_buffer(num_seqs: usize, num_new_tokens: usize) -> Result<Vec<i64>> {
    let len = num_seqs
        .checked_mul(num_new_tokens)
        .ok_or(Error::OutOfMemory { bytes: usize::MAX })?;
    try_with_capacity(len)
}

/// The buffers of a padded `[num_seqs, max_blocks]` table view: every cell `-1` (padding, and
/// in a hybrid group a released position) and room for each row's length. A product past
/// `usize` is OutOfMemory, as a failed allocation is.
#[inline]
pub(super) fn padded_buffers(num_seqs: usize, max_blocks: usize) -> Result<(Vec<i32>, Vec<i32>)> {
    let cells = num_seqs
        .checked_mul(max_blocks)
        .ok_or(Error::OutOfMemory { bytes: usize::MAX })?;
    Ok((try_filled(cells, -1i32)?, try_with_capacity(num_seqs)?))
}
