//! The host (CPU) block tier: where swapped-out sequences' blocks live until swap-in.
//!
//! Host blocks are refcounted like device blocks, so a block shared by a fork group is copied
//! to the host once and stays shared there. The tier belongs to one manager and is only touched
//! through `&mut KvCacheManager`, so plain integers suffice (no atomics).

use crate::error::{Error, Result, Tier};
use crate::pool::validate_geometry;
use crate::types::BlockId;

#[derive(Debug, Clone)]
pub(crate) struct HostTier {
    /// Per host block: references from swapped-out sequences' tables (0: free).
    refcounts: Vec<u32>,
    /// Free host blocks (a stack; each refcount-0 block exactly once).
    free: Vec<BlockId>,
}

impl HostTier {
    pub(crate) fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        validate_geometry(num_blocks, block_size, "num_host_blocks")?;
        Ok(HostTier {
            refcounts: vec![0; num_blocks],
            // Reversed so host block 0 is handed out first.
            free: (0..num_blocks as BlockId).rev().collect(),
        })
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.refcounts.len()
    }

    pub(crate) fn num_free(&self) -> usize {
        self.free.len()
    }

    pub(crate) fn num_in_use(&self) -> usize {
        self.refcounts.len() - self.free.len()
    }

    /// Takes `n` free host blocks with the given initial refcounts (all or nothing).
    pub(crate) fn allocate(&mut self, refs: &[u32]) -> Result<Vec<BlockId>> {
        let n = refs.len();
        if n > self.free.len() {
            return Err(Error::OutOfBlocks {
                tier: Tier::Host,
                needed_blocks: n,
                available_blocks: self.free.len(),
            });
        }
        let out: Vec<BlockId> = self.free.drain(self.free.len() - n..).rev().collect();
        for (&h, &r) in out.iter().zip(refs) {
            debug_assert!(self.refcounts[h as usize] == 0 && r > 0);
            self.refcounts[h as usize] = r;
        }
        Ok(out)
    }

    /// Drops one reference; at 0 the host block is free again.
    pub(crate) fn release(&mut self, h: BlockId) {
        let rc = &mut self.refcounts[h as usize];
        debug_assert!(*rc > 0, "host block {h} released while free");
        *rc -= 1;
        if *rc == 0 {
            self.free.push(h);
        }
    }

    pub(crate) fn refcount(&self, h: BlockId) -> Option<u32> {
        self.refcounts.get(h as usize).copied()
    }

    /// The free stack holds exactly the refcount-0 blocks, once each.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let mut seen = vec![false; self.refcounts.len()];
        for &h in &self.free {
            let i = h as usize;
            if i >= seen.len() || seen[i] {
                return Err(format!("host block {h} out of range or free twice"));
            }
            seen[i] = true;
            if self.refcounts[i] != 0 {
                return Err(format!(
                    "free host block {h} has refcount {}",
                    self.refcounts[i]
                ));
            }
        }
        let zero = self.refcounts.iter().filter(|&&r| r == 0).count();
        if zero != self.free.len() {
            return Err(format!(
                "{zero} host blocks have refcount 0 but {} are free",
                self.free.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_all_or_nothing() {
        let mut h = HostTier::new(3, 4).unwrap();
        assert_eq!(h.allocate(&[1, 2]).unwrap(), vec![0, 1]);
        assert!(matches!(
            h.allocate(&[1, 1]),
            Err(Error::OutOfBlocks {
                tier: Tier::Host,
                ..
            })
        ));
        assert_eq!(h.num_free(), 1);
        h.release(1);
        assert_eq!(h.num_free(), 1);
        h.release(1);
        assert_eq!(h.num_free(), 2);
        h.check().unwrap();
    }
}
