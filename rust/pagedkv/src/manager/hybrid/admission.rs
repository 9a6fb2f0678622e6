//! Admission and prefix look-up of a hybrid manager: the longest prefix every group can serve
//! ([`window::hybrid_hit`]), then fresh blocks for the rest in every group.

use std::sync::Arc;

use super::window::{hybrid_hit, skipped_blocks};
use super::{Hybrid, HybridSeq};
use crate::error::{invalid, Error, Result};
use crate::manager::groups::NULL_BLOCK;
use crate::prefix::hash::BlockHash;
use crate::table::BlockTable;
use crate::{BlockId, SeqId, TokenId};

/// A hit found by [`Hybrid::find_hit`]: its length in blocks, the chained hashes of the
/// prompt's full blocks, and each group's hit blocks (`NULL_BLOCK` where a window group does
/// not need the position).
pub(super) struct Hit {
    pub(super) num_blocks: usize,
    pub(super) hashes: Vec<BlockHash>,
    pub(super) blocks: Vec<Vec<BlockId>>,
}

impl Hybrid {
    /// Chained hashes of the first `num_blocks` full blocks of `tokens`.
    fn chain_hashes(
        &self,
        tokens: &[TokenId],
        extra_key: Option<&[u8]>,
        num_blocks: usize,
    ) -> Vec<BlockHash> {
        let cache = self.cache.as_ref().expect("hashing implies a prefix cache");
        let mut chain = cache.hasher.chain(self.block_size, extra_key);
        let mut hashes = Vec::with_capacity(num_blocks);
        let mut parent = None;
        for chunk in tokens.chunks_exact(self.block_size).take(num_blocks) {
            let h = chain.hash(parent, chunk);
            hashes.push(h);
            parent = Some(h);
        }
        hashes
    }

    /// The longest hit of at most `max_blocks` blocks over `tokens` that every group can serve
    /// (read-only). `hash_blocks` full blocks are hashed (at least `max_blocks`).
    pub(super) fn find_hit(
        &self,
        tokens: &[TokenId],
        extra_key: Option<&[u8]>,
        max_blocks: usize,
        hash_blocks: usize,
    ) -> Hit {
        let hashes = self.chain_hashes(tokens, extra_key, hash_blocks);
        let cache = self.cache.as_ref().expect("hits imply a prefix cache");
        let bs = self.block_size;
        let lookup = |g: usize, i: usize| {
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            cache.lookup(
                g as u32,
                hashes[i],
                parent,
                &tokens[i * bs..(i + 1) * bs],
                extra_key,
            )
        };
        let num_blocks = hybrid_hit(&self.specs, max_blocks.min(hashes.len()), bs, |g, i| {
            lookup(g, i).is_some()
        });
        let hit_tokens = num_blocks * bs;
        let blocks = (0..self.num_groups())
            .map(|g| {
                let skip = skipped_blocks(self.specs[g], hit_tokens, bs);
                (0..num_blocks)
                    .map(|i| {
                        if i < skip {
                            NULL_BLOCK
                        } else {
                            lookup(g, i).expect("the coordinator checked every needed block")
                        }
                    })
                    .collect()
            })
            .collect();
        Hit {
            num_blocks,
            hashes,
            blocks,
        }
    }

    /// See [`crate::KvCacheManager::match_prefix`].
    #[cold]
    pub(crate) fn match_prefix(
        &self,
        tokens: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Result<usize> {
        if self.cache.is_none() {
            return Ok(0);
        }
        let max = tokens.len().saturating_sub(1) / self.block_size;
        Ok(self.find_hit(tokens, extra_key, max, max).num_blocks * self.block_size)
    }

    /// Blocks one group's table needs for `num_tokens`, or InvalidArgument when the groups'
    /// tables together could never fit the pool.
    fn blocks_fitting(&self, num_tokens: usize) -> Result<usize> {
        let per_group = num_tokens.div_ceil(self.block_size);
        let total = per_group.checked_mul(self.num_groups());
        if total.map_or(true, |t| t > self.pool.num_blocks()) {
            return invalid(format!(
                "{num_tokens} tokens need {per_group} blocks in each of {} kv_groups, more than \
                 the pool's {} blocks of {} tokens",
                self.num_groups(),
                self.pool.num_blocks(),
                self.block_size
            ));
        }
        Ok(per_group)
    }

    /// Admits a sequence (see [`crate::KvCacheManager::add_sequence_scheduled`]); `tokens`
    /// `None` admits `num_tokens` unknown tokens (never prefix-cached).
    #[cold]
    pub(crate) fn add_sequence(
        &mut self,
        seq_id: SeqId,
        tokens: Option<&[TokenId]>,
        num_tokens: usize,
        extra_key: Option<&[u8]>,
        num_scheduled: usize,
    ) -> Result<usize> {
        if self.seqs.contains_key(&seq_id) {
            return Err(Error::SequenceExists(seq_id));
        }
        let per_group = self.blocks_fitting(num_tokens)?;
        let bs = self.block_size;
        let caching = self.cache.is_some() && tokens.is_some();
        let hit = match tokens {
            Some(t) if caching => {
                let max = t.len().saturating_sub(1) / bs;
                self.find_hit(t, extra_key, max, t.len() / bs)
            }
            _ => Hit {
                num_blocks: 0,
                hashes: Vec::new(),
                blocks: vec![Vec::new(); self.num_groups()],
            },
        };
        // Plan: fresh blocks in every group, plus the cached hits revived from the LRU.
        let fresh = (per_group - hit.num_blocks) * self.num_groups();
        let revived = match self.cache.as_ref() {
            Some(c) => hit
                .blocks
                .iter()
                .flatten()
                .filter(|&&b| b != NULL_BLOCK && c.lru.contains(b))
                .count(),
            None => 0,
        };
        self.check_available(fresh, revived)?;
        let mut new_blocks = Vec::with_capacity(fresh);
        let from_cache = self.reserve_fresh(fresh, revived, &mut new_blocks)?;
        // Commit (infallible from here): take the hits first, so the eviction cannot take them.
        for &b in hit.blocks.iter().flatten() {
            if b != NULL_BLOCK {
                self.take_hit(b);
            }
        }
        self.complete_fresh(fresh, from_cache, &mut new_blocks);
        let mut fresh_iter = new_blocks.into_iter();
        let tables = hit
            .blocks
            .into_iter()
            .map(|mut block_ids| {
                block_ids.extend(fresh_iter.by_ref().take(per_group - hit.num_blocks));
                BlockTable {
                    block_ids,
                    num_tokens,
                }
            })
            .collect();
        let hit_tokens = hit.num_blocks * bs;
        let mut hashes = hit.hashes;
        hashes.truncate(hit.num_blocks);
        if let Some(c) = self.cache.as_mut() {
            if caching {
                c.query_tokens += num_tokens as u64;
                c.hit_tokens += hit_tokens as u64;
            }
        }
        self.seqs.insert(
            seq_id,
            HybridSeq {
                tables,
                swapped: false,
                num_computed: hit_tokens + num_scheduled.min(num_tokens - hit_tokens),
                tokens: if caching {
                    tokens.map(<[TokenId]>::to_vec)
                } else {
                    None
                },
                extra_key: extra_key.map(Arc::from),
                hashes,
            },
        );
        self.index_computed(seq_id);
        Ok(hit_tokens)
    }
}
