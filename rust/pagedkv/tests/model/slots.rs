//! The per-chunk calls on a running sequence in the reference model (docs/design.md, Per-chunk
//! allocation): vLLM's `allocate_slots`, `provide_token_ids` (ids and hashes given later), and
//! the computed-watermark check both make.

use std::collections::BTreeSet;

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
        let copies = self.copied_positions(s, c, end, num_tokens, positions);
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

    /// The copy-on-write rule of `allocate_slots`, stated from what it must mean rather than
    /// how the manager computes it. Token `t` lives in slot `t % bs` of position `t / bs`.
    /// A position of an existing table (below `s.len()`) is *written* when:
    ///
    /// * this chunk writes one of its slots: a token in `[c, end)`; or
    /// * a later append will write one of its slots without checking it: the slots past the
    ///   `num_tokens` declared tokens are written by appends, and an append checks only the
    ///   block holding the last declared token, so once any of those slots lies in another
    ///   block, every position holding one must already be safe to write.
    ///
    /// A written position's block is copied when writing it in place would change content
    /// someone else reads: another table entry or a pin points at it, or the prefix index
    /// names its content. Per group, in ascending position order (the order fresh blocks are
    /// handed out).
    fn copied_positions(
        &self,
        s: &MSeq,
        c: usize,
        end: usize,
        num_tokens: usize,
        positions: usize,
    ) -> Vec<Vec<usize>> {
        let bs = self.block_size;
        let existing = s.len();
        let mut written: BTreeSet<usize> = (c..end).map(|t| t / bs).collect();
        let later: BTreeSet<usize> = (num_tokens..positions * bs).map(|t| t / bs).collect();
        let checked_by_append = (num_tokens % bs != 0).then_some(num_tokens / bs);
        if later.iter().any(|&i| Some(i) != checked_by_append) {
            written.extend(later);
        }
        (0..self.ng())
            .map(|g| {
                written
                    .iter()
                    .copied()
                    .filter(|&i| i < existing)
                    .filter(|&i| s.tables[g][i].is_some_and(|b| !self.private(b)))
                    .collect()
            })
            .collect()
    }

    /// Whether block `b` (on the device) is read by nothing but the one table entry holding
    /// it: counted from the resident tables and the pins, not from the refcounts, and not
    /// indexed.
    fn private(&self, b: u64) -> bool {
        let entries: usize = self
            .seqs
            .values()
            .filter(|s| !s.swapped)
            .flat_map(|s| s.tables.iter().flatten())
            .filter(|&&e| e == Some(b))
            .count();
        let pins = self.pin_counts.get(&b).map_or(0, |&n| n as usize);
        entries + pins == 1 && !self.key_of.contains_key(&b)
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
