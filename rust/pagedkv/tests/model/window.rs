//! Window release in the reference model: the positions a sliding-window group puts out of its
//! window as the watermark advances go back (refcount -1), leading run first, and the bounds
//! admission and batch growth check against that release (`policy.rs` says which positions).

use std::collections::HashMap;

use pagedkv::KvGroupSpec;

use crate::policy::{fresh_cap, skipped};
use crate::reference::{Kind, MBlock, Model};

impl Model {
    /// Blocks a sequence of `positions` positions holds over every group once the windows
    /// released what `processed` tokens put out of them: the "can never fit" bound.
    pub fn live(&self, positions: usize, processed: usize) -> usize {
        let bs = self.block_size;
        self.specs
            .iter()
            .map(|&spec| {
                let live = positions - skipped(spec, processed, bs).min(positions);
                fresh_cap(spec).map_or(live, |c| c.min(live))
            })
            .fold(0usize, usize::saturating_add)
    }

    /// Releases a window group's positions that `processed` tokens put out of its window.
    pub fn release_window(&mut self, id: u64, processed: usize) {
        let bs = self.block_size;
        for (g, &spec) in self.specs.clone().iter().enumerate() {
            let len = self.seqs[&id].len();
            let end = skipped(spec, processed, bs).min(len);
            for i in (0..end).rev() {
                let slot = &mut self.seqs.get_mut(&id).unwrap().tables[g][i];
                match slot.take() {
                    Some(b) => self.release(b),
                    // A state group's nulls are interior too: every position below `end`.
                    None if spec == KvGroupSpec::MambaState => {}
                    None => break,
                }
            }
        }
    }

    /// `release_skipped_blocks`: the window release at `processed` tokens, at most the
    /// sequence's computed ones.
    pub fn release_skipped(&mut self, id: u64, processed: usize) -> Result<(), Kind> {
        if processed > self.resident(id)?.computed {
            return Err(Kind::Invalid);
        }
        self.release_window(id, processed);
        Ok(())
    }

    /// Blocks the window releases of `ids` at their watermarks bring to refcount 0.
    pub fn freed_by_release(&self, ids: &[u64]) -> usize {
        let bs = self.block_size;
        let mut drops: HashMap<MBlock, u32> = HashMap::new();
        for id in ids {
            let s = &self.seqs[id];
            for (g, &spec) in self.specs.iter().enumerate() {
                let end = skipped(spec, s.computed, bs).min(s.len());
                for b in s.tables[g][..end].iter().rev() {
                    match b {
                        Some(b) => *drops.entry(*b).or_insert(0) += 1,
                        None if spec == KvGroupSpec::MambaState => {}
                        None => break,
                    }
                }
            }
        }
        drops
            .into_iter()
            .filter(|(b, n)| self.refcounts[b] == *n)
            .count()
    }
}
