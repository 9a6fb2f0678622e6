//! Model-based test of hybrid KV-cache groups (docs/design.md, Hybrid groups): random
//! operation sequences (admission with prefix hits and chunked prefill, advance_computed,
//! appends and batch appends, fork, free, truncate, match_prefix, pins, cache reset) on managers with full and
//! sliding-window groups, against a tiny reference model, with `check_invariants()` after every
//! step.
//!
//! The model keeps, per sequence and group, a table of abstract block ids (`None` at released
//! positions), refcounts, a prefix index keyed by (group, extra key, full token prefix), the
//! LRU of cached blocks and the free count. Its hit rule is the declarative one: the longest
//! `L` such that every full group has its blocks `[0, L)` cached and every window group those
//! covering the last `window - 1` tokens before `L`. After each step the manager's tables must
//! match the model's up to a renaming of blocks (kept across steps), the released positions
//! must be the same, and blocks in use, cached blocks (in LRU order), hits and errors must be
//! the ones the model predicts.

use std::collections::{BTreeMap, HashMap};

use pagedkv::{BlockId, Error, KvCacheManager, KvGroupSpec, ManagerConfig, NULL_BLOCK};
use proptest::prelude::*;

type MBlock = u64;
/// (group, extra key, every token up to the block's end).
type Key = (usize, Option<u8>, Vec<u32>);

#[derive(Debug, Clone)]
enum Op {
    Add {
        id: u64,
        prompt: usize,
        len: usize,
        extra: Option<u8>,
        sched: Option<usize>,
    },
    AddLen(u64, usize),
    Advance(Vec<u64>, usize),
    Append(u64, usize, bool),
    AppendBatch(Vec<u64>, usize),
    Fork(u64, u64),
    Free(u64),
    Truncate(u64, usize),
    Match(usize, usize),
    Pin(usize, usize),
    Unpin(usize, usize),
    Reset,
    TakeCopyOps,
}

#[derive(Debug, Clone)]
struct MSeq {
    tables: Vec<Vec<Option<MBlock>>>,
    num_tokens: usize,
    num_computed: usize,
    tokens: Option<Vec<u32>>,
    extra: Option<u8>,
    /// Full blocks already offered to the index (`num_computed / bs` while tokens are known).
    hashed: usize,
}

#[derive(Debug, Clone, Default)]
struct MBlockState {
    rc: u32,
    key: Option<Key>,
}

#[derive(Debug)]
struct Model {
    specs: Vec<KvGroupSpec>,
    bs: usize,
    num_blocks: usize,
    caching: bool,
    seqs: BTreeMap<u64, MSeq>,
    blocks: HashMap<MBlock, MBlockState>,
    /// Every indexed copy, oldest first (the oldest serves hits).
    index: HashMap<Key, Vec<MBlock>>,
    lru: Vec<MBlock>,
    next: MBlock,
    in_use: usize,
    /// Pins, oldest first: (prompt's full-block tokens, blocks held).
    pins: Vec<(Vec<u32>, Vec<MBlock>)>,
}

fn skipped(spec: KvGroupSpec, n: usize, bs: usize) -> usize {
    match spec {
        KvGroupSpec::FullAttention => 0,
        KvGroupSpec::SlidingWindow { window } => n.saturating_sub(window - 1) / bs,
    }
}

