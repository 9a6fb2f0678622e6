//! Model-based test: random operation sequences against a tiny reference model, with
//! `check_invariants()` and a structural comparison after every step.
//!
//! The model tracks each sequence's token count and its blocks as abstract ids with refcounts.
//! After each step the manager's tables must match the model's up to a renaming of blocks
//! (a bijection model block <-> physical block), refcounts must agree, and errors must be the
//! ones the model predicts (same variant, same numbers).

use std::collections::{BTreeMap, HashMap};

use pagedkv::{BlockId, Error, KvCacheManager, ManagerConfig, Tier};
use proptest::prelude::*;

type MBlock = u64;

#[derive(Debug, Clone)]
enum Op {
    Add(u64, usize),
    AddTokens(u64, usize),
    Append(u64, usize),
    AppendTokens(u64, usize),
    AppendBatch(Vec<u64>, usize),
    Fork(u64, u64),
    Free(u64),
    FreeBatch(Vec<u64>),
    TakeCopyOps,
}

fn count() -> impl Strategy<Value = usize> {
    prop_oneof![8 => 0usize..12, 1 => 12usize..40, 1 => Just(usize::MAX), 1 => Just(usize::MAX / 2)]
}

fn id() -> impl Strategy<Value = u64> {
    0u64..6
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (id(), count()).prop_map(|(i, n)| Op::Add(i, n)),
        2 => (id(), 0usize..12).prop_map(|(i, n)| Op::AddTokens(i, n)),
        4 => (id(), count()).prop_map(|(i, n)| Op::Append(i, n)),
        2 => (id(), 0usize..6).prop_map(|(i, n)| Op::AppendTokens(i, n)),
        2 => (prop::collection::vec(id(), 0..4), 0usize..4).prop_map(|(v, n)| Op::AppendBatch(v, n)),
        3 => (id(), id()).prop_map(|(p, c)| Op::Fork(p, c)),
        3 => id().prop_map(Op::Free),
        1 => prop::collection::vec(id(), 0..3).prop_map(Op::FreeBatch),
        1 => Just(Op::TakeCopyOps),
    ]
}

#[derive(Debug, Clone)]
struct MSeq {
    num_tokens: usize,
    blocks: Vec<MBlock>,
}

#[derive(Debug)]
struct Model {
    num_blocks: usize,
    block_size: usize,
    seqs: BTreeMap<u64, MSeq>,
    refcounts: HashMap<MBlock, u32>,
    next_block: MBlock,
    /// Model blocks created by copy-on-write and not yet drained by take_copy_ops: (src, dst).
    pending_copies: Vec<(MBlock, MBlock)>,
}

#[derive(Debug, PartialEq)]
enum Kind {
    Unknown(u64),
    Exists(u64),
    Invalid,
    Oob(usize, usize),
}

fn kind(e: &Error) -> Kind {
    match e {
        Error::UnknownSequence(i) => Kind::Unknown(*i),
        Error::SequenceExists(i) => Kind::Exists(*i),
        Error::InvalidArgument(_) => Kind::Invalid,
        Error::OutOfBlocks { tier: Tier::Device, needed_blocks, available_blocks } => {
            Kind::Oob(*needed_blocks, *available_blocks)
        }
        other => panic!("unexpected error variant {other:?}"),
    }
}

impl Model {
    fn free_blocks(&self) -> usize {
        self.num_blocks - self.refcounts.len()
    }

    fn blocks_for(&self, n: usize) -> usize {
        n.div_ceil(self.block_size)
    }

    fn fresh(&mut self) -> MBlock {
        self.next_block += 1;
        self.refcounts.insert(self.next_block, 1);
        self.next_block
    }

    fn release(&mut self, b: MBlock) {
        let rc = self.refcounts.get_mut(&b).unwrap();
        *rc -= 1;
        if *rc == 0 {
            self.refcounts.remove(&b);
        }
    }

    fn add(&mut self, id: u64, n: usize) -> Result<(), Kind> {
        if self.seqs.contains_key(&id) {
            return Err(Kind::Exists(id));
        }
        let need = self.blocks_for(n);
        if need > self.num_blocks {
            return Err(Kind::Invalid);
        }
        if need > self.free_blocks() {
            return Err(Kind::Oob(need, self.free_blocks()));
        }
        let blocks = (0..need).map(|_| self.fresh()).collect();
        self.seqs.insert(id, MSeq { num_tokens: n, blocks });
        Ok(())
    }

