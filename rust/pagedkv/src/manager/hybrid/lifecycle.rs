//! Fork, free, truncate, pins and cache maintenance of a hybrid manager.

use super::cache::Pin;
use super::window::skipped_blocks;
use super::Hybrid;
use crate::error::{invalid, Error, Result};
use crate::manager::groups::NULL_BLOCK;
use crate::manager::{check_distinct, prefilling_error};
use crate::prefix::events::{DrainedEvents, KvEvent};
use crate::{BlockId, SeqId, TokenId};

impl Hybrid {
    /// See [`crate::KvCacheManager::fork`]: the child shares every live block of every group;
    /// released positions stay null in both.
    #[cold]
    pub(crate) fn fork(&mut self, parent_id: SeqId, child_id: SeqId) -> Result<()> {
        let parent = self.resident(parent_id)?;
        if parent.num_computed < parent.num_tokens() {
            return Err(prefilling_error(
                parent_id,
                parent.num_computed,
                parent.num_tokens(),
            ));
        }
        if self.seqs.contains_key(&child_id) {
            return Err(Error::SequenceExists(child_id));
        }
        let child = parent.clone();
        for t in &child.tables {
            for &b in &t.block_ids {
                if b != NULL_BLOCK {
                    self.share(b);
                }
            }
        }
        self.seqs.insert(child_id, child);
        self.counters.forks += 1;
        Ok(())
    }

