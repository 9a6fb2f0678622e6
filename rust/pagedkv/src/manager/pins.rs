//! Pinned prefixes: `pin_prefix` / `unpin_prefix` (docs/design.md, Pinned prefixes).

use super::admission::HitWalk;
use super::keys::PromptHashes;
use super::state::KvCacheManager;
use crate::error::{invalid, Result};
use crate::prefix::hash::BlockHash;
use crate::prefix::PrefixCache;
use crate::{BlockId, TokenId};

impl KvCacheManager {
    /// Pins the cached blocks of the longest cached prefix of `token_ids`'s full blocks (the
    /// chain an admission would hit, its last full block included) and returns the tokens
    /// pinned. A pinned block holds one reference per pin: it is never evicted, reclaimed by
    /// a peer or reset (`reset_prefix_cache` refuses while anything is pinned) until the
    /// matching [`Self::unpin_prefix`]. Pins nest. Pinning nothing (no cached prefix, or
    /// prefix caching off) returns 0 and records no pin.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// let system = [1, 2, 3, 4];
    /// kv.add_sequence(1, &system, None)?;
    /// kv.free(1)?;
    /// assert_eq!(kv.pin_prefix(&system, None)?, 4);
    /// assert_eq!(kv.stats().num_pinned_blocks, 2);
    /// kv.add_sequence_len(2, 8).unwrap_err();        // the pinned blocks are not evicted
    /// assert!(!kv.reset_prefix_cache());
    /// kv.unpin_prefix(&system, None)?;
    /// kv.add_sequence_len(2, 8)?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn pin_prefix(&mut self, token_ids: &[TokenId], extra_key: Option<&[u8]>) -> Result<usize> {
        if !self.plain {
            return self.pin_groups(token_ids, extra_key);
        }
        let Some(prefix) = self.prefix.as_ref() else {
            return Ok(0);
        };
        let bs = self.block_size;
        let num_full = token_ids.len() / bs;
        let mut hashes = Vec::with_capacity(num_full);
        let mut blocks: Vec<BlockId> = Vec::with_capacity(num_full);
        let mut chain = prefix.hasher.chain(bs, extra_key);
        let walk = HitWalk {
            prefix,
            pool: &self.pool,
            block_size: bs,
            token_ids,
            extra_key,
            max_blocks: num_full,
            given: &[],
        };
        walk.run::<false>(&mut chain, &mut hashes, &mut blocks)?;
        if blocks.is_empty() {
            return Ok(0);
        }
        let key = prompt_key(prefix, token_ids, extra_key, bs, &hashes);
        // Commit (infallible: the walk checked every in-use hit's refcount).
        for &b in &blocks {
            if self.prefix.as_ref().is_some_and(|p| p.is_cached(b)) {
                self.revive_cached(b);
            } else {
                let shared = self.share(b);
                debug_assert!(shared.is_ok(), "share of a pinned block failed: {shared:?}");
            }
        }
        let pinned = blocks.len() * bs;
        self.prefix
            .as_mut()
            .expect("prefix caching on")
            .pins
            .add(key, blocks);
        Ok(pinned)
    }

    /// Releases the most recent pin of `token_ids` (the same full blocks and extra key as a
    /// [`Self::pin_prefix`] that pinned something): its blocks lose that pin's reference and,
    /// at refcount 0, become cached-evictable again (tail first). A prompt with no such pin is
    /// [`crate::Error::InvalidArgument`], changing nothing.
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3], None)?;
    /// assert_eq!(kv.pin_prefix(&[1, 2], None)?, 2);
    /// assert_eq!(kv.pin_prefix(&[1, 2], None)?, 2);     // nested: pinned twice
    /// kv.unpin_prefix(&[1, 2], None)?;
    /// kv.unpin_prefix(&[1, 2], None)?;
    /// assert!(matches!(kv.unpin_prefix(&[1, 2], None), Err(Error::InvalidArgument(_))));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn unpin_prefix(&mut self, token_ids: &[TokenId], extra_key: Option<&[u8]>) -> Result<()> {
        let bs = self.block_size;
        let blocks = self
            .prefix
            .as_mut()
            .filter(|_| token_ids.len() >= bs)
            .and_then(|prefix| {
                let key = prompt_key(prefix, token_ids, extra_key, bs, &[]);
                prefix.pins.remove(key)
            });
        let Some(blocks) = blocks else {
            return invalid(format!(
                "no pin of this prefix ({} full blocks) to release",
                token_ids.len() / bs
            ));
        };
        self.release_all(&blocks);
        Ok(())
    }

    /// [`Self::pin_prefix`] of a manager of several groups: pins every group's device blocks
    /// of the longest prefix of the prompt's full blocks that every group serves.
    #[cold]
    fn pin_groups(&mut self, token_ids: &[TokenId], extra_key: Option<&[u8]>) -> Result<usize> {
        let Some(prefix) = self.prefix.as_ref() else {
            return Ok(0);
        };
        let bs = self.block_size;
        let num_full = token_ids.len() / bs;
        let seq_key = extra_key.map(std::sync::Arc::from);
        let mut hashes = PromptHashes::new(prefix.hasher, bs, token_ids, &seq_key, None);
        let hit = self.find_group_hit_on(&mut hashes, num_full, false, false);
        if hit.num_blocks == 0 {
            return Ok(0);
        }
        let blocks: Vec<BlockId> = hit.device_blocks().collect();
        for &b in &blocks {
            if !prefix.is_cached(b) && self.pool.refcount(b)? == u32::MAX {
                return invalid(format!("block {b} refcount would overflow"));
            }
        }
        hashes.get(num_full - 1);
        let key = prompt_key(prefix, token_ids, extra_key, bs, &hashes.hashes);
        // Commit (infallible: every in-use hit's refcount was checked).
        for &b in &blocks {
            self.take_hit(b);
        }
        self.prefix
            .as_mut()
            .expect("prefix caching on")
            .pins
            .add(key, blocks);
        Ok(hit.num_blocks * bs)
    }

    /// Releases every pin (the manager is going away).
    pub(super) fn unpin_all(&mut self) {
        let blocks = match self.prefix.as_mut() {
            Some(prefix) => prefix.pins.take_all(),
            None => return,
        };
        self.release_all(&blocks);
    }
}

/// A prompt's pin key: the chain hash of its last full block (`token_ids` has at least one).
/// `known` holds the hashes of its first blocks, already computed.
fn prompt_key(
    prefix: &PrefixCache,
    token_ids: &[TokenId],
    extra_key: Option<&[u8]>,
    block_size: usize,
    known: &[BlockHash],
) -> BlockHash {
    let num_full = token_ids.len() / block_size;
    let mut known = known[..known.len().min(num_full)].to_vec();
    let mut chain = prefix.hasher.chain(block_size, extra_key);
    for i in known.len()..num_full {
        let parent = known.last().copied();
        known.push(chain.hash(parent, &token_ids[i * block_size..(i + 1) * block_size]));
    }
    known[num_full - 1]
}
