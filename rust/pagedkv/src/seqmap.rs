//! Live sequences by caller id: dense rows behind an id -> row index. ("Row", not "slot":
//! in this crate a slot is always a KV token slot.)
//!
//! A batch call (one engine step over B sequences) validates every id before it changes
//! anything, then applies its changes: with a plain hash map that is two lookups per sequence
//! plus a hash set to reject duplicate ids. Here the validation pass resolves each id to its
//! row once, the apply pass indexes the rows directly, and duplicates are caught by
//! stamping each visited row with the batch's generation number (no set to build or clear).
//! Removal moves the last row into the hole (`swap_remove`), so the array stays dense.

use std::ops::Index;

use rustc_hash::FxHashMap;

use crate::types::SeqId;

/// Values keyed by [`SeqId`], with stable-until-removal dense rows.
///
/// Invariants: `ids`, `values` and `marks` have equal length; `index[ids[r]] == r` for every
/// row `r`, and `index` has no other entries.
#[derive(Debug, Clone)]
pub(crate) struct SeqMap<V> {
    /// Caller id -> row.
    index: FxHashMap<SeqId, usize>,
    /// Per row: its caller id.
    ids: Vec<SeqId>,
    /// Per row: its value.
    values: Vec<V>,
    /// Per row: the generation of the last batch that visited it (see [`SeqMap::mark`]).
    marks: Vec<u64>,
    /// The current batch generation; starts at 0 and only grows, so a fresh row (mark 0) is
    /// never taken as visited by a batch (generations start at 1).
    generation: u64,
}

impl<V> Default for SeqMap<V> {
    fn default() -> Self {
        SeqMap {
            index: FxHashMap::default(),
            ids: Vec::new(),
            values: Vec::new(),
            marks: Vec::new(),
            generation: 0,
        }
    }
}

impl<V> SeqMap<V> {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.values.len()
    }

    #[inline]
    pub(crate) fn contains_key(&self, id: &SeqId) -> bool {
        self.index.contains_key(id)
    }

    /// The row of `id`, valid until the next insert or remove.
    #[inline]
    pub(crate) fn row(&self, id: SeqId) -> Option<usize> {
        self.index.get(&id).copied()
    }

    #[inline]
    pub(crate) fn get(&self, id: &SeqId) -> Option<&V> {
        self.row(*id).map(|r| &self.values[r])
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, id: &SeqId) -> Option<&mut V> {
        self.row(*id).map(|r| &mut self.values[r])
    }

    #[inline]
    pub(crate) fn at(&self, row: usize) -> &V {
        &self.values[row]
    }

    #[inline]
    pub(crate) fn at_mut(&mut self, row: usize) -> &mut V {
        &mut self.values[row]
    }

    /// Inserts or replaces; returns the replaced value.
    #[inline]
    pub(crate) fn insert(&mut self, id: SeqId, value: V) -> Option<V> {
        match self.index.get(&id) {
            Some(&s) => Some(std::mem::replace(&mut self.values[s], value)),
            None => {
                self.index.insert(id, self.values.len());
                self.ids.push(id);
                self.values.push(value);
                self.marks.push(0);
                None
            }
        }
    }

    #[inline]
    pub(crate) fn remove(&mut self, id: &SeqId) -> Option<V> {
        let s = self.index.remove(id)?;
        self.ids.swap_remove(s);
        self.marks.swap_remove(s);
        let value = self.values.swap_remove(s);
        if let Some(&moved) = self.ids.get(s) {
            self.index.insert(moved, s);
        }
        Some(value)
    }

    /// The id of the sequence in `row`.
    #[inline]
    pub(crate) fn id_at(&self, row: usize) -> SeqId {
        self.ids[row]
    }

    /// Ids in row order (arbitrary from the caller's point of view).
    pub(crate) fn keys(&self) -> std::slice::Iter<'_, SeqId> {
        self.ids.iter()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&SeqId, &V)> {
        self.ids.iter().zip(&self.values)
    }

    /// Starts a batch: rows marked from now on are told apart from earlier batches' marks.
    #[inline]
    pub(crate) fn begin_batch(&mut self) {
        self.generation += 1;
    }

    /// Marks `row` as visited by the current batch; false if it already was (a duplicate id).
    #[inline]
    pub(crate) fn mark(&mut self, row: usize) -> bool {
        let mark = &mut self.marks[row];
        let fresh = *mark != self.generation;
        *mark = self.generation;
        fresh
    }
}

impl<V> Index<&SeqId> for SeqMap<V> {
    type Output = V;

    /// Panics when `id` is absent: callers index only ids they validated.
    #[inline]
    fn index(&self, id: &SeqId) -> &V {
        self.get(id).expect("validated sequence id")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<V>(m: &SeqMap<V>) {
        assert_eq!(m.ids.len(), m.values.len());
        assert_eq!(m.ids.len(), m.marks.len());
        assert_eq!(m.index.len(), m.ids.len());
        for (r, id) in m.ids.iter().enumerate() {
            assert_eq!(m.index[id], r);
        }
    }

    #[test]
    fn insert_remove_keeps_rows_dense_and_indexed() {
        let mut m = SeqMap::default();
        for id in [10u64, 20, 30, 40] {
            assert_eq!(m.insert(id, id * 2), None);
        }
        assert_eq!(m.insert(20, 99), Some(40));
        assert_eq!(m.remove(&10), Some(20)); // row 0 now holds 40
        assert_eq!(m.remove(&10), None);
        check(&m);
        assert_eq!(m.len(), 3);
        assert_eq!(m[&40], 80);
        assert_eq!(m.get(&20), Some(&99));
        assert_eq!(m.remove(&30), Some(60)); // the last row: nothing moves
        check(&m);
        let mut keys: Vec<u64> = m.keys().copied().collect();
        keys.sort_unstable();
        assert_eq!(keys, vec![20, 40]);
        assert!(!m.contains_key(&30));
    }

    #[test]
    fn marks_detect_repeats_within_a_batch_only() {
        let mut m = SeqMap::default();
        m.insert(1u64, ());
        m.insert(2u64, ());
        let (a, b) = (m.row(1).unwrap(), m.row(2).unwrap());
        m.begin_batch();
        assert!(m.mark(a));
        assert!(m.mark(b));
        assert!(!m.mark(a));
        m.begin_batch();
        assert!(m.mark(a)); // a new batch forgets the old marks
        m.remove(&1);
        m.insert(3u64, ()); // a new row starts unmarked
        let c = m.row(3).unwrap();
        assert!(m.mark(c));
        check(&m);
    }
}
