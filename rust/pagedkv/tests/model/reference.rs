//! The reference model of `tests/model.rs`: each sequence's token count and blocks as abstract
//! ids with refcounts, the prefix index keyed by the exact (extra key, full token prefix), the
//! LRU of cached blocks, pins, the computed watermark and the host tier; every operation
//! returns the result (or the error) the manager must give.

use std::collections::{BTreeMap, HashMap};

use pagedkv::{Error, Tier};

pub type MBlock = u64;
pub type Key = (Option<u8>, Vec<u32>);

#[derive(Debug, Clone)]
pub struct MSeq {
    pub num_tokens: usize,
    /// Device model blocks while resident, host model blocks while swapped.
    pub blocks: Vec<MBlock>,
    pub swapped: bool,
    /// All token ids while known and caching is on.
    pub tokens: Option<Vec<u32>>,
    pub extra: Option<u8>,
    /// Tokens computed (the watermark; blocks wholly below it are indexed).
    pub computed: usize,
}

#[derive(Debug)]
pub struct Model {
    pub num_blocks: usize,
    pub block_size: usize,
    pub caching: bool,
    pub num_host: usize,
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
    pub pins: HashMap<Key, Vec<Vec<MBlock>>>,
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
    pub fn pool_free(&self) -> usize {
        self.num_blocks - self.refcounts.len() - self.cached.len()
    }

    pub fn available(&self) -> usize {
        self.pool_free() + self.cached.len()
    }

    pub fn host_free(&self) -> usize {
        self.num_host - self.host_refs.len()
    }

    pub fn blocks_for(&self, n: usize) -> usize {
        n.div_ceil(self.block_size)
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
                let key = self.key_of.remove(&victim).unwrap();
                self.index.remove(&key);
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

    pub fn resident(&self, id: u64) -> Result<&MSeq, Kind> {
        match self.seqs.get(&id) {
            None => Err(Kind::Unknown(id)),
            Some(s) if s.swapped => Err(Kind::Swapped(id)),
            Some(s) => Ok(s),
        }
    }

    pub fn add(
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

    /// The chain of cached blocks over `t`'s first `max_blocks` blocks.
    pub fn walk(&self, t: &[u32], extra: Option<u8>, max_blocks: usize) -> Vec<MBlock> {
        let bs = self.block_size;
        let mut hits = Vec::new();
        for i in 0..max_blocks.min(t.len() / bs) {
            match self.index.get(&(extra, t[..(i + 1) * bs].to_vec())) {
                Some(&b) => hits.push(b),
                None => break,
            }
        }
        hits
    }

    pub fn match_prefix(&self, t: &[u32], extra: Option<u8>) -> usize {
        if !self.caching {
            return 0;
        }
        self.walk(t, extra, t.len().saturating_sub(1) / self.block_size)
            .len()
            * self.block_size
    }

    pub fn unindex(&mut self, b: MBlock) {
        if let Some(key) = self.key_of.remove(&b) {
            self.index.remove(&key);
        }
    }

    pub fn advance(&mut self, ids: &[u64], n: usize) -> Result<(), Kind> {
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

    pub fn truncate(&mut self, id: u64, n: usize) -> Result<(), Kind> {
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

    pub fn pin_key(&self, t: &[u32], extra: Option<u8>) -> Key {
        (
            extra,
            t[..t.len() / self.block_size * self.block_size].to_vec(),
        )
    }

    pub fn pin(&mut self, t: &[u32], extra: Option<u8>) -> usize {
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

    /// Blocks an append needs; `released` counts CoW references dropped earlier in a batch.
    pub fn plan(
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

    pub fn apply(
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

    pub fn append(&mut self, id: u64, n: usize, tokens: Option<&[u32]>) -> Result<(), Kind> {
        let (need, cow) = self.plan(id, n, &mut HashMap::new())?;
        if need > self.available() {
            return Err(Kind::Oob(Tier::Device, need, self.available()));
        }
        let fresh = self.alloc_fresh(need);
        self.apply(id, n, tokens, cow, &mut fresh.into_iter());
        Ok(())
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

    pub fn fork(&mut self, p: u64, c: u64) -> Result<(), Kind> {
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

    pub fn free(&mut self, id: u64) -> Result<(), Kind> {
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

    pub fn group(&self, ids: &[u64]) -> (Vec<MBlock>, Vec<u32>) {
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

    pub fn swap_out(&mut self, ids: &[u64]) -> Result<Vec<(MBlock, MBlock)>, Kind> {
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

    pub fn swap_in(&mut self, ids: &[u64]) -> Result<Vec<(MBlock, MBlock)>, Kind> {
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
