//! Model-based test: random operation sequences (add / append / batch append / fork / free /
//! copy-on-write, prefix hits and evictions, swap-out / swap-in, cache reset, chunked prefill
//! with the computed watermark, match_prefix, truncate, pin / unpin) against a tiny reference
//! model, with `check_invariants()` and a structural comparison after every step.
//!
//! The model tracks each sequence's token count and blocks as abstract ids with refcounts, the
//! prefix index keyed by the exact (extra key, full token prefix), the LRU of cached blocks,
//! and the host tier. After each step the manager's tables must match the model's up to a
//! renaming of blocks (a bijection model block <-> physical block, kept across steps), the
//! refcounts, cached-block order and host tables must agree, and every error must be the one
//! the model predicts (same variant, same numbers).

use std::collections::{BTreeMap, HashMap};

use pagedkv::{BlockId, Error, KvCacheManager, ManagerConfig, Tier};
use proptest::prelude::*;

type MBlock = u64;
type Key = (Option<u8>, Vec<u32>);

#[derive(Debug, Clone)]
enum Op {
    Add(u64, usize),
    AddPrompt {
        id: u64,
        prompt: usize,
        len: usize,
        extra: Option<u8>,
    },
    Append(u64, usize),
    AppendTokens(u64, usize),
    AppendBatch {
        ids: Vec<u64>,
        n: usize,
        tokens: bool,
    },
    Fork(u64, u64),
    Free(u64),
    FreeBatch(Vec<u64>),
    TakeCopyOps,
    SwapOut(Vec<u64>),
    SwapIn(Vec<u64>),
    Reset,
    AddLenScheduled(u64, usize, usize),
    AddScheduled {
        id: u64,
        prompt: usize,
        len: usize,
        extra: Option<u8>,
        scheduled: usize,
    },
    Advance(Vec<u64>, usize),
    Truncate(u64, usize),
    /// Truncate to the sequence's length minus this many tokens (a rollback of drafts).
    TruncateBack(u64, usize),
    Match {
        prompt: usize,
        len: usize,
        extra: Option<u8>,
    },
    Pin {
        prompt: usize,
        len: usize,
        extra: Option<u8>,
    },
    Unpin {
        prompt: usize,
        len: usize,
        extra: Option<u8>,
    },
}

fn extra() -> impl Strategy<Value = Option<u8>> {
    prop_oneof![4 => Just(None), 1 => (0u8..2).prop_map(Some)]
}

fn count() -> impl Strategy<Value = usize> {
    prop_oneof![8 => 0usize..12, 1 => 12usize..40, 1 => Just(usize::MAX), 1 => Just(usize::MAX / 2)]
}

fn id() -> impl Strategy<Value = u64> {
    0u64..6
}

fn ids(max: usize) -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(id(), 0..max)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (id(), count()).prop_map(|(i, n)| Op::Add(i, n)),
        4 => (id(), 0usize..3, 0usize..20, prop_oneof![4 => Just(None), 1 => (0u8..2).prop_map(Some)])
            .prop_map(|(id, prompt, len, extra)| Op::AddPrompt { id, prompt, len, extra }),
        2 => (id(), count()).prop_map(|(i, n)| Op::Append(i, n)),
        4 => (id(), 0usize..6).prop_map(|(i, n)| Op::AppendTokens(i, n)),
        2 => (ids(4), 0usize..4, any::<bool>()).prop_map(|(ids, n, tokens)| Op::AppendBatch { ids, n, tokens }),
        3 => (id(), id()).prop_map(|(p, c)| Op::Fork(p, c)),
        3 => id().prop_map(Op::Free),
        1 => ids(3).prop_map(Op::FreeBatch),
        1 => Just(Op::TakeCopyOps),
        2 => ids(3).prop_map(Op::SwapOut),
        2 => ids(3).prop_map(Op::SwapIn),
        1 => Just(Op::Reset),
        1 => (id(), count(), 0usize..12).prop_map(|(i, n, k)| Op::AddLenScheduled(i, n, k)),
        4 => (id(), 0usize..3, 0usize..20, extra(), prop_oneof![0usize..10, Just(usize::MAX)])
            .prop_map(|(id, prompt, len, extra, scheduled)| Op::AddScheduled { id, prompt, len, extra, scheduled }),
        4 => (ids(3), prop_oneof![4 => 0usize..6, 1 => Just(usize::MAX)]).prop_map(|(ids, n)| Op::Advance(ids, n)),
        2 => (id(), 0usize..24).prop_map(|(i, n)| Op::Truncate(i, n)),
        4 => (id(), 0usize..5).prop_map(|(i, n)| Op::TruncateBack(i, n)),
        2 => (0usize..3, 0usize..20, extra()).prop_map(|(prompt, len, extra)| Op::Match { prompt, len, extra }),
        2 => (0usize..3, 0usize..12, extra()).prop_map(|(prompt, len, extra)| Op::Pin { prompt, len, extra }),
        2 => (0usize..3, 0usize..12, extra()).prop_map(|(prompt, len, extra)| Op::Unpin { prompt, len, extra }),
    ]
}

