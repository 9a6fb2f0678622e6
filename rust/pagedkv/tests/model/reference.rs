//! The reference model of `tests/model.rs`, parameterized by the KV-cache groups
//! (docs/design.md, KV groups and Per-chunk allocation): per sequence and group a table of
//! abstract blocks (`None` at a window's released positions), the declared tokens, the
//! computed watermark, the known token ids, refcounts, the prefix index keyed by (group,
//! extra key, full token prefix), the LRU of cached blocks, pins, and the host tier. Its hit
//! rule is the declarative one (the longest `L` every group serves). Every operation returns
//! the result (or the error) the manager must give.
//!
//! The group policies are plain functions in `policy.rs`; the hit rule and admission
//! (`admission.rs`), window release (`window.rs`), the host swap tier (`host.rs`) and the
//! per-chunk calls on a running sequence (`slots.rs`: `allocate_slots`, `provide`, their
//! watermark check) extend [`Model`] in files of their own.

use std::collections::{BTreeMap, HashMap};

use pagedkv::{Error, KvGroupSpec, Tier};

use crate::policy::{caches, fresh_cap, fresh_for, grow, skipped, table_bound, Limits};

pub type MBlock = u64;
/// (group, extra key, every token up to the block's end).
pub type Key = (usize, Option<u8>, Vec<u32>);
/// A pin's prompt: (extra key, its full blocks' tokens).
pub type PinKey = (Option<u8>, Vec<u32>);

#[derive(Debug, Clone)]
pub struct MSeq {
    pub num_tokens: usize,
    /// Per group: device model blocks while resident, host model blocks while swapped;
    /// `None` at released positions. Every group's table has the same length.
    pub tables: Vec<Vec<Option<MBlock>>>,
    pub swapped: bool,
    /// Known token ids from position 0, while caching is on and none is unknown.
    pub tokens: Option<Vec<u32>>,
    pub extra: Option<u8>,
    /// Tokens computed (the watermark).
    pub computed: usize,
    /// Full blocks offered to the index so far (`min(computed, known) / bs` while tracked).
    pub hashed: usize,
}

impl MSeq {
    pub fn len(&self) -> usize {
        self.tables[0].len()
    }
}

#[derive(Debug)]
pub struct Model {
    pub specs: Vec<KvGroupSpec>,
    /// Blocks sequences can use (the pool's, less a reserved null block).
    pub num_blocks: usize,
    pub block_size: usize,
    pub caching: bool,
    pub num_host: usize,
    pub limits: Limits,
    pub seqs: BTreeMap<u64, MSeq>,
    pub refcounts: HashMap<MBlock, u32>,
    /// Cached-evictable blocks, least recently used first.
    pub cached: Vec<MBlock>,
    /// The one block holding each indexed content (one copy per content: a block computing
    /// content indexed on a block in use stays private; one computing content indexed on a
    /// cached block replaces it, and the cached block goes back to the free pool).
    pub index: HashMap<Key, MBlock>,
    pub key_of: HashMap<MBlock, Key>,
    pub host_refs: HashMap<MBlock, u32>,
    pub next_block: MBlock,
    pub pending_copies: Vec<(MBlock, MBlock)>,
    pub evictions: u64,
    pub hit_tokens: u64,
    /// Pins by (extra key, the prompt's full-block tokens): the blocks each pin holds.
    pub pins: HashMap<PinKey, Vec<Vec<MBlock>>>,
    /// Pins per block (each holds a reference, counted in `refcounts`).
    pub pin_counts: HashMap<MBlock, u32>,
}

#[derive(Debug, PartialEq)]
pub enum Kind {
    Unknown(u64),
    Exists(u64),
    Swapped(u64),
    Invalid,
    Oob(Tier, usize, usize),
}

