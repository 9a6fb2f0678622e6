//! `check_invariants`: every invariant of docs/design.md, Invariants, for this manager's
//! blocks, its prefix cache and host tier, and the pool's consistency.

use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use super::KvCacheManager;
use crate::error::{Error, Result};
use crate::BlockId;

impl KvCacheManager {
    /// Verifies docs/design.md, Invariants, for this manager's blocks, its prefix cache and host
    /// tier, and the pool's consistency; safe to call while other managers use the same pool. Returns
    /// [`Error::InvariantViolation`] naming the first broken invariant. (With a pool shared by
    /// several managers, the pool-wide equalities are checked as bounds.)
    ///
    /// ```
    /// let mut kv = pagedkv::KvCacheManager::new(Default::default())?;
    /// kv.add_sequence_len(1, 100)?;
    /// kv.check_invariants()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn check_invariants(&mut self) -> Result<()> {
        if let Some(h) = self.hybrid.as_deref() {
            return h.check_invariants();
        }
        let fail = |msg: String| Err(Error::InvariantViolation(msg));
        // Exclusive only if no other `Arc` exists *and* nobody borrows this one: `&mut self`
        // rules out a `kv.pool()` borrow in use on another thread (a strong count of 1 alone
        // would not), and `get_mut` rules out other owners, weak ones included.
        let exclusive_pool = Arc::get_mut(&mut self.pool).is_some();
        if exclusive_pool {
            self.pool.check_invariants_quiescent()?;
        } else {
            self.pool.check_invariants()?;
        }
        let bs = self.block_size;
        let mut refs: FxHashMap<BlockId, u32> = FxHashMap::default();
        let mut host_refs: FxHashMap<BlockId, u32> = FxHashMap::default();
        let mut swapped = 0;
        for (&id, seq) in self.seqs.iter() {
            let t = &seq.table;
            let expect = t.num_tokens.div_ceil(bs);
            if t.block_ids.len() != expect {
                return fail(format!(
                    "sequence {id}: {} blocks for {} tokens (expected {expect})",
                    t.block_ids.len(),
                    t.num_tokens
                ));
            }
            if seq.num_computed > t.num_tokens {
                return fail(format!(
                    "sequence {id}: {} tokens computed of {}",
                    seq.num_computed, t.num_tokens
                ));
            }
            if let Some(h) = &seq.hashing {
                if h.block_hashes.len() != seq.num_computed / bs
                    || h.pending_tokens.len() + h.block_hashes.len() * bs != t.num_tokens
                {
                    return fail(format!(
                        "sequence {id}: hashing state out of step with its length"
                    ));
                }
            }
            let tally = if seq.swapped {
                swapped += 1;
                &mut host_refs
            } else {
                &mut refs
            };
            let mut distinct = FxHashSet::default();
            for (i, &b) in t.block_ids.iter().enumerate() {
                if !distinct.insert(b) {
                    return fail(format!(
                        "sequence {id}: block {b} appears twice in its table"
                    ));
                }
                *tally.entry(b).or_insert(0) += 1;
                if seq.swapped {
                    continue;
                }
                if b as usize >= self.pool.num_blocks() {
                    return fail(format!("sequence {id}: block id {b} out of range"));
                }
                if let Some(p) = &self.prefix {
                    if p.is_indexed(b) {
                        // Indexed blocks lie below the watermark, except the partial last
                        // block a truncate left shared, of a computed sequence (its next write
                        // copies it).
                        let last = i + 1 == t.block_ids.len();
                        let done = seq.num_computed == t.num_tokens;
                        if (i + 1) * bs > seq.num_computed && !(last && done) {
                            return fail(format!(
                                "sequence {id}: block {b} is indexed past the {} computed tokens",
                                seq.num_computed
                            ));
                        }
                        let recorded = seq.hashing.as_ref().and_then(|h| h.block_hashes.get(i));
                        if let Some(&h) = recorded {
                            if !p.holds(b, h) {
                                return fail(format!(
                                    "sequence {id}: block {b} indexed under another hash"
                                ));
                            }
                        }
                    }
                }
            }
        }
        if swapped != self.num_swapped {
            return fail(format!(
                "{swapped} swapped sequences, counter says {}",
                self.num_swapped
            ));
        }
        if let Some(p) = &self.prefix {
            for (b, n) in p.pins.iter() {
                *refs.entry(b).or_insert(0) += n;
            }
        }
        for (&b, &n) in &refs {
            let rc = self.pool.refcount(b)?;
            if rc != n {
                return fail(format!(
                    "block {b}: refcount {rc} but {n} table and pin references"
                ));
            }
        }
        if refs.len() != self.num_blocks_in_use {
            return fail(format!(
                "{} distinct blocks referenced but num_blocks_in_use = {}",
                refs.len(),
                self.num_blocks_in_use
            ));
        }
        let cached = match &self.prefix {
            Some(p) => {
                p.check(|b| self.pool.refcount(b).unwrap_or(u32::MAX))
                    .map_err(Error::InvariantViolation)?;
                p.num_cached()
            }
            None => 0,
        };
        let free = self.pool.num_free_list_blocks();
        let total = self.num_blocks_in_use + cached + free;
        if (exclusive_pool && total != self.pool.num_blocks()) || total > self.pool.num_blocks() {
            return fail(format!(
                "in use {} + cached {cached} + free {free} vs num_blocks {}",
                self.num_blocks_in_use,
                self.pool.num_blocks()
            ));
        }
        if exclusive_pool && self.pool.num_cached_blocks() != cached {
            return fail(format!(
                "pool counts {} cached blocks, cache holds {cached}",
                self.pool.num_cached_blocks()
            ));
        }
        match &self.host {
            Some(host) => {
                host.check().map_err(Error::InvariantViolation)?;
                for (&h, &n) in &host_refs {
                    match host.refcount(h) {
                        Some(rc) if rc == n => {}
                        rc => {
                            return fail(format!(
                                "host block {h}: refcount {rc:?} but {n} references"
                            ))
                        }
                    }
                }
                if host_refs.len() != host.num_in_use() {
                    return fail(format!(
                        "{} host blocks referenced but {} in use",
                        host_refs.len(),
                        host.num_in_use()
                    ));
                }
            }
            None if !host_refs.is_empty() => {
                return fail("swapped sequences without a host tier".into())
            }
            None => {}
        }
        for &(src, dst) in &self.pending_copies {
            if src == dst {
                return fail(format!("copy op ({src}, {dst}) copies a block onto itself"));
            }
        }
        Ok(())
    }
}