/// The prompts: a few shared prefixes so that hits happen.
fn prompt(p: usize, len: usize) -> Vec<u32> {
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

fn kind(e: &Error) -> std::mem::Discriminant<Error> {
    std::mem::discriminant(e)
}

impl Model {
    fn free_count(&self) -> usize {
        self.num_blocks - self.in_use - self.lru.len()
    }

    fn key(&self, g: usize, tokens: &[u32], extra: Option<u8>, i: usize) -> Key {
        (g, extra, tokens[..(i + 1) * self.bs].to_vec())
    }

    fn cached(&self, g: usize, tokens: &[u32], extra: Option<u8>, i: usize) -> Option<MBlock> {
        self.index
            .get(&self.key(g, tokens, extra, i))
            .and_then(|copies| copies.first().copied())
    }

    /// The declarative hit rule.
    fn hit(&self, tokens: &[u32], extra: Option<u8>, max: usize) -> usize {
        if !self.caching {
            return 0;
        }
        (0..=max)
            .rev()
            .find(|&l| {
                self.specs.iter().enumerate().all(|(g, &spec)| {
                    let from = match spec {
                        KvGroupSpec::FullAttention => 0,
                        KvGroupSpec::SlidingWindow { window } => {
                            l.saturating_sub((window - 1).div_ceil(self.bs))
                        }
                    };
                    (from..l).all(|i| self.cached(g, tokens, extra, i).is_some())
                })
            })
            .unwrap_or(0)
    }

    fn new_block(&mut self) -> MBlock {
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

    fn take(&mut self, b: MBlock) {
        let st = self.blocks.get_mut(&b).expect("live");
        if st.rc == 0 {
            self.lru.retain(|&x| x != b);
            self.in_use += 1;
        }
        st.rc += 1;
    }

    fn release(&mut self, b: MBlock) {
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

    fn unindex(&mut self, b: MBlock) {
        if let Some(k) = self.blocks.get_mut(&b).and_then(|s| s.key.take()) {
            self.drop_copy(&k, b);
        }
    }

    fn drop_copy(&mut self, k: &Key, b: MBlock) {
        let copies = self.index.get_mut(k).expect("indexed");
        copies.retain(|&c| c != b);
        if copies.is_empty() {
            self.index.remove(k);
        }
    }

    fn index_computed(&mut self, id: u64) {
        if !self.caching {
            return;
        }
        let s = &self.seqs[&id];
        let Some(tokens) = s.tokens.clone() else {
            return;
        };
        let (start, full, extra) = (s.hashed, s.num_computed / self.bs, s.extra);
        for g in 0..self.specs.len() {
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

    fn resident(&self, id: u64) -> Result<&MSeq, Error> {
        self.seqs.get(&id).ok_or(Error::UnknownSequence(id))
    }

    fn add(
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
    fn release_plan(&self, id: u64) -> Vec<(usize, usize)> {
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

    fn apply_release(&mut self, id: u64, plan: &[(usize, usize)]) {
        for (g, &(first, end)) in plan.iter().enumerate() {
            for i in (first..end).rev() {
                let b = self.seqs.get_mut(&id).unwrap().tables[g][i].take().unwrap();
                self.release(b);
            }
        }
    }

    fn append(&mut self, ids: &[u64], k: usize, tokens: Option<&[u32]>) -> Result<(), Error> {
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

    fn advance(&mut self, ids: &[u64], n: usize) -> Result<(), Error> {
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

    fn fork(&mut self, parent: u64, child: u64) -> Result<(), Error> {
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

    fn free(&mut self, id: u64) -> Result<(), Error> {
        let s = self.seqs.remove(&id).ok_or(Error::UnknownSequence(id))?;
        for t in &s.tables {
            for &b in t.iter().rev().flatten() {
                self.release(b);
            }
        }
        Ok(())
    }

    fn pin(&mut self, tokens: &[u32]) -> usize {
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

    fn unpin(&mut self, tokens: &[u32]) -> Result<(), Error> {
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

    fn reset(&mut self) -> bool {
        if self.in_use > 0 {
            return false;
        }
        for b in std::mem::take(&mut self.lru) {
            self.blocks.remove(&b);
        }
        self.index.clear();
        true
    }

    fn truncate(&mut self, id: u64, n: usize) -> Result<(), Error> {
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

/// Checks the manager against the model: tables up to the renaming `names` (model block ->
/// physical block, kept across steps), released positions, blocks in use, LRU order.
fn compare(kv: &mut KvCacheManager, m: &Model, names: &mut HashMap<MBlock, BlockId>) {
    kv.check_invariants().unwrap();
    let stats = kv.stats();
    assert_eq!(stats.num_blocks_in_use, m.in_use, "blocks in use");
    assert_eq!(stats.num_cached_blocks, m.lru.len(), "cached blocks");
    assert_eq!(kv.num_sequences(), m.seqs.len());
    names.retain(|b, _| m.blocks.contains_key(b));
    for (&id, s) in &m.seqs {
        assert_eq!(kv.num_tokens(id).unwrap(), s.num_tokens);
        assert_eq!(kv.num_computed_tokens(id).unwrap(), s.num_computed);
        for (g, t) in s.tables.iter().enumerate() {
            let real = kv.block_table_group(id, g).unwrap();
            assert_eq!(real.len(), t.len(), "seq {id} group {g} length");
            for (&r, &mb) in real.iter().zip(t) {
                match mb {
                    None => assert_eq!(r, NULL_BLOCK, "seq {id} group {g}: {real:?} vs {t:?}"),
                    Some(mb) => {
                        assert_ne!(r, NULL_BLOCK, "seq {id} group {g}: {real:?} vs {t:?}");
                        let named = *names.entry(mb).or_insert(r);
                        assert_eq!(named, r, "seq {id} group {g}: block renamed");
                        assert_eq!(kv.refcount(r).unwrap(), m.blocks[&mb].rc);
                    }
                }
            }
        }
    }
    let mut seen = HashMap::new();
    for (mb, r) in names.iter() {
        assert!(
            seen.insert(*r, *mb).is_none(),
            "two live model blocks share block {r}"
        );
    }
    let lru: Vec<BlockId> = m.lru.iter().map(|b| names[b]).collect();
    assert_eq!(kv.cached_blocks(), lru, "LRU order");
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let id = 0u64..5;
    prop_oneof![
        4 => (id.clone(), 0usize..4, 0usize..24, prop::option::weighted(0.1, 0u8..2), prop::option::weighted(0.3, 0usize..12))
            .prop_map(|(id, prompt, len, extra, sched)| Op::Add { id, prompt, len, extra, sched }),
        1 => (id.clone(), 0usize..20).prop_map(|(i, n)| Op::AddLen(i, n)),
        2 => (prop::collection::vec(0u64..5, 0..3), 0usize..6).prop_map(|(ids, n)| Op::Advance(ids, n)),
        5 => (id.clone(), 0usize..5, prop::bool::weighted(0.9)).prop_map(|(i, n, t)| Op::Append(i, n, t)),
        2 => (prop::collection::vec(0u64..5, 0..4), 1usize..3).prop_map(|(ids, n)| Op::AppendBatch(ids, n)),
        2 => (id.clone(), id.clone()).prop_map(|(a, b)| Op::Fork(a, b)),
        3 => id.clone().prop_map(Op::Free),
        2 => (id.clone(), 0usize..24).prop_map(|(i, n)| Op::Truncate(i, n)),
        1 => (0usize..4, 0usize..24).prop_map(|(p, n)| Op::Match(p, n)),
        1 => (0usize..4, 0usize..24).prop_map(|(p, n)| Op::Pin(p, n)),
        1 => (0usize..4, 0usize..24).prop_map(|(p, n)| Op::Unpin(p, n)),
        1 => Just(Op::Reset),
        1 => Just(Op::TakeCopyOps),
    ]
}

fn groups_strategy() -> impl Strategy<Value = Vec<KvGroupSpec>> {
    let window = (1usize..10).prop_map(|window| KvGroupSpec::SlidingWindow { window });
    prop_oneof![
        window
            .clone()
            .prop_map(|w| vec![KvGroupSpec::FullAttention, w]),
        window.clone().prop_map(|w| vec![w]),
        (window.clone(), window).prop_map(|(a, b)| vec![a, KvGroupSpec::FullAttention, b]),
        Just(vec![KvGroupSpec::FullAttention, KvGroupSpec::FullAttention]),
    ]
}

fn run(groups: Vec<KvGroupSpec>, bs: usize, num_blocks: usize, caching: bool, ops: Vec<Op>) {
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size: bs,
        enable_prefix_caching: caching,
        enable_kv_events: true,
        kv_groups: groups.clone(),
        ..Default::default()
    })
    .unwrap();
    let mut m = Model {
        specs: groups,
        bs,
        num_blocks,
        caching,
        seqs: BTreeMap::new(),
        blocks: HashMap::new(),
        index: HashMap::new(),
        lru: Vec::new(),
        next: 0,
        in_use: 0,
        pins: Vec::new(),
    };
    let mut names = HashMap::new();
    let mut next_token = 100u32;
    for op in ops {
        let (got, want): (Result<usize, Error>, Result<usize, Error>) = match &op {
            Op::Add {
                id,
                prompt: p,
                len,
                extra,
                sched,
            } => {
                let t = prompt(*p, *len);
                let key = extra.map(|e| vec![e]);
                let s = sched.unwrap_or(usize::MAX);
                (
                    kv.add_sequence_scheduled(*id, &t, key.as_deref(), s),
                    m.add(*id, Some(t.clone()), t.len(), *extra, s),
                )
            }
            Op::AddLen(id, n) => (
                kv.add_sequence_len(*id, *n),
                m.add(*id, None, *n, None, usize::MAX),
            ),
            Op::Advance(ids, n) => (
                kv.advance_computed(ids, *n).map(|_| 0),
                m.advance(ids, *n).map(|_| 0),
            ),
            Op::Append(id, n, with_tokens) => {
                if *with_tokens {
                    let t: Vec<u32> = (0..*n as u32).map(|i| (next_token + i) % 3).collect();
                    next_token += 1;
                    (
                        kv.append_tokens(*id, &t).map(|_| 0),
                        m.append(&[*id], *n, Some(&t)).map(|_| 0),
                    )
                } else {
                    (
                        kv.append_len(*id, *n).map(|_| 0),
                        m.append(&[*id], *n, None).map(|_| 0),
                    )
                }
            }
            Op::AppendBatch(ids, n) => {
                let t: Vec<u32> = (0..ids.len() * n)
                    .map(|i| (i as u32 + next_token) % 3)
                    .collect();
                next_token += 1;
                (
                    kv.append_tokens_batch(ids, &t, *n).map(|_| 0),
                    m.append(ids, *n, Some(&t)).map(|_| 0),
                )
            }
            Op::Fork(a, b) => (kv.fork(*a, *b).map(|_| 0), m.fork(*a, *b).map(|_| 0)),
            Op::Free(id) => (kv.free(*id).map(|_| 0), m.free(*id).map(|_| 0)),
            Op::Truncate(id, n) => (
                kv.truncate(*id, *n).map(|_| 0),
                m.truncate(*id, *n).map(|_| 0),
            ),
            Op::Pin(p, n) => {
                let t = prompt(*p, *n);
                (kv.pin_prefix(&t, None), Ok(m.pin(&t)))
            }
            Op::Unpin(p, n) => {
                let t = prompt(*p, *n);
                (kv.unpin_prefix(&t, None).map(|_| 0), m.unpin(&t).map(|_| 0))
            }
            Op::Reset => (
                Ok(usize::from(kv.reset_prefix_cache())),
                Ok(usize::from(m.reset())),
            ),
            Op::Match(p, n) => {
                let t = prompt(*p, *n);
                (
                    kv.match_prefix(&t, None),
                    Ok(m.hit(&t, None, n.saturating_sub(1) / bs) * bs),
                )
            }
            Op::TakeCopyOps => {
                for (src, dst) in kv.take_copy_ops() {
                    assert_ne!(src, dst);
                }
                (Ok(0), Ok(0))
            }
        };
        match (&got, &want) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{op:?}"),
            (Err(Error::OutOfBlocks { .. }), Err(Error::OutOfBlocks { .. })) => {
                assert_eq!(got, want, "{op:?}")
            }
            (Err(a), Err(b)) => assert_eq!(kind(a), kind(b), "{op:?}: {a:?} vs {b:?}"),
            _ => panic!("{op:?}: manager {got:?}, model {want:?}"),
        }
        compare(&mut kv, &m, &mut names);
    }
    // Everything goes back to the pool.
    let ids: Vec<u64> = m.seqs.keys().copied().collect();
    kv.free_batch(&ids).unwrap();
    for (key, _) in m.pins.iter().rev() {
        kv.unpin_prefix(key, None).unwrap();
    }
    kv.check_invariants().unwrap();
    assert_eq!(kv.stats().num_blocks_in_use, 0);
    assert!(kv.reset_prefix_cache());
    assert_eq!(kv.num_available_blocks(), num_blocks);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, max_shrink_iters: 4000, ..ProptestConfig::default() })]

    #[test]
    fn hybrid_matches_model(
        groups in groups_strategy(),
        bs in 1usize..4,
        num_blocks in 6usize..40,
        caching in prop::bool::weighted(0.8),
        ops in prop::collection::vec(op_strategy(), 1..60),
    ) {
        run(groups, bs, num_blocks, caching, ops);
    }
}

#[test]
fn bad_group_configs_and_group_indices_are_invalid_arguments() {
    let config = |kv_groups: Vec<KvGroupSpec>| ManagerConfig {
        num_blocks: 8,
        block_size: 2,
        kv_groups,
        ..Default::default()
    };
    let invalid = |r: Result<KvCacheManager, Error>| matches!(r, Err(Error::InvalidArgument(_)));
    assert!(invalid(KvCacheManager::new(config(vec![]))));
    assert!(invalid(KvCacheManager::new(config(vec![
        KvGroupSpec::SlidingWindow { window: 0 }
    ]))));
    assert!(invalid(KvCacheManager::new(config(vec![
        KvGroupSpec::FullAttention;
        pagedkv::MAX_KV_GROUPS + 1
    ]))));
    let huge = KvGroupSpec::SlidingWindow { window: usize::MAX };
    for groups in [
        vec![KvGroupSpec::FullAttention],
        vec![KvGroupSpec::FullAttention, huge],
    ] {
        let n = groups.len();
        let mut kv = KvCacheManager::new(config(groups)).unwrap();
        assert_eq!(kv.kv_groups().len(), n);
        kv.add_sequence(1, &[1, 2, 3], None).unwrap();
        kv.append_tokens(1, &[4, 5]).unwrap();
        assert!(kv.block_table_group(1, n - 1).is_ok());
        for r in [
            kv.block_table_group(1, n).map(|_| ()),
            kv.batch_block_tables_group(&[1], n).map(|_| ()),
            kv.slot_mapping_group(&[1], 1, n).map(|_| ()),
            kv.csr_page_table_group(&[1], n).map(|_| ()),
            kv.block_table_group(1, usize::MAX).map(|_| ()),
        ] {
            assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        }
        // A huge window never releases anything.
        assert!(!kv
            .block_table_group(1, n - 1)
            .unwrap()
            .contains(&NULL_BLOCK));
        kv.check_invariants().unwrap();
    }
}