/// Three base prompts: 1 shares its first 5 tokens with 0; 2 shares nothing.
fn prompt_tokens(prompt: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| match prompt {
            0 => (i % 7) as u32,
            1 if i < 5 => (i % 7) as u32,
            1 => 100 + i as u32,
            _ => 200 + (i % 3) as u32,
        })
        .collect()
}

/// Tokens a sequence of `len` tokens appends next: continuing pattern 0, so appended blocks
/// collide with prompt 0's blocks and get hit later.
fn next_tokens(len: usize, n: usize) -> Vec<u32> {
    (len..len + n).map(|i| (i % 7) as u32).collect()
}

#[derive(Debug, Clone)]
struct MSeq {
    num_tokens: usize,
    /// Device model blocks while resident, host model blocks while swapped.
    blocks: Vec<MBlock>,
    swapped: bool,
    /// All token ids while known and caching is on.
    tokens: Option<Vec<u32>>,
    extra: Option<u8>,
    /// Tokens computed (the watermark; blocks wholly below it are indexed).
    computed: usize,
}

#[derive(Debug)]
struct Model {
    num_blocks: usize,
    block_size: usize,
    caching: bool,
    num_host: usize,
    seqs: BTreeMap<u64, MSeq>,
    refcounts: HashMap<MBlock, u32>,
    /// Cached-evictable blocks, least recently used first.
    cached: Vec<MBlock>,
    /// Every block holding a content, the most recently registered first (the one a hit
    /// takes): the same content may sit on several blocks.
    index: HashMap<Key, Vec<MBlock>>,
    key_of: HashMap<MBlock, Key>,
    host_refs: HashMap<MBlock, u32>,
    next_block: MBlock,
    pending_copies: Vec<(MBlock, MBlock)>,
    evictions: u64,
    hit_tokens: u64,
    /// Pins by (extra key, the prompt's full-block tokens): the blocks each pin holds.
    pins: HashMap<Key, Vec<Vec<MBlock>>>,
    /// Pins per block (each holds a reference, counted in `refcounts`).
    pin_counts: HashMap<MBlock, u32>,
}

#[derive(Debug, PartialEq)]
enum Kind {
    Unknown(u64),
    Exists(u64),
    Swapped(u64),
    Invalid,
    Oob(Tier, usize, usize),
}

