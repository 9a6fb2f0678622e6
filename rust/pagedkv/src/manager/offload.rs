//! The manager's side of the host offload tier (`ManagerConfig::num_offload_blocks`,
//! [`crate::offload_tier`]): hits that continue the device chain in the tier, the load and
//! offload ops the caller runs, and the prompt's chained block hashes for lower tiers kept by
//! the caller (docs/offload.md).

use super::admission::HitWalk;
use super::state::KvCacheManager;
use crate::error::{invalid, Result};
use crate::prefix::hash::{BlockHash, BlockHasher, ChainHasher};
use crate::{BlockId, TokenId};

impl KvCacheManager {
    /// Continues a prompt's hit chain in the offload tier after its `num_device` device hits:
    /// appends the host blocks holding its next blocks (verified like device hits) to `out`,
    /// hashing each block as needed into `block_hashes` (which then holds the hash of every
    /// hit, plus that of the block a lookup missed). Read-only.
    pub(super) fn host_hits(
        &self,
        walk: &HitWalk<'_>,
        chain: &mut ChainHasher,
        block_hashes: &mut Vec<BlockHash>,
        num_device: usize,
        out: &mut Vec<BlockId>,
    ) {
        let Some(tier) = self.offload.as_ref() else {
            return;
        };
        let bs = walk.block_size;
        for i in num_device..walk.max_blocks {
            let parent = i.checked_sub(1).map(|p| block_hashes[p]);
            let chunk = &walk.token_ids[i * bs..(i + 1) * bs];
            if block_hashes.len() == i {
                block_hashes.push(chain.hash(parent, chunk));
            }
            match tier.lookup(block_hashes[i], parent, chunk, walk.extra_key) {
                Some(h) => out.push(h),
                None => break,
            }
        }
    }

    /// Pins the host hits of an admission for their loads (see [`Self::record_loads`]).
    pub(super) fn pin_host_hits(&mut self, host_hits: &[BlockId]) {
        if let Some(tier) = self.offload.as_mut() {
            for &h in host_hits {
                tier.pin(h);
            }
        }
    }

    /// Records the loads of pinned `host_hits` into `device_blocks`, pairwise.
    pub(super) fn record_loads(&mut self, host_hits: &[BlockId], device_blocks: &[BlockId]) {
        debug_assert_eq!(host_hits.len(), device_blocks.len());
        if let Some(tier) = self.offload.as_mut() {
            for (&h, &d) in host_hits.iter().zip(device_blocks) {
                tier.record_load(h, d);
            }
        }
    }

    /// Compacts the pending loads once they pass their threshold (`offload_tier.rs`, "Bounded
    /// queues"): a load survives only into a device block this manager still holds, in a
    /// resident table or its prefix index. Called once an admission's sequence is in place.
    pub(super) fn bound_pending_loads(&mut self) {
        if !self
            .offload
            .as_ref()
            .is_some_and(|t| t.loads_need_compaction())
        {
            return;
        }
        let mut held = vec![false; self.pool.num_blocks()];
        for (_, seq) in self.seqs.iter() {
            if !seq.swapped {
                for &b in &seq.table.block_ids {
                    held[b as usize] = true;
                }
            }
        }
        if let Some(prefix) = &self.prefix {
            for (b, slot) in held.iter_mut().enumerate() {
                *slot = *slot || prefix.is_indexed(b as BlockId);
            }
        }
        if let Some(tier) = self.offload.as_mut() {
            tier.compact_loads(held);
        }
    }

