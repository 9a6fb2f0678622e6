//! The cache-aware queue against a reference computed from scratch after every operation, on a
//! real `KvCacheManager`: every waiting request's predicted hit equals `match_prefix`; the
//! longest-prefix choice is the best (hit, arrival); the depth-first choice is one a from-scratch
//! depth-first walk could make; no request is passed over more than the aging bound; the index's
//! own invariants hold.

use std::collections::{BTreeMap, HashMap};

use pagedkv::{splitmix64, Error, KvCacheManager, ManagerConfig, TokenId};
use pagedkv_sim::{CacheAwareQueue, Scheduling};
use proptest::prelude::*;

const BS: usize = 2;

/// A prompt: `levels` blocks down a tree whose branch at each level is one of a few (many at the
/// first level, so that the root is wide), then `tail` tokens of its own.
fn prompt(branches: &[u8], tail: usize, id: u64) -> Vec<TokenId> {
    let mut code = 0x5EEDu64;
    let mut tokens = Vec::new();
    for &b in branches {
        code = splitmix64::mix(code ^ u64::from(b) << 8);
        tokens.extend((0..BS as u64).map(|j| (splitmix64::mix(code ^ j) >> 40) as TokenId));
    }
    tokens.extend(
        (0..tail as u64).map(|j| (splitmix64::mix(id << 20 ^ j) >> 40) as TokenId | 1 << 30),
    );
    tokens
}

#[derive(Debug, Clone)]
enum Op {
    /// A request arrives: its branches and tail.
    Push(Vec<u8>, usize),
    /// The queue's choice is admitted (if it fits).
    Admit,
    /// A running sequence (by index) finishes.
    Free(usize),
    /// A running sequence (by index) decodes `n` tokens (may store and evict blocks).
    Decode(usize, usize),
    /// Every running sequence finishes and the prefix cache is emptied (`AllBlocksCleared`).
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (prop::collection::vec(0u8..3, 0..4), 0usize..3).prop_map(|(mut b, t)| {
            if let Some(first) = b.first_mut() {
                *first = first.wrapping_mul(5) % 12; // up to 12 first blocks: a wide root
            }
            Op::Push(b, t)
        }),
        12 => Just(Op::Admit),
        4 => (0usize..8).prop_map(Op::Free),
        4 => (0usize..8, 1usize..5).prop_map(|(i, n)| Op::Decode(i, n)),
        1 => Just(Op::Reset),
    ]
}

/// Whether the first `depth` blocks of `tokens` are all cached.
fn cached_prefix(kv: &KvCacheManager, tokens: &[TokenId], depth: usize) -> bool {
    if depth == 0 {
        return true;
    }
    let mut probe = tokens[..depth * BS].to_vec();
    probe.push(u32::MAX); // one more token: the whole prefix is eligible
    kv.match_prefix(&probe, None).unwrap() == depth * BS
}

/// Every request a depth-first walk could choose (children by cached, then oldest request),
/// resuming at the deepest block of the last admitted prompt (`cursor`) that a waiting request
/// shares.
fn dfs_choices(
    kv: &KvCacheManager,
    waiting: &BTreeMap<u64, (u64, Vec<TokenId>)>,
    cursor: &[TokenId],
) -> Vec<u64> {
    fn walk(
        kv: &KvCacheManager,
        waiting: &BTreeMap<u64, (u64, Vec<TokenId>)>,
        prefix: &[TokenId],
        out: &mut Vec<u64>,
    ) {
        let depth = prefix.len() / BS;
        // Requests through this prefix, by the block after it (None: ending here).
        let mut children: HashMap<Vec<TokenId>, u64> = HashMap::new();
        let mut enders: Vec<(u64, u64)> = Vec::new();
        for (&id, (rank, tokens)) in waiting {
            let full = tokens.len() / BS;
            if full < depth || tokens[..depth * BS] != *prefix {
                continue;
            }
            if full == depth {
                enders.push((*rank, id));
            } else {
                let oldest = children
                    .entry(tokens[depth * BS..(depth + 1) * BS].to_vec())
                    .or_insert(u64::MAX);
                *oldest = (*oldest).min(*rank);
            }
        }
        let key = |block: &Vec<TokenId>| {
            let mut next = prefix.to_vec();
            next.extend(block);
            (
                cached_prefix(kv, &next, depth + 1),
                std::cmp::Reverse(children[block]),
            )
        };
        let best = children.keys().map(key).max();
        let descend = |out: &mut Vec<u64>| {
            for block in children.keys() {
                if Some(key(block)) == best {
                    let mut next = prefix.to_vec();
                    next.extend(block);
                    walk(kv, waiting, &next, out);
                }
            }
        };
        match best {
            Some((true, _)) => descend(out),
            _ if !enders.is_empty() => out.push(enders.iter().min().unwrap().1),
            Some(_) => descend(out),
            None => {}
        }
    }
    let shares = |depth: usize| {
        waiting
            .values()
            .any(|(_, t)| t.len() >= depth * BS && t[..depth * BS] == cursor[..depth * BS])
    };
    let depth = (0..=cursor.len() / BS)
        .take_while(|&d| shares(d))
        .last()
        .unwrap_or(0);
    let mut out = Vec::new();
    walk(kv, waiting, &cursor[..depth * BS], &mut out);
    out
}

