//! The per-chunk calls on a running sequence in the reference model (docs/design.md, Per-chunk
//! allocation): vLLM's `allocate_slots`, `provide_token_ids` (ids and hashes given later), and
//! the computed-watermark check both make.

use std::collections::HashMap;

use pagedkv::KvGroupSpec;

use crate::policy::{fresh_for, grow, skipped, table_bound};
use crate::reference::{Kind, MSeq, Model};

impl Model {
    /// Tokens of `id` below the first indexed block past them (how far its watermark may roll
    /// back): the blocks its hashing state covers, and any indexed block of its tables (a fork
    /// shares blocks its parent indexes).
    fn indexed_prefix(&self, s: &MSeq) -> usize {
        let mut end = if s.tokens.is_some() {
            s.hashed * self.block_size
        } else {
            0
        };
        for t in &s.tables {
            for (i, b) in t.iter().enumerate() {
                if b.is_some_and(|b| self.key_of.contains_key(&b)) {
                    end = end.max((i + 1) * self.block_size);
                }
            }
        }
        end.min(s.computed)
    }

    /// vLLM's per-chunk `allocate_slots` (docs/design.md, Per-chunk allocation).
    pub fn allocate_slots(
        &mut self,
        id: u64,
        new: usize,
        lookahead: usize,
        in_flight: usize,
        caller_computed: Option<usize>,
    ) -> Result<bool, Kind> {
        let s = self.resident(id)?;
        let bs = self.block_size;
        let ng = self.ng();
        let ours = s.computed;
        let c = caller_computed.unwrap_or(ours);
        if self.specs.contains(&KvGroupSpec::MambaState) && (c < ours || lookahead > 0) {
            return Err(Kind::Invalid);
        }
        self.check_watermark(s, c)?;
        let len = s.len();
        let end = c
            .checked_add(new)
            .filter(|&e| e <= self.limits.max_model_len)
            .ok_or(Kind::Invalid)?;
        let target = end.saturating_add(lookahead).min(self.limits.max_model_len);
        let positions = target.div_ceil(bs).max(len);
        let live = self.live(positions, c.saturating_sub(in_flight));
        if live.max(table_bound(&self.specs, positions)) > self.num_blocks {
            return Err(Kind::Invalid);
        }
        let known = s.tokens.as_ref().map_or(0, Vec::len);
        let num_tokens = if c < ours {
            end.max(known)
        } else {
            s.num_tokens.max(end)
        };
        // With slots past the declared tokens, every block from the one holding the last token
        // on is copied when shared or indexed (appends check only their last block).
        let tail = if num_tokens.div_ceil(bs) < positions {
            num_tokens / bs..len
        } else {
            0..0
        };
        let mut released = HashMap::new();
        let copies: Vec<Vec<usize>> = (0..ng)
            .map(|g| {
                let written = if new == 0 {
                    0..0
                } else {
                    c / bs..end.div_ceil(bs).min(len)
                };
                let w = written.clone();
                let extra = tail.clone().filter(move |i| !w.contains(i));
                written
                    .chain(extra)
                    .filter(|&i| s.tables[g][i].is_some_and(|b| self.copy_needed(b, &mut released)))
                    .collect()
            })
            .collect();
        let fresh =
            fresh_for(&self.specs, len, positions) + copies.iter().map(Vec::len).sum::<usize>();
        self.release_window(id, c.saturating_sub(in_flight));
        if fresh > self.available() {
            return Ok(false);
        }
        let mut supply = self.alloc_fresh(fresh).into_iter();
        let mut s = self.seqs.remove(&id).unwrap();
        for (g, at) in copies.into_iter().enumerate() {
            for i in at {
                let dst = supply.next().unwrap();
                let src = s.tables[g][i].replace(dst).unwrap();
                self.pending_copies.push((src, dst));
                self.release(src);
            }
            grow(self.specs[g], &mut s.tables[g], positions, &mut supply);
        }
        s.num_tokens = num_tokens;
        s.computed = end;
        self.seqs.insert(id, s);
        self.register_ready(id);
        Ok(true)
    }

    /// A caller's watermark `c`: never past the sequence's, never below its indexed prefix,
    /// never where a window released a position its window at `c` reads.
    fn check_watermark(&self, s: &MSeq, c: usize) -> Result<(), Kind> {
        let ours = s.computed;
        if c > ours || c < self.indexed_prefix(s) {
            return Err(Kind::Invalid);
        }
        if c < ours {
            let len = s.len();
            for (g, &spec) in self.specs.iter().enumerate() {
                let from = skipped(spec, c, self.block_size).min(len);
                if s.tables[g][from..].contains(&None) {
                    return Err(Kind::Invalid);
                }
            }
        }
        Ok(())
    }

    /// `provide_token_ids`: ids of the tokens after the known ones, the watermark rolled back
    /// to `caller_computed` first when given.
    pub fn provide(
        &mut self,
        id: u64,
        ids: &[u32],
        caller_computed: Option<usize>,
    ) -> Result<(), Kind> {
        let s = self.resident(id)?;
        let c = caller_computed.unwrap_or(s.computed);
        self.check_watermark(s, c)?;
        let Some(t) = &s.tokens else {
            self.seqs.get_mut(&id).unwrap().computed = c;
            return Ok(());
        };
        let new_known = t.len() + ids.len();
        // Only new ids must fit the slots (a per-chunk admission knows its whole prompt).
        if !ids.is_empty() && new_known > s.len() * self.block_size {
            return Err(Kind::Invalid);
        }
        let s = self.seqs.get_mut(&id).unwrap();
        s.computed = c;
        s.num_tokens = s.num_tokens.max(new_known);
        s.tokens.as_mut().unwrap().extend_from_slice(ids);
        self.register_ready(id);
        Ok(())
    }
}
