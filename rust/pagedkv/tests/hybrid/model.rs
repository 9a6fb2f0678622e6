//! The reference model of `tests/hybrid.rs`: per sequence and group a table of abstract block
//! ids (`None` at released positions), refcounts, the prefix index keyed by (group, extra key,
//! full token prefix) with every copy of a content, the LRU of cached blocks, pins, and the
//! declarative hit rule.

use std::collections::{BTreeMap, HashMap};

use pagedkv::{Error, KvGroupSpec};

pub type MBlock = u64;
/// (group, extra key, every token up to the block's end).
pub type Key = (usize, Option<u8>, Vec<u32>);

#[derive(Debug, Clone)]
pub struct MSeq {
    pub tables: Vec<Vec<Option<MBlock>>>,
    pub num_tokens: usize,
    pub num_computed: usize,
    pub tokens: Option<Vec<u32>>,
    pub extra: Option<u8>,
    /// Full blocks already offered to the index (`num_computed / bs` while tokens are known).
    pub hashed: usize,
}

#[derive(Debug, Clone, Default)]
pub struct MBlockState {
    pub rc: u32,
    pub key: Option<Key>,
}

#[derive(Debug)]
pub struct Model {
    pub specs: Vec<KvGroupSpec>,
    pub bs: usize,
    pub num_blocks: usize,
    pub caching: bool,
    pub seqs: BTreeMap<u64, MSeq>,
    pub blocks: HashMap<MBlock, MBlockState>,
    /// Every indexed copy, oldest first (the oldest serves hits).
    pub index: HashMap<Key, Vec<MBlock>>,
    pub lru: Vec<MBlock>,
    pub next: MBlock,
    pub in_use: usize,
    /// Pins, oldest first: (prompt's full-block tokens, blocks held).
    pub pins: Vec<(Vec<u32>, Vec<MBlock>)>,
}

pub fn skipped(spec: KvGroupSpec, n: usize, bs: usize) -> usize {
    match spec {
        KvGroupSpec::FullAttention => 0,
        KvGroupSpec::SlidingWindow { window } => n.saturating_sub(window - 1) / bs,
    }
}

/// The prompts: a few shared prefixes so that hits happen.
pub fn prompt(p: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| {
            if i < 6 {
                (p % 2) as u32
            } else {
                (p * 7 + i) as u32 % 3
            }
        })
        .collect()
}

/// The declarative hit rule over `cached(group, block)`: the longest prefix of at most `max`
/// blocks that every group can serve (shared with the event-replay check of `tests/hybrid.rs`).
pub fn hit_rule(
    specs: &[KvGroupSpec],
    bs: usize,
    max: usize,
    cached: impl Fn(usize, usize) -> bool,
) -> usize {
    (0..=max)
        .rev()
        .find(|&l| {
            specs.iter().enumerate().all(|(g, &spec)| {
                let from = match spec {
                    KvGroupSpec::FullAttention => 0,
                    // A hit ends at a cached block of every window group, even a window of one
                    // token that needs none before it (vLLM's scan).
                    KvGroupSpec::SlidingWindow { window } => {
                        l.saturating_sub((window - 1).div_ceil(bs).max(1))
                    }
                };
                (from..l).all(|i| cached(g, i))
            })
        })
        .unwrap_or(0)
}

pub fn kind(e: &Error) -> std::mem::Discriminant<Error> {
    std::mem::discriminant(e)
}

impl Model {
    pub fn free_count(&self) -> usize {
        self.num_blocks - self.in_use - self.lru.len()
    }

    pub fn key(&self, g: usize, tokens: &[u32], extra: Option<u8>, i: usize) -> Key {
        (g, extra, tokens[..(i + 1) * self.bs].to_vec())
    }

    pub fn cached(&self, g: usize, tokens: &[u32], extra: Option<u8>, i: usize) -> Option<MBlock> {
        self.index
            .get(&self.key(g, tokens, extra, i))
            .and_then(|copies| copies.first().copied())
    }

    /// The declarative hit rule.
    pub fn hit(&self, tokens: &[u32], extra: Option<u8>, max: usize) -> usize {
        if !self.caching {
            return 0;
        }
        hit_rule(&self.specs, self.bs, max, |g, i| {
            self.cached(g, tokens, extra, i).is_some()
        })
    }