/// `queue_aware`: the queue's eviction marks drive the allocator's queue-aware eviction, and
/// the hashes they leave marked must be exactly those of the waiting requests' chains.
fn run(
    policy: Scheduling,
    aging_bound: usize,
    num_blocks: usize,
    ops: Vec<Op>,
    queue_aware: bool,
) -> Result<(), TestCaseError> {
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size: BS,
        enable_prefix_caching: true,
        enable_kv_events: true,
        max_events: usize::MAX,
        ..Default::default()
    })
    .unwrap();
    let mut queue = CacheAwareQueue::new(policy, aging_bound);
    if queue_aware {
        queue.record_eviction_marks();
    }
    let (mut marks, mut wanted) = (Vec::new(), std::collections::HashSet::new());
    // id -> (rank, prompt)
    let mut waiting: BTreeMap<u64, (u64, Vec<TokenId>)> = BTreeMap::new();
    let mut running: Vec<u64> = Vec::new();
    let mut admitted_ranks: Vec<u64> = Vec::new();
    let mut cursor: Vec<TokenId> = Vec::new();
    let mut next_id = 0u64;
    for op in ops {
        match op {
            Op::Push(branches, tail) => {
                let tokens = prompt(&branches, tail, next_id);
                if tokens.is_empty() {
                    continue;
                }
                let hashes = kv.prefix_block_hashes(&tokens, None);
                let rank = queue
                    .push(next_id, &hashes, (tokens.len() - 1) / BS)
                    .unwrap();
                waiting.insert(next_id, (rank, tokens));
                next_id += 1;
            }
            Op::Admit => {
                let Some(id) = queue.peek() else {
                    prop_assert!(waiting.is_empty());
                    continue;
                };
                // The reference choice.
                let (head, (head_rank, _)) = waiting.iter().min_by_key(|(_, (r, _))| *r).unwrap();
                let head_passes = admitted_ranks.iter().filter(|&&a| a > *head_rank).count();
                if head_passes >= aging_bound {
                    prop_assert_eq!(id, *head, "the aging bound forces the oldest request");
                } else if policy == Scheduling::Lpm {
                    let best = waiting
                        .iter()
                        .map(|(&i, (r, t))| {
                            (std::cmp::Reverse(kv.match_prefix(t, None).unwrap()), *r, i)
                        })
                        .min()
                        .unwrap();
                    prop_assert_eq!(id, best.2, "longest prefix, earliest on ties");
                } else {
                    let choices = dfs_choices(&kv, &waiting, &cursor);
                    prop_assert!(
                        choices.contains(&id),
                        "{} not among the depth-first choices {:?}",
                        id,
                        choices
                    );
                }
                let (rank, tokens) = waiting[&id].clone();
                match kv.add_sequence(id, &tokens, None) {
                    Ok(hit) => {
                        prop_assert_eq!(hit, queue.hit_blocks(id).unwrap() * BS);
                        // The aging bound, by its definition: admissions of younger requests.
                        let passes = admitted_ranks.iter().filter(|&&a| a > rank).count();
                        prop_assert!(
                            passes <= aging_bound,
                            "passed over {} > {}",
                            passes,
                            aging_bound
                        );
                        queue.admitted(id).unwrap();
                        admitted_ranks.push(rank);
                        cursor = tokens.clone();
                        waiting.remove(&id);
                        running.push(id);
                    }
                    Err(Error::OutOfBlocks { .. }) => {}
                    Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                }
            }
            Op::Free(i) => {
                if !running.is_empty() {
                    let id = running.swap_remove(i % running.len());
                    kv.free(id).unwrap();
                }
            }
            Op::Decode(i, n) => {
                if !running.is_empty() {
                    let id = running[i % running.len()];
                    let out: Vec<TokenId> = (0..n as u32)
                        .map(|k| 7_000_000 + id as u32 * 64 + k)
                        .collect();
                    let _ = kv.append_tokens(id, &out); // OutOfBlocks: nothing changes
                }
            }
            Op::Reset => {
                kv.free_batch(&running).unwrap();
                running.clear();
                prop_assert!(kv.reset_prefix_cache());
            }
        }
        for event in kv.take_events() {
            queue.apply(&event).unwrap();
        }
        if queue_aware {
            queue.take_eviction_marks(&mut marks);
            for &(h, mark) in &marks {
                kv.set_eviction_priority(&[h], mark).unwrap();
                if mark {
                    wanted.insert(h);
                } else {
                    wanted.remove(&h);
                }
            }
            let chains: std::collections::HashSet<_> = waiting
                .values()
                .flat_map(|(_, t)| kv.prefix_block_hashes(t, None))
                .collect();
            prop_assert_eq!(&wanted, &chains, "marked: the waiting requests' blocks");
        }
        queue
            .check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(queue.len(), waiting.len());
        for (&id, (_, tokens)) in &waiting {
            prop_assert_eq!(
                queue.hit_blocks(id).unwrap() * BS,
                kv.match_prefix(tokens, None).unwrap(),
                "request {} predicted hit",
                id
            );
        }
        kv.check_invariants().unwrap();
    }
    prop_assert!(queue.stats().max_passed_over <= aging_bound as u64);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn lpm_queue_matches_the_reference(bound in 0usize..6, blocks in 6usize..24, ops in prop::collection::vec(op(), 1..120)) {
        run(Scheduling::Lpm, bound, blocks, ops, false)?;
    }

    #[test]
    fn dfs_queue_matches_the_reference(bound in 0usize..6, blocks in 6usize..24, ops in prop::collection::vec(op(), 1..120)) {
        run(Scheduling::Dfs, bound, blocks, ops, false)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The same state machine with queue-aware eviction on: every prediction still matches
    /// the allocator, the allocator's invariants (both eviction lists) hold after every step,
    /// and the marks name exactly the waiting requests' blocks.
    #[test]
    fn lpm_queue_drives_queue_aware_eviction(bound in 0usize..6, blocks in 6usize..24, ops in prop::collection::vec(op(), 1..120)) {
        run(Scheduling::Lpm, bound, blocks, ops, true)?;
    }

    #[test]
    fn dfs_queue_drives_queue_aware_eviction(bound in 0usize..6, blocks in 6usize..24, ops in prop::collection::vec(op(), 1..120)) {
        run(Scheduling::Dfs, bound, blocks, ops, true)?;
    }
}