fn kind(e: &Error) -> Kind {
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

fn distinct(ids: &[u64]) -> Result<(), Kind> {
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
    fn pool_free(&self) -> usize {
        self.num_blocks - self.refcounts.len() - self.cached.len()
    }

    fn available(&self) -> usize {
        self.pool_free() + self.cached.len()
    }

    fn host_free(&self) -> usize {
        self.num_host - self.host_refs.len()
    }

    fn blocks_for(&self, n: usize) -> usize {
        n.div_ceil(self.block_size)
    }

    fn new_block(&mut self) -> MBlock {
        self.next_block += 1;
        self.next_block
    }

    /// `n` fresh blocks (refcount 1): pool first, then evicting the LRU front. Pre-checked.
    fn alloc_fresh(&mut self, n: usize) -> Vec<MBlock> {
        let from_pool = n.min(self.pool_free());
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            if i >= from_pool {
                let victim = self.cached.remove(0);
                let key = self.key_of.remove(&victim).unwrap();
                let copies = self.index.get_mut(&key).unwrap();
                copies.retain(|&c| c != victim);
                if copies.is_empty() {
                    self.index.remove(&key);
                }
                self.evictions += 1;
            }
            let b = self.new_block();
            self.refcounts.insert(b, 1);
            out.push(b);
        }
        out
    }

    fn release(&mut self, b: MBlock) {
        let rc = self.refcounts.get_mut(&b).unwrap();
        *rc -= 1;
        if *rc == 0 {
            self.refcounts.remove(&b);
            if self.key_of.contains_key(&b) {
                self.cached.push(b);
            }
        }
    }

    fn register(&mut self, b: MBlock, key: Key) {
        if self.key_of.contains_key(&b) {
            return;
        }
        self.index.entry(key.clone()).or_default().insert(0, b);
        self.key_of.insert(b, key);
    }

    fn resident(&self, id: u64) -> Result<&MSeq, Kind> {
        match self.seqs.get(&id) {
            None => Err(Kind::Unknown(id)),
            Some(s) if s.swapped => Err(Kind::Swapped(id)),
            Some(s) => Ok(s),
        }
    }

    fn add(
        &mut self,
        id: u64,
        tokens: Option<Vec<u32>>,
        n: usize,
        extra: Option<u8>,
        scheduled: usize,
    ) -> Result<usize, Kind> {
        if self.seqs.contains_key(&id) {
            return Err(Kind::Exists(id));
        }
        let nb = self.blocks_for(n);
        if nb > self.num_blocks {
            return Err(Kind::Invalid);
        }
        let bs = self.block_size;
        let tokens = tokens.filter(|_| self.caching);
        let hits = match &tokens {
            Some(t) => self.walk(t, extra, n.saturating_sub(1) / bs),
            None => Vec::new(),
        };
        let revive = hits.iter().filter(|m| self.cached.contains(m)).count();
        let new = nb - hits.len();
        if new > self.pool_free() + self.cached.len() - revive {
            return Err(Kind::Oob(Tier::Device, new + revive, self.available()));
        }
        for &m in &hits {
            if let Some(pos) = self.cached.iter().position(|&c| c == m) {
                self.cached.remove(pos);
                self.refcounts.insert(m, 1);
            } else {
                *self.refcounts.get_mut(&m).unwrap() += 1;
            }
        }
        let mut blocks = hits.clone();
        blocks.extend(self.alloc_fresh(new));
        let hit = hits.len() * bs;
        let computed = hit + scheduled.min(n - hit);
        if let Some(t) = &tokens {
            for i in hits.len()..computed / bs {
                self.register(blocks[i], (extra, t[..(i + 1) * bs].to_vec()));
            }
        }
        self.hit_tokens += (hits.len() * bs) as u64;
        self.seqs.insert(
            id,
            MSeq {
                num_tokens: n,
                blocks,
                swapped: false,
                tokens,
                extra,
                computed,
            },
        );
        Ok(hits.len() * bs)
    }

    /// The chain of cached blocks (first copies) over `t`'s first `max_blocks` blocks.
    fn walk(&self, t: &[u32], extra: Option<u8>, max_blocks: usize) -> Vec<MBlock> {
        let bs = self.block_size;
        let mut hits = Vec::new();
        for i in 0..max_blocks.min(t.len() / bs) {
            match self.index.get(&(extra, t[..(i + 1) * bs].to_vec())) {
                Some(copies) => hits.push(copies[0]),
                None => break,
            }
        }
        hits
    }

    fn match_prefix(&self, t: &[u32], extra: Option<u8>) -> usize {
        if !self.caching {
            return 0;
        }
        self.walk(t, extra, t.len().saturating_sub(1) / self.block_size)
            .len()
            * self.block_size
    }

    fn unindex(&mut self, b: MBlock) {
        if let Some(key) = self.key_of.remove(&b) {
            let copies = self.index.get_mut(&key).unwrap();
            copies.retain(|&c| c != b);
            if copies.is_empty() {
                self.index.remove(&key);
            }
        }
    }

    fn advance(&mut self, ids: &[u64], n: usize) -> Result<(), Kind> {
        distinct(ids)?;
        for &id in ids {
            let s = self.resident(id)?;
            if n > s.num_tokens - s.computed {
                return Err(Kind::Invalid);
            }
        }
        let bs = self.block_size;
        for &id in ids {
            let mut s = self.seqs.remove(&id).unwrap();
            let old = s.computed;
            s.computed += n;
            if let Some(t) = &s.tokens {
                for i in old / bs..s.computed / bs {
                    self.register(s.blocks[i], (s.extra, t[..(i + 1) * bs].to_vec()));
                }
            }
            self.seqs.insert(id, s);
        }
        Ok(())
    }

    fn truncate(&mut self, id: u64, n: usize) -> Result<(), Kind> {
        let s = self.resident(id)?;
        if n > s.num_tokens {
            return Err(Kind::Invalid);
        }
        if n == s.num_tokens {
            return Ok(());
        }
        let bs = self.block_size;
        let mut s = self.seqs.remove(&id).unwrap();
        let computed = s.computed.min(n);
        if let Some(t) = &s.tokens {
            let (old_h, new_h) = (s.computed / bs, computed / bs);
            let recoverable = new_h == old_h
                || n % bs == 0
                || self.key_of.get(&s.blocks[new_h])
                    == Some(&(s.extra, t[..(new_h + 1) * bs].to_vec()));
            if recoverable {
                s.tokens.as_mut().unwrap().truncate(n);
            } else {
                s.tokens = None;
            }
        }
        let keep = self.blocks_for(n);
        let tail = s.blocks.split_off(keep);
        let kept_partial = (n % bs != 0).then(|| s.blocks[keep - 1]);
        for &b in tail.iter().rev().chain(kept_partial.iter()) {
            if self.key_of.contains_key(&b) && self.refcounts[&b] == 1 {
                self.unindex(b);
            }
        }
        for &b in tail.iter().rev() {
            self.release(b);
        }
        s.num_tokens = n;
        s.computed = computed;
        self.seqs.insert(id, s);
        Ok(())
    }

    fn pin_key(&self, t: &[u32], extra: Option<u8>) -> Key {
        (
            extra,
            t[..t.len() / self.block_size * self.block_size].to_vec(),
        )
    }

    fn pin(&mut self, t: &[u32], extra: Option<u8>) -> usize {
        if !self.caching {
            return 0;
        }
        let hits = self.walk(t, extra, usize::MAX);
        if hits.is_empty() {
            return 0;
        }
        for &b in &hits {
            if let Some(pos) = self.cached.iter().position(|&c| c == b) {
                self.cached.remove(pos);
                self.refcounts.insert(b, 1);
            } else {
                *self.refcounts.get_mut(&b).unwrap() += 1;
            }
            *self.pin_counts.entry(b).or_insert(0) += 1;
        }
        let n = hits.len() * self.block_size;
        let key = self.pin_key(t, extra);
        self.pins.entry(key).or_default().push(hits);
        n
    }

    fn unpin(&mut self, t: &[u32], extra: Option<u8>) -> Result<(), Kind> {
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

    /// Blocks an append needs; `released` counts CoW references dropped earlier in a batch.
    fn plan(
        &self,
        id: u64,
        n: usize,
        released: &mut HashMap<MBlock, u32>,
    ) -> Result<(usize, bool), Kind> {
        let s = self.resident(id)?;
        if s.computed < s.num_tokens {
            return Err(Kind::Invalid);
        }
        let new_len = s.num_tokens.checked_add(n).ok_or(Kind::Invalid)?;
        let nb = self.blocks_for(new_len);
        if nb > self.num_blocks {
            return Err(Kind::Invalid);
        }
        let partial = s.blocks.len() * self.block_size > s.num_tokens;
        let mut cow = false;
        if n > 0 && partial {
            let last = *s.blocks.last().unwrap();
            let r = released.entry(last).or_insert(0);
            if self.refcounts[&last] - *r > 1 {
                *r += 1;
                cow = true;
            } else if self.key_of.contains_key(&last) {
                // An indexed partial block (left by a truncate) is never written in place.
                cow = true;
            }
        }
        Ok((nb - s.blocks.len() + usize::from(cow), cow))
    }

    fn apply(
        &mut self,
        id: u64,
        n: usize,
        tokens: Option<&[u32]>,
        cow: bool,
        supply: &mut impl Iterator<Item = MBlock>,
    ) {
        let bs = self.block_size;
        let mut s = self.seqs.remove(&id).unwrap();
        let mut src = None;
        if cow {
            let dst = supply.next().unwrap();
            let old = std::mem::replace(s.blocks.last_mut().unwrap(), dst);
            self.pending_copies.push((old, dst));
            src = Some(old);
        }
        s.num_tokens += n;
        s.computed = s.num_tokens;
        while s.blocks.len() < self.blocks_for(s.num_tokens) {
            s.blocks.push(supply.next().unwrap());
        }
        if n > 0 {
            match (&mut s.tokens, tokens) {
                (Some(all), Some(new)) => {
                    for &t in new {
                        all.push(t);
                        if all.len() % bs == 0 {
                            let i = all.len() / bs - 1;
                            let key = (s.extra, all.clone());
                            self.register(s.blocks[i], key);
                        }
                    }
                }
                _ => s.tokens = None,
            }
        }
        self.seqs.insert(id, s);
        if let Some(old) = src {
            self.release(old);
        }
    }

    fn append(&mut self, id: u64, n: usize, tokens: Option<&[u32]>) -> Result<(), Kind> {
        let (need, cow) = self.plan(id, n, &mut HashMap::new())?;
        if need > self.available() {
            return Err(Kind::Oob(Tier::Device, need, self.available()));
        }
        let fresh = self.alloc_fresh(need);
        self.apply(id, n, tokens, cow, &mut fresh.into_iter());
        Ok(())
    }

    fn append_batch(
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
            let (need, cow) = self.plan(id, n, &mut released)?;
            total += need;
            plans.push(cow);
        }
        if n == 0 {
            return Ok(());
        }
        if total > self.num_blocks {
            return Err(Kind::Invalid);
        }
        if total > self.available() {
            return Err(Kind::Oob(Tier::Device, total, self.available()));
        }
        let mut supply = self.alloc_fresh(total).into_iter();
        for (row, (&id, cow)) in ids.iter().zip(plans).enumerate() {
            self.apply(id, n, tokens.map(|t| &t[row][..]), cow, &mut supply);
        }
        Ok(())
    }

    fn fork(&mut self, p: u64, c: u64) -> Result<(), Kind> {
        let parent = self.resident(p)?.clone();
        if self.seqs.contains_key(&c) {
            return Err(Kind::Exists(c));
        }
        if parent.computed < parent.num_tokens {
            return Err(Kind::Invalid);
        }
        for b in &parent.blocks {
            *self.refcounts.get_mut(b).unwrap() += 1;
        }
        self.seqs.insert(c, parent);
        Ok(())
    }

    fn free(&mut self, id: u64) -> Result<(), Kind> {
        let s = self.seqs.remove(&id).ok_or(Kind::Unknown(id))?;
        if s.swapped {
            for h in s.blocks {
                let rc = self.host_refs.get_mut(&h).unwrap();
                *rc -= 1;
                if *rc == 0 {
                    self.host_refs.remove(&h);
                }
            }
        } else {
            for &b in s.blocks.iter().rev() {
                self.release(b);
            }
        }
        Ok(())
    }

    fn free_batch(&mut self, ids: &[u64]) -> Result<(), Kind> {
        distinct(ids)?;
        if let Some(&id) = ids.iter().find(|id| !self.seqs.contains_key(id)) {
            return Err(Kind::Unknown(id));
        }
        for &id in ids {
            self.free(id).unwrap();
        }
        Ok(())
    }

    fn group(&self, ids: &[u64]) -> (Vec<MBlock>, Vec<u32>) {
        let mut blocks: Vec<MBlock> = Vec::new();
        let mut refs = Vec::new();
        for id in ids {
            for &b in &self.seqs[id].blocks {
                match blocks.iter().position(|&x| x == b) {
                    Some(i) => refs[i] += 1,
                    None => {
                        blocks.push(b);
                        refs.push(1);
                    }
                }
            }
        }
        (blocks, refs)
    }

    fn swap_out(&mut self, ids: &[u64]) -> Result<Vec<(MBlock, MBlock)>, Kind> {
        if self.num_host == 0 {
            return Err(Kind::Invalid);
        }
        distinct(ids)?;
        for &id in ids {
            self.resident(id)?;
        }
        let (blocks, refs) = self.group(ids);
        if blocks.len() > self.num_host {
            return Err(Kind::Invalid);
        }
        if blocks.len() > self.host_free() {
            return Err(Kind::Oob(Tier::Host, blocks.len(), self.host_free()));
        }
        let host: Vec<MBlock> = blocks.iter().map(|_| self.new_block()).collect();
        for (&h, &r) in host.iter().zip(&refs) {
            self.host_refs.insert(h, r);
        }
        for &id in ids {
            let mut s = self.seqs.remove(&id).unwrap();
            let device = std::mem::take(&mut s.blocks);
            s.blocks = device
                .iter()
                .map(|d| host[blocks.iter().position(|b| b == d).unwrap()])
                .collect();
            s.swapped = true;
            self.seqs.insert(id, s);
            for &d in device.iter().rev() {
                self.release(d);
            }
        }
        Ok(blocks.into_iter().zip(host).collect())
    }

    fn swap_in(&mut self, ids: &[u64]) -> Result<Vec<(MBlock, MBlock)>, Kind> {
        if self.num_host == 0 {
            return Err(Kind::Invalid);
        }
        distinct(ids)?;
        for &id in ids {
            match self.seqs.get(&id) {
                None => return Err(Kind::Unknown(id)),
                Some(s) if !s.swapped => return Err(Kind::Invalid),
                Some(_) => {}
            }
        }
        let (host, refs) = self.group(ids);
        if host.len() > self.num_blocks {
            return Err(Kind::Invalid);
        }
        if host.len() > self.available() {
            return Err(Kind::Oob(Tier::Device, host.len(), self.available()));
        }
        let device = self.alloc_fresh(host.len());
        for (&d, &r) in device.iter().zip(&refs) {
            self.refcounts.insert(d, r);
        }
        for &id in ids {
            let mut s = self.seqs.remove(&id).unwrap();
            for h in s.blocks.iter_mut() {
                let rc = self.host_refs.get_mut(h).unwrap();
                *rc -= 1;
                if *rc == 0 {
                    self.host_refs.remove(h);
                }
                *h = device[host.iter().position(|x| x == h).unwrap()];
            }
            s.swapped = false;
            self.seqs.insert(id, s);
        }
        Ok(host.into_iter().zip(device).collect())
    }

    fn reset(&mut self) -> bool {
        if !self.refcounts.is_empty() {
            return false;
        }
        self.cached.clear();
        self.index.clear();
        self.key_of.clear();
        true
    }
}