    /// See [`crate::KvCacheManager::free`]: every group's live blocks are released, group by
    /// group, each table tail first (vLLM's order).
    #[cold]
    pub(crate) fn free(&mut self, seq_id: SeqId) -> Result<()> {
        let seq = self
            .seqs
            .remove(&seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?;
        if seq.swapped {
            self.num_swapped -= 1;
            let host = self.host.as_mut().expect("swapped implies a host tier");
            for t in &seq.tables {
                for &h in t.block_ids.iter().rev() {
                    if h != NULL_BLOCK {
                        host.release(h);
                    }
                }
            }
        } else {
            for t in &seq.tables {
                self.release_all(&t.block_ids);
            }
        }
        Ok(())
    }

    /// See [`crate::KvCacheManager::free_batch`] (all ids validated first).
    #[cold]
    pub(crate) fn free_batch(&mut self, seq_ids: &[SeqId]) -> Result<()> {
        check_distinct(seq_ids)?;
        if let Some(&id) = seq_ids.iter().find(|id| !self.seqs.contains_key(id)) {
            return Err(Error::UnknownSequence(id));
        }
        for &id in seq_ids {
            self.free(id)?;
        }
        Ok(())
    }

    /// See [`crate::KvCacheManager::truncate`]. Refused (InvalidArgument, nothing changes)
    /// when a window group released a position the window at the new length would need:
    /// those K/V are gone.
    #[cold]
    pub(crate) fn truncate(&mut self, seq_id: SeqId, num_tokens: usize) -> Result<()> {
        let bs = self.block_size;
        let seq = self.resident(seq_id)?;
        let old_len = seq.num_tokens();
        if num_tokens > old_len {
            return invalid(format!(
                "cannot truncate sequence {seq_id} of {old_len} tokens to {num_tokens}"
            ));
        }
        if num_tokens == old_len {
            return Ok(());
        }
        let keep = num_tokens.div_ceil(bs);
        for (g, (&spec, t)) in self.specs.iter().zip(&seq.tables).enumerate() {
            // Positions the next query (at `num_tokens`) may read.
            let needed_from = skipped_blocks(spec, num_tokens, bs);
            if t.block_ids[needed_from.min(keep)..keep].contains(&NULL_BLOCK) {
                return invalid(format!(
                    "cannot truncate sequence {seq_id} to {num_tokens} tokens: kv_groups[{g}] \
                     released blocks its window at that length reads"
                ));
            }
        }
        // Commit (infallible from here).
        for g in 0..self.num_groups() {
            let seq = self.seqs.get_mut(&seq_id).expect("validated");
            let dropped: Vec<BlockId> = seq.tables[g].block_ids.drain(keep..).collect();
            seq.tables[g].num_tokens = num_tokens;
            for &b in dropped.iter().rev() {
                self.drop_rolled_back(b);
            }
            if num_tokens % bs != 0 {
                let last = *self.seqs[&seq_id].tables[g].block_ids.last().expect("kept");
                if self.is_last_ref(last) {
                    if let Some(c) = self.cache.as_mut() {
                        c.remove(last);
                    }
                }
            }
        }
        let seq = self.seqs.get_mut(&seq_id).expect("validated");
        seq.num_computed = seq.num_computed.min(num_tokens);
        seq.hashes.truncate(num_tokens / bs);
        if let Some(t) = seq.tokens.as_mut() {
            t.truncate(num_tokens);
        }
        Ok(())
    }

    /// A block past a truncated length: when this table alone holds it, it leaves the index
    /// and goes back to the free list (its content was rejected); else one reference drops.
    fn drop_rolled_back(&mut self, b: BlockId) {
        if self.is_last_ref(b) {
            if let Some(c) = self.cache.as_mut() {
                c.remove(b);
            }
        }
        self.release(b);
    }

    /// See [`crate::KvCacheManager::pin_prefix`]: pins every group's blocks of the longest
    /// prefix of the prompt's full blocks that every group can serve.
    pub(crate) fn pin_prefix(
        &mut self,
        tokens: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Result<usize> {
        if self.cache.is_none() {
            return Ok(0);
        }
        let num_full = tokens.len() / self.block_size;
        let hit = self.find_hit(tokens, extra_key, num_full, num_full);
        if hit.num_blocks == 0 {
            return Ok(0);
        }
        let blocks: Vec<BlockId> = hit
            .blocks
            .iter()
            .flatten()
            .copied()
            .filter(|&b| b != NULL_BLOCK)
            .collect();
        for &b in &blocks {
            self.take_hit(b);
        }
        let key = (hit.hashes.last().copied(), num_full);
        self.cache
            .as_mut()
            .expect("checked")
            .pins
            .push(Pin { key, blocks });
        Ok(hit.num_blocks * self.block_size)
    }

    /// See [`crate::KvCacheManager::unpin_prefix`].
    pub(crate) fn unpin_prefix(
        &mut self,
        tokens: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Result<()> {
        let num_full = tokens.len() / self.block_size;
        let pos = match self.cache.as_ref() {
            Some(c) if num_full > 0 => {
                let hashes = self.find_hit(tokens, extra_key, 0, num_full).hashes;
                let key = (hashes.last().copied(), num_full);
                c.pins.iter().rposition(|p| p.key == key)
            }
            _ => None,
        };
        let Some(pos) = pos else {
            return invalid("unpin_prefix: this prompt has no pin");
        };
        let pin = self.cache.as_mut().expect("found").pins.remove(pos);
        self.release_all(&pin.blocks);
        Ok(())
    }

    /// Distinct pinned blocks.
    pub(crate) fn num_pinned_blocks(&self) -> usize {
        let Some(c) = self.cache.as_ref() else {
            return 0;
        };
        let mut all: Vec<BlockId> = c
            .pins
            .iter()
            .flat_map(|p| p.blocks.iter().copied())
            .collect();
        all.sort_unstable();
        all.dedup();
        all.len()
    }

    /// See [`crate::KvCacheManager::reset_prefix_cache`].
    pub(crate) fn reset_prefix_cache(&mut self) -> bool {
        if self.num_blocks_in_use > 0 {
            return false;
        }
        let Some(cache) = self.cache.as_mut() else {
            return true;
        };
        while let Some(b) = cache.lru.pop_front() {
            cache.remove_silently(b);
            self.pool.free_cached(b);
        }
        cache.events.push(KvEvent::AllBlocksCleared);
        true
    }

    /// See [`crate::KvCacheManager::evict_cached`].
    pub(crate) fn evict_cached(&mut self, max_blocks: usize) -> usize {
        let Some(cache) = self.cache.as_mut() else {
            return 0;
        };
        let mut released = 0;
        while released < max_blocks {
            let Some(b) = cache.lru.pop_front() else {
                break;
            };
            cache.remove(b);
            cache.blocks_evicted += 1;
            self.pool.free_cached(b);
            released += 1;
        }
        released
    }

    /// See [`crate::KvCacheManager::take_drained_events`].
    pub(crate) fn take_drained_events(&mut self) -> DrainedEvents {
        match self.cache.as_mut() {
            Some(c) => c.events.take_drained(),
            None => DrainedEvents::default(),
        }
    }

    /// See [`crate::KvCacheManager::cached_blocks`].
    pub(crate) fn cached_blocks(&self) -> Vec<BlockId> {
        self.cache.as_ref().map_or_else(Vec::new, |c| c.lru.order())
    }
}