/// An adversary keeps a cached prefix hot with new arrivals that all hit it; without the bound,
/// the longest-prefix policy would never admit the old request that hits nothing.
#[test]
fn aging_bound_admits_a_cold_request_under_a_stream_of_hot_ones() {
    for policy in [Scheduling::Lpm, Scheduling::Dfs] {
        for bound in [0usize, 1, 5, 40] {
            let mut kv = KvCacheManager::new(ManagerConfig {
                num_blocks: 64,
                block_size: BS,
                enable_prefix_caching: true,
                enable_kv_events: true,
                max_events: usize::MAX,
                ..Default::default()
            })
            .unwrap();
            let mut queue = CacheAwareQueue::new(policy, bound);
            let hot: Vec<TokenId> = vec![1, 2, 3, 4, 5, 6];
            kv.add_sequence(1_000, &hot, None).unwrap();
            kv.free(1_000).unwrap();
            for event in kv.take_events() {
                queue.apply(&event).unwrap();
            }
            let cold: Vec<TokenId> = vec![90, 91, 92];
            queue
                .push(0, &kv.prefix_block_hashes(&cold, None), 1)
                .unwrap();
            let mut ranks = HashMap::from([(0u64, 0u64)]);
            let mut log: Vec<u64> = Vec::new();
            let mut cold_admitted_after = None;
            for step in 1..200u64 {
                // Two hot arrivals per admission.
                for k in 0..2 {
                    let id = 2 * step + k;
                    let mut tokens = hot.clone();
                    tokens.push(100 + id as u32);
                    let rank = queue
                        .push(id, &kv.prefix_block_hashes(&tokens, None), 3)
                        .unwrap();
                    ranks.insert(id, rank);
                }
                let id = queue.peek().unwrap();
                let passes = log.iter().filter(|&&a| a > ranks[&id]).count();
                assert!(
                    passes <= bound,
                    "{policy} bound {bound}: request {id} passed over {passes} times"
                );
                queue.admitted(id).unwrap();
                log.push(ranks[&id]);
                if id == 0 {
                    cold_admitted_after = Some(log.len() - 1);
                    break;
                }
            }
            assert_eq!(
                cold_admitted_after,
                Some(bound),
                "{policy}: the cold request waits exactly {bound} admissions"
            );
            assert_eq!(queue.stats().max_passed_over, bound as u64);
        }
    }
}