/// Keeps the model-block <-> physical-block renaming consistent across steps.
#[derive(Default)]
struct Names {
    device: HashMap<MBlock, BlockId>,
    host: HashMap<MBlock, BlockId>,
}

fn bind(names: &mut HashMap<MBlock, BlockId>, m: MBlock, p: BlockId) {
    let named = *names.entry(m).or_insert(p);
    assert_eq!(named, p, "model block {m} maps to two physical blocks");
}

fn check_bijection(names: &HashMap<MBlock, BlockId>) {
    let mut back: HashMap<BlockId, MBlock> = HashMap::new();
    for (&m, &p) in names {
        if let Some(other) = back.insert(p, m) {
            panic!("physical block {p} stands for model blocks {m} and {other}");
        }
    }
}

/// The manager's state must equal the model's up to renaming blocks.
fn compare(kv: &mut KvCacheManager, model: &Model, names: &mut Names) {
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_sequences(), model.seqs.len());
    assert_eq!(kv.num_available_blocks(), model.available());
    let stats = kv.stats();
    assert_eq!(stats.num_blocks_in_use, model.refcounts.len());
    assert_eq!(stats.num_cached_blocks, model.cached.len());
    assert_eq!(stats.blocks_evicted, model.evictions);
    assert_eq!(stats.prefix_hit_tokens, model.hit_tokens);
    assert_eq!(stats.num_pinned_blocks, model.pin_counts.len());
    assert_eq!(kv.num_free_host_blocks(), model.host_free());
    names
        .device
        .retain(|m, _| model.refcounts.contains_key(m) || model.key_of.contains_key(m));
    names.host.retain(|m, _| model.host_refs.contains_key(m));
    for (&id, s) in &model.seqs {
        assert_eq!(kv.num_tokens(id).unwrap(), s.num_tokens, "seq {id} tokens");
        assert_eq!(
            kv.num_computed_tokens(id).unwrap(),
            s.computed,
            "seq {id} computed"
        );
        assert_eq!(kv.is_swapped_out(id).unwrap(), s.swapped);
        if s.swapped {
            let table = kv.host_block_table(id).unwrap();
            assert_eq!(table.len(), s.blocks.len());
            for (&p, &m) in table.iter().zip(&s.blocks) {
                bind(&mut names.host, m, p);
                assert_eq!(
                    kv.host_refcount(p).unwrap(),
                    model.host_refs[&m],
                    "host refcount {p}"
                );
            }
        } else {
            let table = kv.block_table(id).unwrap();
            assert_eq!(table.len(), s.blocks.len(), "seq {id} table length");
            for (&p, &m) in table.iter().zip(&s.blocks) {
                bind(&mut names.device, m, p);
                assert_eq!(
                    kv.refcount(p).unwrap(),
                    model.refcounts[&m],
                    "refcount of block {p}"
                );
            }
        }
    }
    check_bijection(&names.device);
    check_bijection(&names.host);
    let cached: Vec<BlockId> = model
        .cached
        .iter()
        .map(|m| {
            *names
                .device
                .get(m)
                .expect("a cached block was once in a table")
        })
        .collect();
    assert_eq!(kv.cached_blocks(), cached, "cached blocks / LRU order");
}