    pub fn new_block(&mut self) -> MBlock {
        // Free blocks first, then the least recently used cached block (it loses its key).
        if self.free_count() == 0 {
            let victim = self.lru.remove(0);
            let st = self.blocks.remove(&victim).expect("cached");
            self.drop_copy(&st.key.expect("cached blocks are indexed"), victim);
        }
        self.next += 1;
        self.blocks
            .insert(self.next, MBlockState { rc: 1, key: None });
        self.in_use += 1;
        self.next
    }

    pub fn take(&mut self, b: MBlock) {
        let st = self.blocks.get_mut(&b).expect("live");
        if st.rc == 0 {
            self.lru.retain(|&x| x != b);
            self.in_use += 1;
        }
        st.rc += 1;
    }

    pub fn release(&mut self, b: MBlock) {
        let st = self.blocks.get_mut(&b).expect("live");
        st.rc -= 1;
        if st.rc == 0 {
            self.in_use -= 1;
            if st.key.is_some() {
                self.lru.push(b);
            } else {
                self.blocks.remove(&b);
            }
        }
    }

    pub fn unindex(&mut self, b: MBlock) {
        if let Some(k) = self.blocks.get_mut(&b).and_then(|s| s.key.take()) {
            self.drop_copy(&k, b);
        }
    }

    pub fn drop_copy(&mut self, k: &Key, b: MBlock) {
        let copies = self.index.get_mut(k).expect("indexed");
        copies.retain(|&c| c != b);
        if copies.is_empty() {
            self.index.remove(k);
        }
    }

    pub fn index_computed(&mut self, id: u64) {
        if !self.caching {
            return;
        }
        let s = &self.seqs[&id];
        let Some(tokens) = s.tokens.clone() else {
            return;
        };
        let (start, full, extra) = (s.hashed, s.num_computed / self.bs, s.extra);
        for g in 0..self.specs.len() {
            // A window of one token caches no block (vLLM's reachability mask).
            if self.specs[g] == (KvGroupSpec::SlidingWindow { window: 1 }) {
                continue;
            }
            for i in start..full {
                let Some(b) = self.seqs[&id].tables[g][i] else {
                    continue;
                };
                let k = self.key(g, &tokens, extra, i);
                if self.blocks[&b].key.is_none() {
                    self.index.entry(k.clone()).or_default().push(b);
                    self.blocks.get_mut(&b).unwrap().key = Some(k);
                }
            }
        }
        self.seqs.get_mut(&id).unwrap().hashed = start.max(full);
    }

    pub fn resident(&self, id: u64) -> Result<&MSeq, Error> {
        self.seqs.get(&id).ok_or(Error::UnknownSequence(id))
    }

    pub fn add(
        &mut self,
        id: u64,
        tokens: Option<Vec<u32>>,
        n: usize,
        extra: Option<u8>,
        sched: usize,
    ) -> Result<usize, Error> {
        if self.seqs.contains_key(&id) {
            return Err(Error::SequenceExists(id));
        }
        let g_count = self.specs.len();
        let per_group = n.div_ceil(self.bs);
        if per_group * g_count > self.num_blocks {
            return Err(Error::InvalidArgument(String::new()));
        }
        let tokens = tokens.filter(|_| self.caching);
        let l = match &tokens {
            Some(t) => self.hit(t, extra, n.saturating_sub(1) / self.bs),
            None => 0,
        };
        let mut hit_blocks = vec![];
        for (g, &spec) in self.specs.iter().enumerate() {
            let skip = skipped(spec, l * self.bs, self.bs);
            hit_blocks.push(
                (0..l)
                    .map(|i| {
                        (i >= skip)
                            .then(|| self.cached(g, tokens.as_ref().unwrap(), extra, i).unwrap())
                    })
                    .collect::<Vec<_>>(),
            );
        }
        let fresh = (per_group - l) * g_count;
        let revived = hit_blocks
            .iter()
            .flatten()
            .flatten()
            .filter(|b| self.blocks[b].rc == 0)
            .count();
        let available = self.free_count() + self.lru.len();
        if fresh + revived > available {
            return Err(Error::OutOfBlocks {
                tier: pagedkv::Tier::Device,
                needed_blocks: fresh + revived,
                available_blocks: available,
            });
        }
        for &b in hit_blocks.iter().flatten().flatten() {
            self.take(b);
        }
        let mut tables = hit_blocks;
        for t in &mut tables {
            for _ in l..per_group {
                let b = self.new_block();
                t.push(Some(b));
            }
        }
        let hit_tokens = l * self.bs;
        self.seqs.insert(
            id,
            MSeq {
                tables,
                num_tokens: n,
                num_computed: hit_tokens + sched.min(n - hit_tokens),
                tokens,
                extra,
                hashed: l,
            },
        );
        self.index_computed(id);
        Ok(hit_tokens)
    }