fn stored(parent: Option<pagedkv::BlockHash>, hashes: &[pagedkv::BlockHash]) -> pagedkv::KvEvent {
    pagedkv::KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: vec![0; hashes.len() * BS],
        block_size: BS,
        extra_key: None,
        medium: pagedkv::Tier::Device,
        group_idx: None,
    }
}

fn removed(hashes: &[pagedkv::BlockHash]) -> pagedkv::KvEvent {
    pagedkv::KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: pagedkv::Tier::Device,
        group_idx: None,
    }
}

/// One step of an orphan case; events and the request name blocks of one prompt's chain by
/// index.
#[derive(Debug, Clone)]
enum Step {
    /// `BlockStored` of blocks `range`, under the block before it (no parent for block 0).
    Store(std::ops::Range<usize>),
    /// `BlockRemoved` of blocks `range`.
    Remove(std::ops::Range<usize>),
    /// Request 0 (the whole chain) is pushed.
    Push,
    /// Request 0 hits this many blocks.
    Hits(usize),
    /// A `BlockRemoved` of a block nobody reported stored is an error: the caller missed events.
    RemoveUnknown,
}

/// The orphan cases: (what they show, their steps).
const ORPHAN_CASES: &[(&str, &[Step])] = &[
    (
        "the parent's node comes from a request pushed after the orphans were stored",
        &[
            Step::Store(1..3),
            Step::Push,
            Step::Hits(0),
            Step::Store(0..1),
            Step::Hits(3),
        ],
    ),
    (
        "the parent's node comes from its own store; a request pushed later hits through it",
        &[
            Step::Store(2..4),
            Step::Store(1..2),
            Step::Store(0..1),
            Step::Push,
            Step::Hits(4),
        ],
    ),
    (
        "an orphan removed before its parent came is gone when the parent comes",
        &[
            Step::Store(1..3),
            Step::Remove(2..3),
            Step::Store(0..1),
            Step::Push,
            Step::Hits(2),
            Step::RemoveUnknown,
        ],
    ),
];

/// One indexed copy per content (docs/events.md): a block can be reported stored after a parent
/// whose content was never reported stored, or has been removed since. Such a block is no hit
/// until its parent is stored, and then it is one, whether the parent's node comes from a
/// waiting request's chain or from the store itself; removing it before is no error.
#[test]
fn blocks_stored_after_an_unknown_parent_become_hits_with_it() {
    let kv = KvCacheManager::new(ManagerConfig {
        num_blocks: 16,
        block_size: BS,
        enable_prefix_caching: true,
        ..Default::default()
    })
    .unwrap();
    let tokens: Vec<TokenId> = (1..=9).collect(); // four full blocks, one token more
    let h = kv.prefix_block_hashes(&tokens, None);
    for policy in [Scheduling::Lpm, Scheduling::Dfs] {
        for (case, steps) in ORPHAN_CASES {
            let mut queue = CacheAwareQueue::new(policy, 8);
            for step in steps.iter() {
                match step {
                    Step::Store(range) => {
                        let parent = range.start.checked_sub(1).map(|i| h[i]);
                        queue.apply(&stored(parent, &h[range.clone()])).unwrap();
                    }
                    Step::Remove(range) => queue.apply(&removed(&h[range.clone()])).unwrap(),
                    Step::Push => {
                        queue.push(0, &h, 4).unwrap();
                    }
                    Step::Hits(n) => {
                        assert_eq!(queue.hit_blocks(0), Some(*n), "{policy}, {case}: {step:?}")
                    }
                    Step::RemoveUnknown => {
                        assert!(
                            queue.apply(&removed(&[h[3] ^ 1])).is_err(),
                            "{policy}, {case}"
                        )
                    }
                }
                queue.check_invariants().unwrap();
            }
        }
    }
}