    /// Blocks an append needs; `released` counts CoW references dropped earlier in a batch.
    fn plan(&self, id: u64, n: usize, released: &mut HashMap<MBlock, u32>) -> Result<(usize, bool), Kind> {
        let s = self.seqs.get(&id).ok_or(Kind::Unknown(id))?;
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
            }
        }
        Ok((nb - s.blocks.len() + usize::from(cow), cow))
    }

    fn apply(&mut self, id: u64, n: usize, cow: bool) {
        let mut s = self.seqs.remove(&id).unwrap();
        if cow {
            let dst = self.fresh();
            let src = std::mem::replace(s.blocks.last_mut().unwrap(), dst);
            self.pending_copies.push((src, dst));
            self.release(src);
        }
        s.num_tokens += n;
        while s.blocks.len() < self.blocks_for(s.num_tokens) {
            let b = self.fresh();
            s.blocks.push(b);
        }
        self.seqs.insert(id, s);
    }

    fn append(&mut self, id: u64, n: usize) -> Result<(), Kind> {
        let (need, cow) = self.plan(id, n, &mut HashMap::new())?;
        if need > self.free_blocks() {
            return Err(Kind::Oob(need, self.free_blocks()));
        }
        self.apply(id, n, cow);
        Ok(())
    }

    fn append_batch(&mut self, ids: &[u64], n: usize) -> Result<(), Kind> {
        let mut distinct = ids.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() != ids.len() {
            return Err(Kind::Invalid);
        }
        let mut released = HashMap::new();
        let mut plans = Vec::new();
        let mut total = 0;
        for &id in ids {
            let (need, cow) = self.plan(id, n, &mut released)?;
            total += need;
            plans.push(cow);
        }
        if total > self.num_blocks {
            return Err(Kind::Invalid);
        }
        if total > self.free_blocks() {
            return Err(Kind::Oob(total, self.free_blocks()));
        }
        for (&id, cow) in ids.iter().zip(plans) {
            self.apply(id, n, cow);
        }
        Ok(())
    }

    fn fork(&mut self, p: u64, c: u64) -> Result<(), Kind> {
        let parent = self.seqs.get(&p).ok_or(Kind::Unknown(p))?.clone();
        if self.seqs.contains_key(&c) {
            return Err(Kind::Exists(c));
        }
        for b in &parent.blocks {
            *self.refcounts.get_mut(b).unwrap() += 1;
        }
        self.seqs.insert(c, parent);
        Ok(())
    }

    fn free(&mut self, id: u64) -> Result<(), Kind> {
        let s = self.seqs.remove(&id).ok_or(Kind::Unknown(id))?;
        for b in s.blocks {
            self.release(b);
        }
        Ok(())
    }

    fn free_batch(&mut self, ids: &[u64]) -> Result<(), Kind> {
        let mut distinct = ids.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() != ids.len() {
            return Err(Kind::Invalid);
        }
        if let Some(&id) = ids.iter().find(|id| !self.seqs.contains_key(id)) {
            return Err(Kind::Unknown(id));
        }
        for &id in ids {
            self.free(id).unwrap();
        }
        Ok(())
    }
}

/// The manager's state must equal the model's up to renaming blocks.
fn compare(kv: &KvCacheManager, model: &Model, names: &mut HashMap<MBlock, BlockId>) {
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_sequences(), model.seqs.len());
    assert_eq!(kv.num_free_blocks(), model.free_blocks());
    assert_eq!(kv.stats().num_blocks_in_use, model.refcounts.len());
    names.retain(|m, _| model.refcounts.contains_key(m));
    let mut reverse: HashMap<BlockId, MBlock> = names.iter().map(|(&m, &p)| (p, m)).collect();
    for (&id, s) in &model.seqs {
        assert_eq!(kv.num_tokens(id).unwrap(), s.num_tokens, "seq {id} tokens");
        let table = kv.block_table(id).unwrap();
        assert_eq!(table.len(), s.blocks.len(), "seq {id} table length");
        for (&p, &m) in table.iter().zip(&s.blocks) {
            let named = *names.entry(m).or_insert(p);
            assert_eq!(named, p, "model block {m} maps to two physical blocks");
            let back = *reverse.entry(p).or_insert(m);
            assert_eq!(back, m, "physical block {p} stands for two model blocks");
            assert_eq!(kv.refcount(p).unwrap(), model.refcounts[&m], "refcount of block {p}");
        }
    }
}

fn run(num_blocks: usize, block_size: usize, ops: Vec<Op>) {
    let mut kv = KvCacheManager::new(ManagerConfig { num_blocks, block_size, ..Default::default() }).unwrap();
    let mut model = Model {
        num_blocks,
        block_size,
        seqs: BTreeMap::new(),
        refcounts: HashMap::new(),
        next_block: 0,
        pending_copies: Vec::new(),
    };
    let mut names = HashMap::new();
    let mut token = 0u32;
    let mut tokens = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                token = token.wrapping_add(1);
                token % 7
            })
            .collect()
    };
    for op in ops {
        let (got, want) = match &op {
            Op::Add(i, n) => (kv.add_sequence_len(*i, *n).map(|_| ()), model.add(*i, *n)),
            Op::AddTokens(i, n) => (kv.add_sequence(*i, &tokens(*n), None).map(|_| ()), model.add(*i, *n)),
            Op::Append(i, n) => (kv.append_len(*i, *n), model.append(*i, *n)),
            Op::AppendTokens(i, n) => (kv.append_tokens(*i, &tokens(*n)), model.append(*i, *n)),
            Op::AppendBatch(ids, n) => (kv.append_len_batch(ids, *n), model.append_batch(ids, *n)),
            Op::Fork(p, c) => (kv.fork(*p, *c), model.fork(*p, *c)),
            Op::Free(i) => (kv.free(*i), model.free(*i)),
            Op::FreeBatch(ids) => (kv.free_batch(ids), model.free_batch(ids)),
            Op::TakeCopyOps => {
                let got = kv.take_copy_ops();
                let want = std::mem::take(&mut model.pending_copies);
                assert_eq!(got.len(), want.len());
                for ((ps, pd), (ms, md)) in got.into_iter().zip(want) {
                    // src may have been freed since; dst may too. Check live ones.
                    if let Some(&p) = names.get(&ms) {
                        assert_eq!(p, ps, "copy src");
                    }
                    if let Some(&p) = names.get(&md) {
                        assert_eq!(p, pd, "copy dst");
                    }
                    assert_ne!(ps, pd);
                }
                (Ok(()), Ok(()))
            }
        };
        match (&got, &want) {
            (Ok(()), Ok(())) => {}
            (Err(e), Err(k)) => assert_eq!(&kind(e), k, "{op:?}"),
            _ => panic!("{op:?}: manager {got:?}, model {want:?}"),
        }
        compare(&kv, &model, &mut names);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, max_shrink_iters: 2000, ..ProptestConfig::default() })]

    #[test]
    fn manager_matches_model(
        num_blocks in 1usize..12,
        block_size in 1usize..5,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(num_blocks, block_size, ops);
    }
}
