//! The cached-block index: content hash -> the block holding that content, with what each
//! indexed block was stored with (parent hash, extra key, token ids).
//!
//! On a hit the stored parent hash, extra key and token ids of the block are compared too, so
//! a colliding hash can never serve another request's keys for that block; earlier blocks are
//! covered by the 128-bit keyed chain. (The comparison is a memcmp of `block_size` ids, cheap
//! next to the hash itself, so it is always on.)

use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::hash::{BlockHash, BlockHasher};
use crate::{BlockId, TokenId};

/// What one block was stored with (indexed by block id).
#[derive(Debug, Clone, Default)]
struct Stored {
    /// `Some(h)` exactly when `map[h] == this block`.
    hash: Option<BlockHash>,
    /// Parent hash the block was stored with.
    parent: Option<BlockHash>,
    /// Extra key the block was stored with.
    extra_key: Option<Arc<[u8]>>,
    /// Token ids the block was stored with (`block_size` of them while indexed; the buffer is
    /// kept after removal and reused).
    token_ids: Vec<TokenId>,
}

/// Content hash -> block, for in-use and cached-evictable blocks alike. Only full blocks are
/// indexed (docs/design.md, Invariants 5).
#[derive(Debug)]
pub(crate) struct BlockIndex {
    block_size: usize,
    /// Content hash -> the block holding that content.
    map: FxHashMap<BlockHash, BlockId>,
    /// Per block id of the pool.
    stored: Vec<Stored>,
}

impl BlockIndex {
    pub(crate) fn new(num_blocks: usize, block_size: usize) -> Self {
        BlockIndex {
            block_size,
            map: FxHashMap::default(),
            stored: vec![Stored::default(); num_blocks],
        }
    }

    /// Indexed blocks.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    #[inline]
    pub(crate) fn is_indexed(&self, b: BlockId) -> bool {
        self.stored[b as usize].hash.is_some()
    }

    /// Whether block `b` is indexed under exactly `hash`.
    #[inline]
    pub(crate) fn holds(&self, b: BlockId, hash: BlockHash) -> bool {
        self.stored[b as usize].hash == Some(hash)
    }

    /// The block holding exactly this content (same hash, parent, extra key and tokens).
    #[inline]
    pub(crate) fn lookup(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Option<BlockId> {
        let &b = self.map.get(&hash)?;
        let s = &self.stored[b as usize];
        let same =
            s.parent == parent && s.extra_key.as_deref() == extra_key && s.token_ids == token_ids;
        same.then_some(b)
    }

    /// Enters full block `b` under `hash` unless that content is already indexed (by another
    /// block) or `b` already holds indexed content. Returns whether it was entered.
    pub(crate) fn insert(
        &mut self,
        b: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: &Option<Arc<[u8]>>,
    ) -> bool {
        debug_assert_eq!(token_ids.len(), self.block_size);
        let s = &mut self.stored[b as usize];
        if s.hash.is_some() || self.map.contains_key(&hash) {
            return false;
        }
        self.map.insert(hash, b);
        s.hash = Some(hash);
        s.parent = parent;
        s.extra_key = extra_key.clone();
        s.token_ids.clear();
        s.token_ids.extend_from_slice(token_ids);
        true
    }

    /// Takes block `b` out of the index; returns the hash it was indexed under, if any.
    pub(crate) fn remove(&mut self, b: BlockId) -> Option<BlockHash> {
        let s = &mut self.stored[b as usize];
        let h = s.hash.take()?;
        self.map.remove(&h);
        s.parent = None;
        s.extra_key = None;
        Some(h)
    }

    /// Verifies the map against the per-block records, and each indexed block's hash against
    /// its stored content (docs/design.md, Invariants 5).
    pub(crate) fn check(&self, hasher: &BlockHasher) -> Result<(), String> {
        for (&h, &b) in &self.map {
            let s = self
                .stored
                .get(b as usize)
                .ok_or(format!("index names block {b} out of range"))?;
            if s.hash != Some(h) {
                return Err(format!("index maps a hash to block {b} whose hash differs"));
            }
            if s.token_ids.len() != self.block_size {
                return Err(format!("indexed block {b} is not full"));
            }
            let recomputed = hasher.hash_block(s.parent, &s.token_ids, s.extra_key.as_deref());
            if recomputed != h {
                return Err(format!("indexed block {b}: hash does not match its tokens"));
            }
        }
        let indexed = self.stored.iter().filter(|s| s.hash.is_some()).count();
        if indexed != self.map.len() {
            return Err(format!(
                "{indexed} blocks carry a hash but the index has {}",
                self.map.len()
            ));
        }
        Ok(())
    }
}