fn check_mapping(
    got: &[(BlockId, BlockId)],
    want: &[(MBlock, MBlock)],
    src: &mut HashMap<MBlock, BlockId>,
    dst: &mut HashMap<MBlock, BlockId>,
) {
    assert_eq!(got.len(), want.len(), "swap mapping length");
    for (&(ps, pd), &(ms, md)) in got.iter().zip(want) {
        if let Some(&p) = src.get(&ms) {
            assert_eq!(p, ps, "swap source block");
        }
        bind(dst, md, pd);
    }
}

fn run(num_blocks: usize, block_size: usize, caching: bool, num_host: usize, ops: Vec<Op>) {
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size,
        enable_prefix_caching: caching,
        enable_kv_events: caching,
        num_host_blocks: num_host,
        hash_seed: 99,
        ..Default::default()
    })
    .unwrap();
    let mut model = Model {
        num_blocks,
        block_size,
        caching,
        num_host,
        seqs: BTreeMap::new(),
        refcounts: HashMap::new(),
        cached: Vec::new(),
        index: HashMap::new(),
        key_of: HashMap::new(),
        host_refs: HashMap::new(),
        next_block: 0,
        pending_copies: Vec::new(),
        evictions: 0,
        hit_tokens: 0,
        pins: HashMap::new(),
        pin_counts: HashMap::new(),
    };
    let mut names = Names::default();
    for op in ops {
        let len_of = |kv: &KvCacheManager, id: u64| kv.num_tokens(id).unwrap_or(0);
        let (got, want): (Result<usize, Error>, Result<usize, Kind>) = match &op {
            Op::Add(i, n) => (
                kv.add_sequence_len(*i, *n),
                model.add(*i, None, *n, None, usize::MAX),
            ),
            Op::AddLenScheduled(i, n, k) => (
                kv.add_sequence_len_scheduled(*i, *n, *k),
                model.add(*i, None, *n, None, *k),
            ),
            Op::AddScheduled {
                id,
                prompt,
                len,
                extra,
                scheduled,
            } => {
                let tokens = prompt_tokens(*prompt, *len);
                let extra_bytes = extra.map(|e| vec![e; 3]);
                (
                    kv.add_sequence_scheduled(*id, &tokens, extra_bytes.as_deref(), *scheduled),
                    model.add(*id, Some(tokens.clone()), *len, *extra, *scheduled),
                )
            }
            Op::Advance(ids, n) => (
                kv.advance_computed(ids, *n).map(|_| 0),
                model.advance(ids, *n).map(|_| 0),
            ),
            Op::Truncate(i, n) => (
                kv.truncate(*i, *n).map(|_| 0),
                model.truncate(*i, *n).map(|_| 0),
            ),
            Op::TruncateBack(i, back) => {
                let n = len_of(&kv, *i).saturating_sub(*back);
                (
                    kv.truncate(*i, n).map(|_| 0),
                    model.truncate(*i, n).map(|_| 0),
                )
            }
            Op::Match { prompt, len, extra } => {
                let tokens = prompt_tokens(*prompt, *len);
                let extra_bytes = extra.map(|e| vec![e; 3]);
                kv.take_events();
                let (stats, cached) = (kv.stats(), kv.cached_blocks());
                let got = kv.match_prefix(&tokens, extra_bytes.as_deref());
                assert_eq!(kv.stats(), stats, "match_prefix changed the stats");
                assert_eq!(kv.cached_blocks(), cached, "match_prefix changed the LRU");
                assert!(kv.take_events().is_empty(), "match_prefix recorded events");
                (got, Ok(model.match_prefix(&tokens, *extra)))
            }
            Op::Pin { prompt, len, extra } => {
                let tokens = prompt_tokens(*prompt, *len);
                let extra_bytes = extra.map(|e| vec![e; 3]);
                (
                    kv.pin_prefix(&tokens, extra_bytes.as_deref()),
                    Ok(model.pin(&tokens, *extra)),
                )
            }
            Op::Unpin { prompt, len, extra } => {
                let tokens = prompt_tokens(*prompt, *len);
                let extra_bytes = extra.map(|e| vec![e; 3]);
                (
                    kv.unpin_prefix(&tokens, extra_bytes.as_deref()).map(|_| 0),
                    model.unpin(&tokens, *extra).map(|_| 0),
                )
            }
            Op::AddPrompt {
                id,
                prompt,
                len,
                extra,
            } => {
                let tokens = prompt_tokens(*prompt, *len);
                let extra_bytes = extra.map(|e| vec![e; 3]);
                (
                    kv.add_sequence(*id, &tokens, extra_bytes.as_deref()),
                    model.add(*id, Some(tokens.clone()), *len, *extra, usize::MAX),
                )
            }
            Op::Append(i, n) => (
                kv.append_len(*i, *n).map(|_| 0),
                model.append(*i, *n, None).map(|_| 0),
            ),
            Op::AppendTokens(i, n) => {
                let tokens = next_tokens(len_of(&kv, *i), *n);
                (
                    kv.append_tokens(*i, &tokens).map(|_| 0),
                    model.append(*i, *n, Some(&tokens)).map(|_| 0),
                )
            }
            Op::AppendBatch { ids, n, tokens } => {
                if *tokens {
                    let rows: Vec<Vec<u32>> = ids
                        .iter()
                        .map(|&i| next_tokens(len_of(&kv, i), *n))
                        .collect();
                    let flat: Vec<u32> = rows.concat();
                    (
                        kv.append_tokens_batch(ids, &flat, *n).map(|_| 0),
                        model.append_batch(ids, *n, Some(&rows)).map(|_| 0),
                    )
                } else {
                    (
                        kv.append_len_batch(ids, *n).map(|_| 0),
                        model.append_batch(ids, *n, None).map(|_| 0),
                    )
                }
            }
            Op::Fork(p, c) => (kv.fork(*p, *c).map(|_| 0), model.fork(*p, *c).map(|_| 0)),
            Op::Free(i) => (kv.free(*i).map(|_| 0), model.free(*i).map(|_| 0)),
            Op::FreeBatch(ids) => (
                kv.free_batch(ids).map(|_| 0),
                model.free_batch(ids).map(|_| 0),
            ),
            Op::TakeCopyOps => {
                let got = kv.take_copy_ops();
                let want = std::mem::take(&mut model.pending_copies);
                assert_eq!(got.len(), want.len());
                for ((ps, pd), (ms, md)) in got.into_iter().zip(want) {
                    if let Some(&p) = names.device.get(&ms) {
                        assert_eq!(p, ps, "copy src");
                    }
                    if let Some(&p) = names.device.get(&md) {
                        assert_eq!(p, pd, "copy dst");
                    }
                    assert_ne!(ps, pd);
                }
                (Ok(0), Ok(0))
            }
            Op::SwapOut(ids) => {
                let got = kv.swap_out(ids);
                let want = model.swap_out(ids);
                if let (Ok(g), Ok(w)) = (&got, &want) {
                    check_mapping(g, w, &mut names.device, &mut names.host);
                }
                (got.map(|_| 0), want.map(|_| 0))
            }
            Op::SwapIn(ids) => {
                let got = kv.swap_in(ids);
                let want = model.swap_in(ids);
                if let (Ok(g), Ok(w)) = (&got, &want) {
                    check_mapping(g, w, &mut names.host, &mut names.device);
                }
                (got.map(|_| 0), want.map(|_| 0))
            }
            Op::Reset => (
                Ok(usize::from(kv.reset_prefix_cache())),
                Ok(usize::from(model.reset())),
            ),
        };
        match (&got, &want) {
            (Ok(g), Ok(w)) => assert_eq!(g, w, "{op:?}: return value"),
            (Err(e), Err(k)) => assert_eq!(&kind(e), k, "{op:?}"),
            _ => panic!("{op:?}: manager {got:?}, model {want:?}"),
        }
        compare(&mut kv, &model, &mut names);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, max_shrink_iters: 4000, ..ProptestConfig::default() })]

    #[test]
    fn manager_matches_model(
        num_blocks in 1usize..12,
        block_size in 1usize..5,
        caching in any::<bool>(),
        num_host in prop_oneof![Just(0usize), 1usize..12],
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(num_blocks, block_size, caching, num_host, ops);
    }
}
