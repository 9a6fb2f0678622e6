//! `check_invariants` of a hybrid manager (docs/design.md, Invariants and Hybrid groups):
//! every group's tables, refcounts counted over all groups' tables and pins, the index and
//! the LRU.

use rustc_hash::FxHashMap;

use super::window::skipped_blocks;
use super::Hybrid;
use crate::error::{Error, Result};
use crate::manager::groups::{KvGroupSpec, NULL_BLOCK};
use crate::BlockId;

impl Hybrid {
    /// Verifies every invariant; the first violation is [`Error::InvariantViolation`].
    pub(crate) fn check_invariants(&self) -> Result<()> {
        self.check().map_err(Error::InvariantViolation)
    }

    fn check(&self) -> std::result::Result<(), String> {
        let bs = self.block_size;
        let mut refs: FxHashMap<BlockId, u32> = FxHashMap::default();
        let mut host_refs: FxHashMap<BlockId, u32> = FxHashMap::default();
        for (&id, seq) in &self.seqs {
            if seq.tables.len() != self.num_groups() {
                return Err(format!(
                    "sequence {id}: {} tables for {} groups",
                    seq.tables.len(),
                    self.num_groups()
                ));
            }
            let n = seq.num_tokens();
            if seq.num_computed > n {
                return Err(format!(
                    "sequence {id}: {} computed of {n} tokens",
                    seq.num_computed
                ));
            }
            for (g, (t, &spec)) in seq.tables.iter().zip(&self.specs).enumerate() {
                if t.num_tokens != n {
                    return Err(format!(
                        "sequence {id} group {g}: {} tokens, group 0 has {n}",
                        t.num_tokens
                    ));
                }
                if t.block_ids.len() != n.div_ceil(bs) {
                    return Err(format!(
                        "sequence {id} group {g}: {} blocks for {n} tokens (inv. 3)",
                        t.block_ids.len()
                    ));
                }
                // Released positions: a leading run, never past what the watermark releases.
                let nulls = t.block_ids.iter().take_while(|&&b| b == NULL_BLOCK).count();
                if t.block_ids[nulls..].contains(&NULL_BLOCK) {
                    return Err(format!(
                        "sequence {id} group {g}: a released position after a live one"
                    ));
                }
                if spec == KvGroupSpec::FullAttention && nulls > 0 {
                    return Err(format!(
                        "sequence {id} group {g}: full attention released a block"
                    ));
                }
                if nulls > skipped_blocks(spec, seq.num_computed, bs) {
                    return Err(format!(
                        "sequence {id} group {g}: {nulls} released blocks, more than its window allows at {} computed tokens",
                        seq.num_computed
                    ));
                }
                for &b in &t.block_ids[nulls..] {
                    let map = if seq.swapped {
                        &mut host_refs
                    } else {
                        &mut refs
                    };
                    *map.entry(b).or_default() += 1;
                    let indexed_in = self
                        .cache
                        .as_ref()
                        .filter(|_| !seq.swapped)
                        .and_then(|c| c.group_of(b));
                    if indexed_in.is_some_and(|ig| ig as usize != g) {
                        return Err(format!(
                            "sequence {id} group {g}: block {b} is indexed for group {indexed_in:?}"
                        ));
                    }
                }
            }
            if let (Some(tokens), Some(_)) = (seq.tokens.as_ref(), self.cache.as_ref()) {
                if tokens.len() != n {
                    return Err(format!(
                        "sequence {id}: {} token ids for {n} tokens",
                        tokens.len()
                    ));
                }
            }
            if seq.tokens.is_some() && seq.hashes.len() != seq.num_computed / bs {
                return Err(format!(
                    "sequence {id}: {} block hashes for {} computed tokens",
                    seq.hashes.len(),
                    seq.num_computed
                ));
            }
        }
        if let Some(c) = self.cache.as_ref() {
            for pin in &c.pins {
                for &b in &pin.blocks {
                    *refs.entry(b).or_default() += 1;
                }
            }
        }
        // Inv. 1: refcount = table entries over all groups' tables + pins.
        for (&b, &n) in &refs {
            let rc = self
                .pool
                .refcount(b)
                .map_err(|e| format!("block {b}: {e}"))?;
            if rc != n {
                return Err(format!(
                    "block {b}: refcount {rc}, but {n} table entries and pins (inv. 1)"
                ));
            }
        }
        if refs.len() != self.num_blocks_in_use {
            return Err(format!(
                "{} blocks referenced, but num_blocks_in_use is {}",
                refs.len(),
                self.num_blocks_in_use
            ));
        }
        if let Some(host) = self.host.as_ref() {
            host.check()?;
            for (&h, &n) in &host_refs {
                if host.refcount(h) != Some(n) {
                    return Err(format!(
                        "host block {h}: refcount {:?}, {n} table entries",
                        host.refcount(h)
                    ));
                }
            }
            if host_refs.len() != host.num_in_use() {
                return Err(format!(
                    "{} host blocks referenced, {} in use",
                    host_refs.len(),
                    host.num_in_use()
                ));
            }
        }
        let Some(c) = self.cache.as_ref() else {
            return Ok(());
        };
        // Inv. 2 and 5: cached blocks are indexed at refcount 0; indexed blocks verify.
        c.check_map()?;
        c.lru.check()?;
        let mut in_lru = 0;
        for (b, r) in c.indexed() {
            if r.group as usize >= self.num_groups() {
                return Err(format!("indexed block {b} names group {}", r.group));
            }
            let h = c
                .hasher
                .hash_block(r.parent, &r.tokens, r.extra_key.as_deref());
            if h != r.hash {
                return Err(format!(
                    "indexed block {b}: its tokens hash to {h:#x}, not {:#x} (inv. 5)",
                    r.hash
                ));
            }
            let rc = self
                .pool
                .refcount(b)
                .map_err(|e| format!("block {b}: {e}"))?;
            if c.lru.contains(b) {
                in_lru += 1;
                if rc != 0 {
                    return Err(format!("cached-evictable block {b} has refcount {rc}"));
                }
            } else if !refs.contains_key(&b) {
                return Err(format!("indexed block {b} is neither in use nor cached"));
            }
        }
        if in_lru != c.lru.len() {
            return Err(format!(
                "{} LRU blocks, {in_lru} of them indexed",
                c.lru.len()
            ));
        }
        if self.pool.num_cached_blocks() < c.lru.len() {
            return Err(format!(
                "the pool counts {} cached blocks, this manager holds {}",
                self.pool.num_cached_blocks(),
                c.lru.len()
            ));
        }
        Ok(())
    }
}
