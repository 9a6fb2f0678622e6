//! The index's model test: every answer compared with a plain map of one block per content
//! (see `index.rs`).

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;
use crate::prefix::hash::BlockHasher;

const BS: usize = 2;
const NUM_BLOCKS: usize = 12;

/// The plain index: each indexed content on one block, and which blocks are in use.
#[derive(Default)]
struct Reference {
    block_of: HashMap<BlockHash, BlockId>,
    hash_of: HashMap<BlockId, BlockHash>,
    in_use: HashSet<BlockId>,
}

impl Reference {
    /// What entering `b` under `h` must do: one copy per content, the one in use.
    fn insert(&mut self, b: BlockId, h: BlockHash) -> Entered {
        if self.hash_of.contains_key(&b) {
            return Entered::Refused;
        }
        match self.block_of.get(&h).copied() {
            Some(x) if self.in_use.contains(&x) => Entered::Duplicate,
            Some(x) => {
                self.hash_of.remove(&x);
                self.block_of.insert(h, b);
                self.hash_of.insert(b, h);
                Entered::Replaced(x)
            }
            None => {
                self.block_of.insert(h, b);
                self.hash_of.insert(b, h);
                Entered::New
            }
        }
    }

    fn remove(&mut self, b: BlockId) -> Option<BlockHash> {
        let h = self.hash_of.remove(&b)?;
        self.block_of.remove(&h);
        Some(h)
    }

    /// What a walk of `hashes` hits: each content's block, up to the first miss.
    fn walk(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|h| self.block_of.get(h).copied())
            .collect()
    }

    /// Blocks neither indexed nor in use (what an admission may take as fresh).
    fn free(&self) -> Vec<BlockId> {
        (0..NUM_BLOCKS as BlockId)
            .filter(|b| !self.hash_of.contains_key(b) && !self.in_use.contains(b))
            .collect()
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Admit a prompt of these blocks' contents into free blocks picked by `pick`, as the
    /// manager does: a walk, the first new block entered with `insert`, the run after a new
    /// one chained unless its parent hash may have orphans.
    Admit {
        prompt: Vec<u8>,
        pick: usize,
    },
    /// Register the prompt's last block on a free block, after `parent`: 0 the block holding
    /// the parent content, 1 a free (unindexed) block, a private copy or a swapped-in table,
    /// 2 none.
    Register {
        prompt: Vec<u8>,
        pick: usize,
        parent: u8,
    },
    /// Remove the `k`-th indexed block (mod their number).
    Remove(usize),
    /// Flip whether the `k`-th indexed block is in use (a release or a revival).
    Use(usize),
    /// Release every block (all cached-evictable, none in use).
    ReleaseAll,
    Walk(Vec<u8>),
}

fn prompt() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0u8..3, 1..=4)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prompt(), any::<usize>()).prop_map(|(prompt, pick)| Op::Admit { prompt, pick }),
        2 => (prompt(), any::<usize>(), 0u8..3)
            .prop_map(|(prompt, pick, parent)| Op::Register { prompt, pick, parent }),
        3 => any::<usize>().prop_map(Op::Remove),
        2 => any::<usize>().prop_map(Op::Use),
        1 => Just(Op::ReleaseAll),
        1 => prompt().prop_map(Op::Walk),
    ]
}

struct Model {
    idx: BlockIndex,
    reference: Reference,
    hasher: BlockHasher,
}

type Link = (Option<BlockHash>, [TokenId; BS], BlockHash);

impl Model {
    /// Each block's (parent hash, tokens, hash) along `prompt`.
    fn chain(&self, prompt: &[u8]) -> Vec<Link> {
        let mut parent = None;
        prompt
            .iter()
            .map(|&t| {
                let tokens = [TokenId::from(t), 7];
                let h = self.hasher.hash_block(parent, &tokens, None);
                let link = (parent, tokens, h);
                parent = Some(h);
                link
            })
            .collect()
    }

    /// The blocks the manager's walk hits: the child hint of the block before, else the
    /// map. With one block per content, exactly the reference's walk.
    fn walk(&self, prompt: &[u8]) -> Vec<BlockId> {
        let chain = self.chain(prompt);
        let mut hits: Vec<BlockId> = Vec::new();
        for &(parent, tokens, h) in &chain {
            let hinted = match (hits.last(), parent) {
                (Some(&pb), Some(ph)) => self.idx.lookup_child(pb, ph, &tokens, None),
                _ => None,
            };
            let found =
                hinted.or_else(|| self.idx.lookup(h, parent, &tokens, None).map(|b| (b, h)));
            let Some((b, found_hash)) = found else { break };
            assert_eq!(
                found_hash, h,
                "walk {prompt:?}: block {b} under another hash"
            );
            hits.push(b);
        }
        let hashes: Vec<BlockHash> = chain.iter().map(|l| l.2).collect();
        assert_eq!(hits, self.reference.walk(&hashes), "walk {prompt:?}");
        hits
    }

