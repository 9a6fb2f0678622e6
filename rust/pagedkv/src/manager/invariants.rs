//! `check_invariants`: every invariant of docs/design.md, Invariants, for this manager's
//! blocks, its prefix cache and host tier, and the pool's consistency.

use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use super::group_spec::NULL_BLOCK;
use super::state::{KvCacheManager, Sequence};
use crate::error::{Error, Result};
use crate::prefix::hash::group_key;
use crate::{BlockId, SeqId};

impl KvCacheManager {
    /// Verifies docs/design.md, Invariants, for this manager's blocks, its prefix cache and host
    /// tier, and the pool's consistency; safe to call while other managers use the same pool. Returns
    /// [`Error::InvariantViolation`] naming the first broken invariant. The pool's cached-block
    /// count must equal this manager's cache while it is the pool's only manager; with several
    /// managers it is checked as a bound here and exactly by
    /// [`crate::PoolPeers::check_cached_count`]. The free-list equalities are exact only while
    /// nothing else holds the pool's `Arc` (else bounds).
    ///
    /// ```
    /// let mut kv = pagedkv::KvCacheManager::new(Default::default())?;
    /// kv.add_sequence_len(1, 100)?;
    /// kv.check_invariants()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn check_invariants(&mut self) -> Result<()> {
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
        let ng = self.num_groups();
        let mut refs: FxHashMap<BlockId, u32> = FxHashMap::default();
        let mut host_refs: FxHashMap<BlockId, u32> = FxHashMap::default();
        let mut swapped = 0;
        for (&id, seq) in self.seqs.iter() {
            if let Err(msg) = self.check_sequence(id, seq) {
                return fail(msg);
            }
            if seq.swapped {
                swapped += 1;
            }
            for g in 0..ng {
                let table = seq.group_table(g);
                let tally = if seq.swapped {
                    &mut host_refs
                } else {
                    &mut refs
                };
                let mut distinct = FxHashSet::default();
                for (i, &b) in table.iter().enumerate() {
                    if b == NULL_BLOCK {
                        continue;
                    }
                    if !distinct.insert(b) {
                        return fail(format!(
                            "sequence {id} group {g}: block {b} appears twice in its table"
                        ));
                    }
                    *tally.entry(b).or_insert(0) += 1;
                    if seq.swapped {
                        continue;
                    }
                    if b as usize >= self.pool.num_blocks() {
                        return fail(format!("sequence {id}: block id {b} out of range"));
                    }
                    if self.null_reserved && b == 0 {
                        return fail(format!(
                            "sequence {id} group {g}: the null block in a table"
                        ));
                    }
                    let Some(p) = &self.prefix else {
                        continue;
                    };
                    if !p.is_indexed(b) {
                        continue;
                    }
                    if p.group_of(b) as usize != g {
                        return fail(format!(
                            "sequence {id} group {g}: block {b} is indexed for group {}",
                            p.group_of(b)
                        ));
                    }
                    // Indexed blocks lie below the watermark, except the block the next write
                    // starts in (position `num_computed / block_size`), which a truncate or a
                    // rollback left holding content others index: that write copies it.
                    if i * bs > seq.num_computed {
                        return fail(format!(
                            "sequence {id} group {g}: block {b} is indexed past the {} computed tokens",
                            seq.num_computed
                        ));
                    }
                    let recorded = seq.hashing.as_ref().and_then(|h| h.block_hashes.get(i));
                    if let Some(&h) = recorded {
                        if !p.holds(b, group_key(g as u32, h)) {
                            return fail(format!(
                                "sequence {id} group {g}: block {b} indexed under another hash"
                            ));
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
        if self.null_reserved {
            let rc = self.pool.refcount(0)?;
            if rc != 1 || refs.contains_key(&0) {
                return fail(format!("the null block has refcount {rc} or is referenced"));
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
        let total = self.num_blocks_in_use + cached + free + usize::from(self.null_reserved);
        if (exclusive_pool && total != self.pool.num_blocks()) || total > self.pool.num_blocks() {
            return fail(format!(
                "in use {} + cached {cached} + free {free} vs num_blocks {}",
                self.num_blocks_in_use,
                self.pool.num_blocks()
            ));
        }
        // Exact whenever this manager is the pool's only one (embedders' own blocks never
        // enter the count): from Python too, where the `BlockPool` object holds a second `Arc`.
        if let Some(pool_cached) = self.pool.cached_count_with_managers(1) {
            if pool_cached != cached {
                return fail(format!(
                    "pool counts {pool_cached} cached blocks, this manager (the pool's only \
                     one) caches {cached}"
                ));
            }
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
        if let Some(tier) = &self.offload {
            tier.check(self.pool.num_blocks())
                .map_err(Error::InvariantViolation)?;
        }
        if let Some((len, compact_at)) = self.new_block_log_len() {
            if len >= compact_at {
                return fail(format!(
                    "the new-block log holds {len} entries, past its bound {compact_at}"
                ));
            }
        }
        Ok(())
    }

    /// Invariant 3 and the hashing state of one sequence (docs/design.md, Invariants).
    fn check_sequence(&self, id: SeqId, seq: &Sequence) -> std::result::Result<(), String> {
        let bs = self.block_size;
        let ng = self.num_groups();
        if seq.groups.len() + 1 != ng {
            return Err(format!(
                "sequence {id}: {} tables for {ng} groups",
                seq.groups.len() + 1
            ));
        }
        let len = seq.num_positions();
        let n = seq.table.num_tokens;
        if seq.groups.iter().any(|t| t.len() != len) {
            return Err(format!(
                "sequence {id}: its groups' tables differ in length"
            ));
        }
        if seq.num_computed > len * bs || seq.num_computed > n {
            return Err(format!(
                "sequence {id}: {} tokens computed, {n} declared, slots for {} (inv. 3)",
                seq.num_computed,
                len * bs
            ));
        }
        if !seq.per_chunk && n.div_ceil(bs) > len {
            return Err(format!(
                "sequence {id}: {len} blocks for {n} tokens (inv. 3)"
            ));
        }
        // Inv. 4: a sequence holding slots past its tokens never shares or indexes a block
        // its next appends write (the single-group append checks only its last block).
        let written = if n.div_ceil(bs) < len && !seq.swapped {
            n / bs..len
        } else {
            0..0
        };
        for (g, spec) in self.config.kv_groups.iter().enumerate() {
            let table = seq.group_table(g);
            for b in table[written.clone()]
                .iter()
                .copied()
                .filter(|&b| b != NULL_BLOCK)
            {
                let shared = self.pool.refcount(b) != Ok(1);
                if shared || self.prefix.as_ref().is_some_and(|p| p.is_indexed(b)) {
                    return Err(format!(
                        "sequence {id} group {g}: block {b} is shared or indexed, and the \
                         sequence's next appends write it (slots past its tokens; inv. 4)"
                    ));
                }
            }
            if spec.is_state() {
                // A state group's table is null but for its state blocks: no run to check.
                continue;
            }
            let nulls = table.iter().take_while(|&&b| b == NULL_BLOCK).count();
            if table[nulls..].contains(&NULL_BLOCK) {
                return Err(format!(
                    "sequence {id} group {g}: a released position after a live one"
                ));
            }
            if nulls > spec.skipped_blocks(seq.num_computed, bs) {
                return Err(format!(
                    "sequence {id} group {g}: {nulls} released blocks, more than its window \
                     allows at {} computed tokens",
                    seq.num_computed
                ));
            }
        }
        if let Some(h) = &seq.hashing {
            let known = h.num_known(bs);
            let mut hashed = seq.num_computed.min(known) / bs;
            if let Some(caller) = h.keys.as_ref().and_then(|k| k.hashes.as_ref()) {
                hashed = hashed.min(caller.len());
            }
            if h.block_hashes.len() != hashed || known > n {
                return Err(format!(
                    "sequence {id}: hashing state out of step ({} hashed blocks, {known} known \
                     tokens, {} computed, {n} declared)",
                    h.block_hashes.len(),
                    seq.num_computed
                ));
            }
        }
        Ok(())
    }
}