    /// Per group, the positions the current watermark releases.
    pub fn release_plan(&self, id: u64) -> Vec<(usize, usize)> {
        let s = &self.seqs[&id];
        self.specs
            .iter()
            .zip(&s.tables)
            .map(|(&spec, t)| {
                let end = skipped(spec, s.num_computed, self.bs).min(t.len());
                let first = t[..end]
                    .iter()
                    .rposition(Option::is_none)
                    .map_or(0, |p| p + 1);
                (first, end)
            })
            .collect()
    }

    pub fn apply_release(&mut self, id: u64, plan: &[(usize, usize)]) {
        for (g, &(first, end)) in plan.iter().enumerate() {
            for i in (first..end).rev() {
                let b = self.seqs.get_mut(&id).unwrap().tables[g][i].take().unwrap();
                self.release(b);
            }
        }
    }

    pub fn append(&mut self, ids: &[u64], k: usize, tokens: Option<&[u32]>) -> Result<(), Error> {
        let mut seen = std::collections::HashSet::new();
        if !ids.iter().all(|id| seen.insert(*id)) {
            return Err(Error::InvalidArgument(String::new()));
        }
        let mut plans = vec![];
        for &id in ids {
            let s = self.resident(id)?;
            if s.num_computed < s.num_tokens {
                return Err(Error::InvalidArgument(String::new()));
            }
            let t = s.num_tokens;
            let per_group = (t + k).div_ceil(self.bs);
            if per_group * self.specs.len() > self.num_blocks {
                return Err(Error::InvalidArgument(String::new()));
            }
            let copies: Vec<bool> = s
                .tables
                .iter()
                .map(|tb| {
                    k > 0 && t % self.bs != 0 && {
                        let st = &self.blocks[&tb.last().unwrap().unwrap()];
                        st.rc > 1 || st.key.is_some()
                    }
                })
                .collect();
            let fresh = (per_group - t.div_ceil(self.bs)) * self.specs.len()
                + copies.iter().filter(|&&c| c).count();
            plans.push((id, fresh, copies, self.release_plan(id)));
        }
        let fresh: usize = plans.iter().map(|p| p.1).sum();
        // The window releases stand even when the blocks then run short.
        for (id, _, _, rel) in &plans {
            self.apply_release(*id, rel);
        }
        let available = self.free_count() + self.lru.len();
        if fresh > available {
            return Err(Error::OutOfBlocks {
                tier: pagedkv::Tier::Device,
                needed_blocks: fresh,
                available_blocks: available,
            });
        }
        // The manager takes every fresh block before it writes any table: evictions first.
        let mut fresh_blocks: Vec<MBlock> = (0..fresh).map(|_| self.new_block()).collect();
        fresh_blocks.reverse();
        for (row, (id, _, copies, _)) in plans.iter().enumerate() {
            if k == 0 {
                continue;
            }
            let t = self.seqs[id].num_tokens;
            let new_blocks = (t + k).div_ceil(self.bs) - t.div_ceil(self.bs);
            for (g, &copy) in copies.iter().enumerate() {
                if copy {
                    let dst = fresh_blocks.pop().unwrap();
                    let src = self.seqs.get_mut(id).unwrap().tables[g]
                        .last_mut()
                        .unwrap()
                        .replace(dst)
                        .unwrap();
                    self.release(src);
                }
                for _ in 0..new_blocks {
                    let b = fresh_blocks.pop().unwrap();
                    self.seqs.get_mut(id).unwrap().tables[g].push(Some(b));
                }
            }
            let s = self.seqs.get_mut(id).unwrap();
            match (s.tokens.as_mut(), tokens) {
                (Some(all), Some(new)) => all.extend_from_slice(&new[row * k..(row + 1) * k]),
                _ => s.tokens = None,
            }
            s.num_tokens = t + k;
            s.num_computed = t + k;
            if s.tokens.is_none() {
                s.hashed = 0;
            }
            self.index_computed(*id);
        }
        Ok(())
    }