    /// Drains the offload ops recorded since the last call, oldest first: `(device_block,
    /// host_block)` copies of evicted prefix blocks into the host offload tier. Run them, in
    /// order, before anything else the step does to device memory (copy, swap and load ops,
    /// the forward pass): each reads a device block that a fresh owner overwrites next. Empty
    /// without an offload tier.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 2, block_size: 2, enable_prefix_caching: true, num_offload_blocks: 4,
    ///     ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3], None)?;   // block 0 holds [1, 2] (indexed)
    /// kv.free(1)?;                              // cached
    /// kv.add_sequence(2, &[7, 8, 9, 10], None)?; // needs both device blocks: evicts block 0
    /// assert_eq!(kv.take_offload_ops(), vec![(0, 0)]);   // device 0 -> host 0
    /// kv.free(2)?;
    /// assert_eq!(kv.add_sequence(3, &[1, 2, 5], None)?, 2);   // a hit from the host tier
    /// let loads = kv.take_load_ops();                          // host 0 -> a fresh device block
    /// assert_eq!(loads.len(), 1);
    /// assert_eq!(loads[0].0, 0);
    /// assert_eq!(loads[0].1, kv.block_table(3)?[0]);
    /// kv.check_invariants()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn take_offload_ops(&mut self) -> Vec<(BlockId, BlockId)> {
        self.offload
            .as_mut()
            .map_or_else(Vec::new, |t| t.take_offload_ops())
    }

    /// Drains the load ops recorded since the last call, oldest first: `(host_block,
    /// device_block)` copies of offload-tier hits into the fresh device blocks admission gave
    /// them. Run them after the offload ops of the same point and before the forward pass: the
    /// admitted tokens count as computed. The host blocks they read stay reserved until this
    /// call hands them over. Empty without an offload tier.
    pub fn take_load_ops(&mut self) -> Vec<(BlockId, BlockId)> {
        self.offload
            .as_mut()
            .map_or_else(Vec::new, |t| t.take_load_ops())
    }

    /// The chained hash of the content host block `host_block` of the offload tier holds
    /// (`None`: it holds none). After running the ops of [`Self::take_offload_ops`] in order,
    /// this is the hash of what each op's host block holds, so a caller writing the tier
    /// through to a store keys each block with it. InvalidArgument when `host_block` is not a
    /// block of the tier (or there is no tier).
    pub fn offload_block_hash(&self, host_block: BlockId) -> Result<Option<BlockHash>> {
        let n = self.num_offload_blocks();
        if host_block as usize >= n {
            return invalid(format!(
                "host block {host_block} is not in the offload tier of {n} blocks"
            ));
        }
        Ok(self.offload.as_ref().and_then(|t| t.hash_of(host_block)))
    }

    /// Host blocks in the offload tier (0: none).
    pub fn num_offload_blocks(&self) -> usize {
        self.offload.as_ref().map_or(0, |t| t.num_blocks())
    }

    /// The chained hash of each full block of `token_ids` (`len / block_size` of them), as
    /// the prefix index keys them (seed `hash_seed`, `extra_key` mixed in): the keys of a
    /// store tier the caller keeps below this manager. Read-only; computed with the same
    /// hasher with or without prefix caching.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, KvEvent, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, enable_kv_events: true,
    ///     ..Default::default()
    /// })?;
    /// let hashes = kv.prefix_block_hashes(&[1, 2, 3, 4, 5], None);
    /// assert_eq!(hashes.len(), 2);
    /// kv.add_sequence(1, &[1, 2, 3, 4, 5], None)?;
    /// match &kv.take_events()[..] {
    ///     [KvEvent::BlockStored { block_hashes, .. }] => assert_eq!(block_hashes, &hashes),
    ///     other => panic!("{other:?}"),
    /// }
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn prefix_block_hashes(
        &self,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Vec<BlockHash> {
        let bs = self.block_size;
        let fallback;
        let hasher = match self.prefix.as_ref() {
            Some(p) => &p.hasher,
            None => {
                fallback = BlockHasher::new(self.config.hash_seed);
                &fallback
            }
        };
        let mut chain = hasher.chain(bs, extra_key);
        let mut out: Vec<BlockHash> = Vec::with_capacity(token_ids.len() / bs);
        for chunk in token_ids.chunks_exact(bs) {
            let parent = out.last().copied();
            out.push(chain.hash(parent, chunk));
        }
        out
    }
}
