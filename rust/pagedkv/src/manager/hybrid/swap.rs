//! The host swap tier of a hybrid manager: only live entries move; released positions stay
//! null on the host and when they come back.

use super::Hybrid;
use crate::error::{invalid, Error, Result};
use crate::manager::check_distinct;
use crate::manager::groups::NULL_BLOCK;
use crate::manager::swap_plan::{allocate_host, distinct_blocks, id_map};
use crate::{BlockId, SeqId};

impl Hybrid {
    /// Distinct live blocks of the sequences' tables (first-seen order) and how many of
    /// their entries reference each; released (null) positions do not move.
    fn distinct_blocks(&self, seq_ids: &[SeqId]) -> (Vec<BlockId>, Vec<u32>) {
        distinct_blocks(seq_ids.iter().flat_map(|id| {
            self.seqs[id]
                .tables
                .iter()
                .flat_map(|t| t.block_ids.iter().copied())
                .filter(|&b| b != NULL_BLOCK)
        }))
    }

    /// See [`crate::KvCacheManager::swap_out`].
    pub(crate) fn swap_out(&mut self, seq_ids: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        if self.host.is_none() {
            return invalid("swap_out needs a host tier (num_host_blocks > 0)");
        }
        check_distinct(seq_ids)?;
        for &id in seq_ids {
            self.resident(id)?;
        }
        let (blocks, refs) = self.distinct_blocks(seq_ids);
        let host_ids = allocate_host(self.host.as_mut().expect("checked"), &blocks, &refs)?;
        // Commit (infallible from here).
        let to_host = id_map(&blocks, &host_ids);
        for &id in seq_ids {
            let seq = self.seqs.get_mut(&id).expect("validated");
            seq.swapped = true;
            let device: Vec<Vec<BlockId>> = seq
                .tables
                .iter_mut()
                .map(|t| {
                    let d = std::mem::take(&mut t.block_ids);
                    t.block_ids = d
                        .iter()
                        .map(|b| *to_host.get(b).unwrap_or(&NULL_BLOCK))
                        .collect();
                    d
                })
                .collect();
            self.num_swapped += 1;
            for d in &device {
                self.release_all(d);
            }
        }
        self.counters.blocks_swapped_out += blocks.len() as u64;
        Ok(blocks.into_iter().zip(host_ids).collect())
    }

    /// See [`crate::KvCacheManager::swap_in`].
    pub(crate) fn swap_in(&mut self, seq_ids: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        if self.host.is_none() {
            return invalid("swap_in needs a host tier (num_host_blocks > 0)");
        }
        check_distinct(seq_ids)?;
        for &id in seq_ids {
            match self.seqs.get(&id) {
                None => return Err(Error::UnknownSequence(id)),
                Some(s) if !s.swapped => {
                    return invalid(format!("sequence {id} is not swapped out"));
                }
                Some(_) => {}
            }
        }
        let (host_blocks, refs) = self.distinct_blocks(seq_ids);
        let mut device = Vec::with_capacity(host_blocks.len());
        self.allocate_fresh(host_blocks.len(), &mut device)?;
        // Commit (infallible from here).
        for (&d, &r) in device.iter().zip(&refs) {
            for _ in 1..r {
                self.share(d);
            }
        }
        let to_device = id_map(&host_blocks, &device);
        let host = self.host.as_mut().expect("swapped implies a host tier");
        for &id in seq_ids {
            let seq = self.seqs.get_mut(&id).expect("validated");
            seq.swapped = false;
            for t in &mut seq.tables {
                for b in &mut t.block_ids {
                    let h = *b;
                    if h != NULL_BLOCK {
                        host.release(h);
                        *b = to_device[&h];
                    }
                }
            }
            self.num_swapped -= 1;
        }
        self.counters.blocks_swapped_in += host_blocks.len() as u64;
        Ok(host_blocks.into_iter().zip(device).collect())
    }

    /// See [`crate::KvCacheManager::is_swapped_out`].
    pub(crate) fn is_swapped_out(&self, seq_id: SeqId) -> Result<bool> {
        self.seqs
            .get(&seq_id)
            .map(|s| s.swapped)
            .ok_or(Error::UnknownSequence(seq_id))
    }

    /// See [`crate::KvCacheManager::host_block_table`] (group `group`).
    pub(crate) fn host_block_table(&self, seq_id: SeqId, group: usize) -> Result<&[BlockId]> {
        self.check_group(group)?;
        match self.seqs.get(&seq_id) {
            None => Err(Error::UnknownSequence(seq_id)),
            Some(s) if !s.swapped => invalid(format!("sequence {seq_id} is not swapped out")),
            Some(s) => Ok(&s.tables[group].block_ids),
        }
    }

    pub(crate) fn host(&self) -> Option<&crate::host::HostTier> {
        self.host.as_ref()
    }
}