pub fn kind(e: &Error) -> Kind {
    match e {
        Error::UnknownSequence(i) => Kind::Unknown(*i),
        Error::SequenceExists(i) => Kind::Exists(*i),
        Error::SequenceSwappedOut(i) => Kind::Swapped(*i),
        Error::InvalidArgument(_) => Kind::Invalid,
        Error::OutOfBlocks {
            tier,
            needed_blocks,
            available_blocks,
        } => Kind::Oob(*tier, *needed_blocks, *available_blocks),
        other => panic!("unexpected error variant {other:?}"),
    }
}

pub fn distinct(ids: &[u64]) -> Result<(), Kind> {
    let mut v = ids.to_vec();
    v.sort_unstable();
    v.dedup();
    if v.len() == ids.len() {
        Ok(())
    } else {
        Err(Kind::Invalid)
    }
}

impl Model {
    pub fn ng(&self) -> usize {
        self.specs.len()
    }

    pub fn pool_free(&self) -> usize {
        self.num_blocks - self.refcounts.len() - self.cached.len()
    }

    pub fn available(&self) -> usize {
        self.pool_free() + self.cached.len()
    }

    pub fn new_block(&mut self) -> MBlock {
        self.next_block += 1;
        self.next_block
    }

    /// `n` fresh blocks (refcount 1): pool first, then evicting the LRU front. Pre-checked.
    pub fn alloc_fresh(&mut self, n: usize) -> Vec<MBlock> {
        let from_pool = n.min(self.pool_free());
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            if i >= from_pool {
                let victim = self.cached.remove(0);
                self.unindex(victim);
                self.evictions += 1;
            }
            let b = self.new_block();
            self.refcounts.insert(b, 1);
            out.push(b);
        }
        out
    }

    pub fn release(&mut self, b: MBlock) {
        let rc = self.refcounts.get_mut(&b).unwrap();
        *rc -= 1;
        if *rc == 0 {
            self.refcounts.remove(&b);
            if self.key_of.contains_key(&b) {
                self.cached.push(b);
            }
        }
    }

    /// One more reference on hit block `b` (revived when cached).
    pub fn take(&mut self, b: MBlock) {
        if let Some(pos) = self.cached.iter().position(|&c| c == b) {
            self.cached.remove(pos);
            self.refcounts.insert(b, 1);
        } else {
            *self.refcounts.get_mut(&b).unwrap() += 1;
        }
    }

    pub fn register(&mut self, b: MBlock, key: Key) {
        if self.key_of.contains_key(&b) {
            return;
        }
        match self.index.get(&key).copied() {
            // In use: `b` stays a private block.
            Some(x) if self.refcounts.contains_key(&x) => return,
            // Cached: `b` takes its place; it goes back to the free pool.
            Some(x) => {
                let pos = self.cached.iter().position(|&c| c == x).unwrap();
                self.cached.remove(pos);
                self.key_of.remove(&x);
            }
            None => {}
        }
        self.index.insert(key.clone(), b);
        self.key_of.insert(b, key);
    }

    pub fn unindex(&mut self, b: MBlock) {
        if let Some(key) = self.key_of.remove(&b) {
            self.index.remove(&key);
        }
    }

    pub fn resident(&self, id: u64) -> Result<&MSeq, Kind> {
        match self.seqs.get(&id) {
            None => Err(Kind::Unknown(id)),
            Some(s) if s.swapped => Err(Kind::Swapped(id)),
            Some(s) => Ok(s),
        }
    }

    /// Enters every block of `id` that is full, computed and known and not offered yet.
    pub fn register_ready(&mut self, id: u64) {
        let bs = self.block_size;
        let s = &self.seqs[&id];
        let Some(t) = &s.tokens else {
            return;
        };
        let end = s.computed.min(t.len()) / bs;
        let start = s.hashed;
        if end <= start {
            return;
        }
        let (t, extra, tables) = (t.clone(), s.extra, s.tables.clone());
        for (g, &spec) in self.specs.clone().iter().enumerate() {
            if !caches(spec, bs) {
                continue;
            }
            for i in start..end {
                if let Some(b) = tables[g][i] {
                    self.register(b, (g, extra, t[..(i + 1) * bs].to_vec()));
                }
            }
        }
        self.seqs.get_mut(&id).unwrap().hashed = end;
    }

    pub fn advance(&mut self, ids: &[u64], n: usize) -> Result<(), Kind> {
        distinct(ids)?;
        let bs = self.block_size;
        for &id in ids {
            let s = self.resident(id)?;
            if n > s.num_tokens - s.computed || n > s.len() * bs - s.computed {
                return Err(Kind::Invalid);
            }
        }
        if n == 0 {
            return Ok(());
        }
        for &id in ids {
            let c = self.seqs[&id].computed;
            self.release_window(id, c);
            self.seqs.get_mut(&id).unwrap().computed += n;
            self.register_ready(id);
        }
        Ok(())
    }

    /// Whether a write into block `b` copies it: shared (counting references earlier batch
    /// members copied away from), or indexed.
    pub fn copy_needed(&self, b: MBlock, released: &mut HashMap<MBlock, u32>) -> bool {
        let r = released.entry(b).or_insert(0);
        if self.refcounts[&b] - *r > 1 {
            *r += 1;
            return true;
        }
        self.key_of.contains_key(&b)
    }

    /// Blocks an append needs and, per group, whether the write's partial block is copied.
    pub fn plan(
        &self,
        id: u64,
        n: usize,
        released: &mut HashMap<MBlock, u32>,
    ) -> Result<(usize, Vec<bool>), Kind> {
        let s = self.resident(id)?;
        if s.computed < s.num_tokens {
            return Err(Kind::Invalid);
        }
        let bs = self.block_size;
        let t = s.num_tokens;
        let new_len = t.checked_add(n).ok_or(Kind::Invalid)?;
        let positions = new_len.div_ceil(bs).max(s.len());
        let held = self
            .specs
            .iter()
            .map(|&spec| fresh_cap(spec).map_or(positions, |c| c.min(positions)))
            .fold(0usize, usize::saturating_add)
            .max(table_bound(&self.specs, positions));
        if held > self.num_blocks {
            return Err(Kind::Invalid);
        }
        let copies: Vec<bool> = (0..self.ng())
            .map(|g| {
                n > 0
                    && t % bs != 0
                    && s.tables[g][t / bs].is_some_and(|b| self.copy_needed(b, released))
            })
            .collect();
        let fresh =
            fresh_for(&self.specs, s.len(), positions) + copies.iter().filter(|&&c| c).count();
        Ok((fresh, copies))
    }

    pub fn apply(
        &mut self,
        id: u64,
        n: usize,
        tokens: Option<&[u32]>,
        copies: &[bool],
        supply: &mut impl Iterator<Item = MBlock>,
    ) {
        let bs = self.block_size;
        let mut s = self.seqs.remove(&id).unwrap();
        let t = s.num_tokens;
        let positions = (t + n).div_ceil(bs).max(s.len());
        let mut srcs = Vec::new();
        for (g, &copy) in copies.iter().enumerate() {
            if copy {
                let dst = supply.next().unwrap();
                let old = s.tables[g][t / bs].replace(dst).unwrap();
                self.pending_copies.push((old, dst));
                srcs.push(old);
            }
            grow(self.specs[g], &mut s.tables[g], positions, supply);
        }
        s.num_tokens += n;
        s.computed = s.num_tokens;
        match (&mut s.tokens, tokens) {
            (Some(all), Some(new)) if all.len() == t => all.extend_from_slice(new),
            _ => s.tokens = None,
        }
        self.seqs.insert(id, s);
        self.register_ready(id);
        for old in srcs {
            self.release(old);
        }
    }

    pub fn append(&mut self, id: u64, n: usize, tokens: Option<&[u32]>) -> Result<(), Kind> {
        self.append_batch(&[id], n, tokens.map(|t| vec![t.to_vec()]).as_deref())
    }

    pub fn append_batch(
        &mut self,
        ids: &[u64],
        n: usize,
        tokens: Option<&[Vec<u32>]>,
    ) -> Result<(), Kind> {
        distinct(ids)?;
        let mut released = HashMap::new();
        let mut plans = Vec::new();
        let mut total = 0;
        for &id in ids {
            let (need, copies) = self.plan(id, n, &mut released)?;
            total += need;
            plans.push(copies);
        }
        if total > self.num_blocks {
            return Err(Kind::Invalid);
        }
        if n == 0 {
            return Ok(());
        }
        // The releases may make room; an append short all the same changes nothing.
        let freed = self.freed_by_release(ids);
        if total > self.available() + freed {
            return Err(Kind::Oob(Tier::Device, total, self.available() + freed));
        }
        for &id in ids {
            let c = self.seqs[&id].computed;
            self.release_window(id, c);
        }
        let mut supply = self.alloc_fresh(total).into_iter();
        for (row, (&id, copies)) in ids.iter().zip(plans).enumerate() {
            self.apply(id, n, tokens.map(|t| &t[row][..]), &copies, &mut supply);
        }
        Ok(())
    }

    pub fn fork(&mut self, p: u64, c: u64) -> Result<(), Kind> {
        let mut parent = self.resident(p)?.clone();
        if self.seqs.contains_key(&c) {
            return Err(Kind::Exists(c));
        }
        if parent.computed < parent.num_tokens {
            return Err(Kind::Invalid);
        }
        let keep = parent.num_tokens.div_ceil(self.block_size);
        let lookahead = parent.len() > keep;
        let mut tails = Vec::new();
        for t in parent.tables.iter_mut() {
            tails.push(t.split_off(keep.min(t.len())));
        }
        for b in parent.tables.iter().flatten().flatten() {
            *self.refcounts.get_mut(b).unwrap() += 1;
        }
        self.seqs.insert(c, parent.clone());
        if lookahead {
            // The parent gives up its lookahead slots.
            self.seqs.get_mut(&p).unwrap().tables = parent.tables;
            for tail in tails {
                for b in tail.into_iter().rev().flatten() {
                    self.release(b);
                }
            }
        }
        Ok(())
    }

    pub fn free(&mut self, id: u64) -> Result<(), Kind> {
        let s = self.seqs.remove(&id).ok_or(Kind::Unknown(id))?;
        if s.swapped {
            for h in s.tables.into_iter().flatten().flatten() {
                let rc = self.host_refs.get_mut(&h).unwrap();
                *rc -= 1;
                if *rc == 0 {
                    self.host_refs.remove(&h);
                }
            }
        } else {
            for t in &s.tables {
                for b in t.iter().rev().flatten() {
                    self.release(*b);
                }
            }
        }
        Ok(())
    }

    pub fn free_batch(&mut self, ids: &[u64]) -> Result<(), Kind> {
        distinct(ids)?;
        if let Some(&id) = ids.iter().find(|id| !self.seqs.contains_key(id)) {
            return Err(Kind::Unknown(id));
        }
        for &id in ids {
            self.free(id).unwrap();
        }
        Ok(())
    }

    pub fn truncate(&mut self, id: u64, n: usize) -> Result<(), Kind> {
        let s = self.resident(id)?;
        if n > s.num_tokens {
            return Err(Kind::Invalid);
        }
        if n == s.num_tokens {
            return Ok(());
        }
        if self.specs.contains(&KvGroupSpec::MambaState) {
            return Err(Kind::Invalid);
        }
        let bs = self.block_size;
        let keep = n.div_ceil(bs);
        for (g, &spec) in self.specs.iter().enumerate() {
            let t = &s.tables[g];
            let from = skipped(spec, n, bs).min(keep);
            if t[from.min(t.len())..keep.min(t.len())].contains(&None) {
                return Err(Kind::Invalid);
            }
        }
        let mut s = self.seqs.remove(&id).unwrap();
        let computed = s.computed.min(n);
        if let Some(t) = &s.tokens {
            let known = t.len();
            let new_known = known.min(n);
            let new_h = computed.min(new_known) / bs;
            if new_h >= s.hashed {
                s.tokens.as_mut().unwrap().truncate(new_known);
            } else {
                let recoverable = n % bs == 0
                    || (0..self.ng()).any(|g| {
                        s.tables[g][new_h].is_some_and(|b| {
                            self.key_of.get(&b)
                                == Some(&(g, s.extra, t[..(new_h + 1) * bs].to_vec()))
                        })
                    });
                if recoverable {
                    s.tokens.as_mut().unwrap().truncate(n);
                } else {
                    s.tokens = None;
                }
                s.hashed = new_h;
            }
        }
        for g in 0..self.ng() {
            let len = s.tables[g].len();
            let tail = s.tables[g].split_off(keep.min(len));
            let kept_partial = (n % bs != 0 && keep <= len)
                .then(|| s.tables[g][keep - 1])
                .flatten();
            for &b in tail.iter().rev().flatten().chain(kept_partial.iter()) {
                if self.key_of.contains_key(&b) && self.refcounts[&b] == 1 {
                    self.unindex(b);
                }
            }
            for &b in tail.iter().rev().flatten() {
                self.release(b);
            }
        }
        s.num_tokens = n;
        s.computed = computed;
        self.seqs.insert(id, s);
        Ok(())
    }

    pub fn pin_key(&self, t: &[u32], extra: Option<u8>) -> PinKey {
        (
            extra,
            t[..t.len() / self.block_size * self.block_size].to_vec(),
        )
    }

    pub fn pin(&mut self, t: &[u32], extra: Option<u8>) -> usize {
        if !self.caching {
            return 0;
        }
        let (l, places) = self.hit(t, extra, usize::MAX);
        if l == 0 {
            return 0;
        }
        let blocks: Vec<MBlock> = places.into_iter().flatten().flatten().collect();
        for &b in &blocks {
            self.take(b);
            *self.pin_counts.entry(b).or_insert(0) += 1;
        }
        let key = self.pin_key(t, extra);
        self.pins.entry(key).or_default().push(blocks);
        l * self.block_size
    }

    pub fn unpin(&mut self, t: &[u32], extra: Option<u8>) -> Result<(), Kind> {
        if !self.caching || t.len() < self.block_size {
            return Err(Kind::Invalid);
        }
        let key = self.pin_key(t, extra);
        let pins = self.pins.get_mut(&key).ok_or(Kind::Invalid)?;
        let blocks = pins.pop().unwrap();
        if pins.is_empty() {
            self.pins.remove(&key);
        }
        for &b in blocks.iter().rev() {
            let c = self.pin_counts.get_mut(&b).unwrap();
            *c -= 1;
            if *c == 0 {
                self.pin_counts.remove(&b);
            }
            self.release(b);
        }
        Ok(())
    }

    /// `evict_blocks` of `blocks` (`None`: a physical block the model has no live block for);
    /// `in_range`: every id was inside the pool. Each indexed block leaves the index (a cached
    /// one goes back to the free pool, counted as an eviction); a pinned one is refused.
    pub fn evict_blocks(
        &mut self,
        blocks: &[Option<MBlock>],
        in_range: bool,
    ) -> Result<usize, Kind> {
        if !in_range {
            return Err(Kind::Invalid);
        }
        if !self.caching {
            return Ok(0);
        }
        if blocks
            .iter()
            .flatten()
            .any(|b| self.pin_counts.contains_key(b))
        {
            return Err(Kind::Invalid);
        }
        let mut removed = 0;
        for &b in blocks.iter().flatten() {
            if !self.key_of.contains_key(&b) {
                continue;
            }
            self.unindex(b);
            if let Some(pos) = self.cached.iter().position(|&c| c == b) {
                self.cached.remove(pos);
                self.evictions += 1;
            }
            removed += 1;
        }
        Ok(removed)
    }

    pub fn reset(&mut self) -> bool {
        if !self.refcounts.is_empty() {
            return false;
        }
        self.cached.clear();
        self.index.clear();
        self.key_of.clear();
        true
    }
}
