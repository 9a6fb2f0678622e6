//! The host swap tier: `swap_out` / `swap_in` of a sequence or fork group, and host queries.

use super::checks::check_distinct;
use super::group_spec::NULL_BLOCK;
use super::state::KvCacheManager;
use super::swap_plan::{allocate_host, distinct_blocks, id_map};
use crate::error::{invalid, Error, Result};
use crate::host::HostTier;
use crate::{BlockId, SeqId};

impl KvCacheManager {
    /// Moves the sequences `seq_ids` (one sequence or a fork group) to the host tier: each
    /// distinct device block of the group gets one host block (a block shared inside the group
    /// is copied once and stays shared on the host), and the group's device references are
    /// dropped. Returns the copies to run, `(device_block, host_block)`, before any of those
    /// device blocks is written again (run pending [`KvCacheManager::take_copy_ops`] first).
    ///
    /// Swapping out part of a group that shares blocks is supported: a block also referenced
    /// by sequences left on the device is copied to the host and keeps its device copy for
    /// them. All or nothing: too few free host blocks is [`Error::OutOfBlocks`] with
    /// `tier: Host`, and nothing moves.
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig, Tier};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 4, num_host_blocks: 8, ..Default::default()
    /// })?;
    /// kv.add_sequence_len(1, 6)?;            // device blocks [0, 1]
    /// kv.fork(1, 2)?;
    /// kv.append_len(2, 1)?;                  // 2 = [0, 2] after copy-on-write of block 1
    /// kv.take_copy_ops();
    /// let copies = kv.swap_out(&[1, 2])?;    // block 0 copied once
    /// assert_eq!(copies, vec![(0, 0), (1, 1), (2, 2)]);
    /// assert_eq!(kv.num_available_blocks(), 8);
    /// assert_eq!(kv.append_len(1, 1), Err(Error::SequenceSwappedOut(1)));
    /// let back = kv.swap_in(&[1, 2])?;       // (host_block, device_block)
    /// assert_eq!(back.len(), 3);
    /// assert_eq!(kv.block_table(1)?[0], kv.block_table(2)?[0]);   // shared again
    /// kv.check_invariants()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn swap_out(&mut self, seq_ids: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        if self.host.is_none() {
            return invalid("swap_out needs a host tier (num_host_blocks > 0)");
        }
        check_distinct(seq_ids)?;
        for &id in seq_ids {
            self.resident(id)?;
        }
        let (blocks, refs) = self.group_blocks(seq_ids);
        let host_ids = allocate_host(self.host.as_mut().expect("checked"), &blocks, &refs)?;
        // Commit (infallible from here).
        let to_host = id_map(&blocks, &host_ids);
        for &id in seq_ids {
            let seq = self.seqs.get_mut(&id).expect("validated");
            let mut device: Vec<Vec<BlockId>> = Vec::with_capacity(seq.groups.len() + 1);
            for g in 0..seq.groups.len() + 1 {
                let table = seq.group_table_mut(g);
                let d = std::mem::take(table);
                *table = d
                    .iter()
                    .map(|b| *to_host.get(b).unwrap_or(&NULL_BLOCK))
                    .collect();
                device.push(d);
            }
            seq.swapped = true;
            self.num_swapped += 1;
            for d in &device {
                self.release_table_each(d);
            }
        }
        self.counters.blocks_swapped_out += blocks.len() as u64;
        Ok(blocks.into_iter().zip(host_ids).collect())
    }

    /// Moves swapped-out sequences back onto free device blocks (evicting cached blocks if
    /// needed). Returns the copies to run, `(host_block, device_block)`. A host block shared by
    /// several of `seq_ids` becomes one shared device block. All or nothing: too few device
    /// blocks is [`Error::OutOfBlocks`] with `tier: Device`. Blocks brought back are not
    /// re-entered in the prefix index (their cached twins may still be there).
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 2, block_size: 4, num_host_blocks: 2, ..Default::default()
    /// })?;
    /// kv.add_sequence_len(1, 8)?;
    /// kv.swap_out(&[1])?;
    /// kv.add_sequence_len(2, 4)?;            // takes a device block meanwhile
    /// assert!(matches!(kv.swap_in(&[1]), Err(Error::OutOfBlocks { .. })));
    /// assert!(kv.is_swapped_out(1)?);        // nothing moved
    /// kv.free(2)?;
    /// assert_eq!(kv.swap_in(&[1])?, vec![(0, 0), (1, 1)]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn swap_in(&mut self, seq_ids: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        if self.host.is_none() {
            return invalid("swap_in needs a host tier (num_host_blocks > 0)");
        }
        check_distinct(seq_ids)?;
        for &id in seq_ids {
            let seq = self.seqs.get(&id).ok_or(Error::UnknownSequence(id))?;
            if !seq.swapped {
                return invalid(format!("sequence {id} is not swapped out"));
            }
        }
        let (host_blocks, refs) = self.group_blocks(seq_ids);
        if host_blocks.len() > self.pool.num_blocks() {
            return invalid(format!(
                "the group holds {} distinct blocks, more than the pool's {}",
                host_blocks.len(),
                self.pool.num_blocks()
            ));
        }
        let mut device_ids = Vec::with_capacity(host_blocks.len());
        self.allocate_fresh(host_blocks.len(), &mut device_ids)?;
        // Commit (infallible from here).
        for (&d, &r) in device_ids.iter().zip(&refs) {
            for _ in 1..r {
                let _ = self.pool.retain_id(d);
            }
        }
        let to_device = id_map(&host_blocks, &device_ids);
        let host = self.host.as_mut().expect("checked");
        for &id in seq_ids {
            let seq = self.seqs.get_mut(&id).expect("validated");
            for g in 0..seq.groups.len() + 1 {
                for h in seq.group_table_mut(g).iter_mut() {
                    if *h != NULL_BLOCK {
                        host.release(*h);
                        *h = to_device[h];
                    }
                }
            }
            seq.swapped = false;
            self.num_swapped -= 1;
        }
        for &id in seq_ids {
            let positions = self.seqs[&id].num_positions();
            self.note_placed_all(id, 0..positions, false);
        }
        self.counters.blocks_swapped_in += host_blocks.len() as u64;
        Ok(host_blocks.into_iter().zip(device_ids).collect())
    }

    /// Whether a sequence is swapped out to the host tier.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_host_blocks: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 3)?;
    /// assert!(!kv.is_swapped_out(1)?);
    /// assert!(kv.is_swapped_out(2).is_err());
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn is_swapped_out(&self, seq_id: SeqId) -> Result<bool> {
        Ok(self
            .seqs
            .get(&seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?
            .swapped)
    }

    /// Free host blocks (0 without a host tier).
    pub fn num_free_host_blocks(&self) -> usize {
        self.host_tier().map_or(0, HostTier::num_free)
    }

    /// Host blocks in the tier (0 without a host tier).
    pub fn num_host_blocks(&self) -> usize {
        self.host_tier().map_or(0, HostTier::num_blocks)
    }

    /// The refcount of a host block.
    pub fn host_refcount(&self, host_block_id: BlockId) -> Result<u32> {
        self.host_tier()
            .and_then(|h| h.refcount(host_block_id))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("host block id {host_block_id} out of range"))
            })
    }

    /// The host block ids of a swapped-out sequence, in logical order.
    pub fn host_block_table(&self, seq_id: SeqId) -> Result<&[BlockId]> {
        self.host_block_table_group(seq_id, 0)
    }

    /// [`Self::host_block_table`] of group `group` ([`NULL_BLOCK`] at released positions).
    pub fn host_block_table_group(&self, seq_id: SeqId, group: usize) -> Result<&[BlockId]> {
        self.check_group(group)?;
        let seq = self
            .seqs
            .get(&seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?;
        if !seq.swapped {
            return invalid(format!("sequence {seq_id} is not swapped out"));
        }
        Ok(seq.group_table(group))
    }

    /// Distinct blocks of the group's tables in first-appearance order, with how many of the
    /// group's table entries point at each.
    fn group_blocks(&self, seq_ids: &[SeqId]) -> (Vec<BlockId>, Vec<u32>) {
        distinct_blocks(seq_ids.iter().flat_map(|id| {
            let seq = &self.seqs[id];
            (0..seq.groups.len() + 1)
                .flat_map(move |g| seq.group_table(g).iter().copied())
                .filter(|&b| b != NULL_BLOCK)
        }))
    }
}