    pub fn advance(&mut self, ids: &[u64], n: usize) -> Result<(), Error> {
        let mut seen = std::collections::HashSet::new();
        if !ids.iter().all(|id| seen.insert(*id)) {
            return Err(Error::InvalidArgument(String::new()));
        }
        for &id in ids {
            let s = self.resident(id)?;
            if n > s.num_tokens - s.num_computed {
                return Err(Error::InvalidArgument(String::new()));
            }
        }
        if n == 0 {
            return Ok(());
        }
        for &id in ids {
            let plan = self.release_plan(id);
            self.apply_release(id, &plan);
            self.seqs.get_mut(&id).unwrap().num_computed += n;
            self.index_computed(id);
        }
        Ok(())
    }

    pub fn fork(&mut self, parent: u64, child: u64) -> Result<(), Error> {
        let p = self.resident(parent)?;
        if p.num_computed < p.num_tokens {
            return Err(Error::InvalidArgument(String::new()));
        }
        if self.seqs.contains_key(&child) {
            return Err(Error::SequenceExists(child));
        }
        let c = p.clone();
        for &b in c.tables.iter().flatten().flatten() {
            self.take(b);
        }
        self.seqs.insert(child, c);
        Ok(())
    }

    pub fn free(&mut self, id: u64) -> Result<(), Error> {
        let s = self.seqs.remove(&id).ok_or(Error::UnknownSequence(id))?;
        for t in &s.tables {
            for &b in t.iter().rev().flatten() {
                self.release(b);
            }
        }
        Ok(())
    }

    pub fn pin(&mut self, tokens: &[u32]) -> usize {
        let num_full = tokens.len() / self.bs;
        let l = self.hit(tokens, None, num_full);
        if l == 0 {
            return 0;
        }
        let mut held = vec![];
        for (g, &spec) in self.specs.iter().enumerate() {
            let skip = skipped(spec, l * self.bs, self.bs);
            for i in skip..l {
                held.push(self.cached(g, tokens, None, i).unwrap());
            }
        }
        for &b in &held {
            self.take(b);
        }
        self.pins
            .push((tokens[..num_full * self.bs].to_vec(), held));
        l * self.bs
    }

    pub fn unpin(&mut self, tokens: &[u32]) -> Result<(), Error> {
        let key = &tokens[..tokens.len() / self.bs * self.bs];
        let pos = self
            .pins
            .iter()
            .rposition(|(k, _)| !k.is_empty() && k == key)
            .filter(|_| self.caching)
            .ok_or(Error::InvalidArgument(String::new()))?;
        let (_, held) = self.pins.remove(pos);
        for &b in held.iter().rev() {
            self.release(b);
        }
        Ok(())
    }

    pub fn reset(&mut self) -> bool {
        if self.in_use > 0 {
            return false;
        }
        for b in std::mem::take(&mut self.lru) {
            self.blocks.remove(&b);
        }
        self.index.clear();
        true
    }

    pub fn truncate(&mut self, id: u64, n: usize) -> Result<(), Error> {
        let s = self.resident(id)?;
        if n > s.num_tokens {
            return Err(Error::InvalidArgument(String::new()));
        }
        if n == s.num_tokens {
            return Ok(());
        }
        let keep = n.div_ceil(self.bs);
        for (&spec, t) in self.specs.iter().zip(&s.tables) {
            let lo = skipped(spec, n, self.bs).min(keep);
            if t[lo..keep].iter().any(Option::is_none) {
                return Err(Error::InvalidArgument(String::new()));
            }
        }
        for g in 0..self.specs.len() {
            let dropped: Vec<Option<MBlock>> = self.seqs.get_mut(&id).unwrap().tables[g]
                .drain(keep..)
                .collect();
            for b in dropped.into_iter().rev().flatten() {
                if self.blocks[&b].rc == 1 {
                    self.unindex(b);
                }
                self.release(b);
            }
            if n % self.bs != 0 {
                let last = self.seqs[&id].tables[g].last().unwrap().unwrap();
                if self.blocks[&last].rc == 1 {
                    self.unindex(last);
                }
            }
        }
        let bs = self.bs;
        let s = self.seqs.get_mut(&id).unwrap();
        s.num_tokens = n;
        s.num_computed = s.num_computed.min(n);
        s.hashed = s.hashed.min(n / bs);
        if let Some(t) = s.tokens.as_mut() {
            t.truncate(n);
        }
        Ok(())
    }
}