    fn insert(
        &mut self,
        b: BlockId,
        chain: &[Link],
        i: usize,
        parent_block: Option<BlockId>,
    ) -> Entered {
        let (parent, tokens, h) = chain[i];
        let hashes: Vec<BlockHash> = chain[..i].iter().map(|l| l.2).collect();
        let in_use = self.reference.in_use.clone();
        let entered = self
            .idx
            .insert(b, h, parent, parent_block, &hashes, &tokens, &None, |x| {
                in_use.contains(&x)
            });
        assert_eq!(entered, self.reference.insert(b, h), "insert block {b}");
        entered
    }

    fn admit(&mut self, prompt: &[u8], pick: usize) {
        let hits = self.walk(prompt);
        let chain = self.chain(prompt);
        let free = self.reference.free();
        let new = chain.len() - hits.len();
        if free.len() < new {
            return;
        }
        let mut fresh: Vec<BlockId> = (0..new).map(|i| free[(pick + i) % free.len()]).collect();
        fresh.sort_unstable();
        fresh.dedup();
        if fresh.len() < new {
            return;
        }
        self.reference.in_use.extend(hits.iter().chain(&fresh));
        let mut table = hits;
        let mut after_new = false;
        for &b in &fresh {
            let i = table.len();
            let (parent, tokens, h) = chain[i];
            let p = table.last().copied();
            if after_new && !self.idx.may_have_orphans_of(parent.unwrap()) {
                self.idx
                    .insert_chained(p.unwrap(), b, parent.unwrap(), h, &tokens, &None);
                assert_eq!(self.reference.insert(b, h), Entered::New, "chained {b}");
            } else {
                after_new = self.insert(b, &chain, i, p).is_new();
            }
            table.push(b);
        }
    }

    fn register(&mut self, prompt: &[u8], pick: usize, parent_choice: u8) {
        let chain = self.chain(prompt);
        let free = self.reference.free();
        if free.len() < 2 {
            return;
        }
        let b = free[pick % free.len()];
        let n = chain.len();
        let parent_block = match (parent_choice, n) {
            (2, _) | (_, 1) => None,
            (1, _) => Some(free[(pick + 1) % free.len()]),
            (_, n) => match self.reference.block_of.get(&chain[n - 2].2) {
                Some(&q) => Some(q),
                None => return,
            },
        };
        if parent_block == Some(b) {
            return;
        }
        self.reference.in_use.insert(b);
        self.insert(b, &chain, n - 1, parent_block);
    }

    fn nth_indexed(&self, k: usize) -> Option<BlockId> {
        let mut indexed: Vec<BlockId> = self.reference.hash_of.keys().copied().collect();
        indexed.sort_unstable();
        indexed.get(k % indexed.len().max(1)).copied()
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Admit { prompt, pick } => self.admit(prompt, *pick),
            Op::Register {
                prompt,
                pick,
                parent,
            } => self.register(prompt, *pick, *parent),
            Op::Remove(k) => {
                if let Some(b) = self.nth_indexed(*k) {
                    assert_eq!(self.idx.remove(b), self.reference.remove(b), "remove {b}");
                    self.reference.in_use.remove(&b);
                }
            }
            Op::Use(k) => {
                if let Some(b) = self.nth_indexed(*k) {
                    if !self.reference.in_use.remove(&b) {
                        self.reference.in_use.insert(b);
                    }
                }
            }
            Op::ReleaseAll => self.reference.in_use.clear(),
            Op::Walk(prompt) => {
                self.walk(prompt);
            }
        }
        // A block in use that is not indexed stays private until released.
        self.idx.check_invariants(&self.hasher).unwrap();
        for b in 0..NUM_BLOCKS as BlockId {
            assert_eq!(self.idx.hash_of(b), self.reference.hash_of.get(&b).copied());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn index_answers_as_a_map_of_one_block_per_content(ops in prop::collection::vec(op(), 1..60)) {
        let mut m = Model {
            idx: BlockIndex::new(NUM_BLOCKS, BS),
            reference: Reference::default(),
            hasher: BlockHasher::new(3),
        };
        for op in &ops {
            m.step(op);
        }
        // Every prompt over the alphabet, walked at the end.
        for a in 0..3u8 {
            for b in 0..3u8 {
                for c in 0..3u8 {
                    m.walk(&[a, b, c]);
                }
            }
        }
    }
}
