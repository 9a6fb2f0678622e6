//! Model-based test of hybrid KV-cache groups (docs/design.md, Hybrid groups): random
//! operation sequences (admission with prefix hits and chunked prefill, advance_computed,
//! appends and batch appends, fork, free, truncate, match_prefix, pins, cache reset) on
//! managers with full and sliding-window groups, against a tiny reference model, with
//! `check_invariants()` after every step. Swap is covered by `manager/hybrid/tests.rs`.
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

use pagedkv::{
    BlockHash, BlockId, Error, KvCacheManager, KvEvent, KvGroupSpec, ManagerConfig, NULL_BLOCK,
};
use proptest::prelude::*;

#[path = "hybrid/model.rs"]
mod model;

use model::{hit_rule, kind, prompt, MBlock, Model};

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
    let mut stored: HashMap<(Option<u32>, BlockHash), u32> = HashMap::new();
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
        check_replay(&mut kv, &mut stored, bs);
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

/// The event-replay check: an index rebuilt only from the KV events, each copy of a content
/// counted (the hybrid index keeps every copy and reports each, as vLLM does), predicts every
/// `match_prefix` through the same declarative hit rule: a hit is never shorter (nor longer)
/// than what the events say each group holds.
fn check_replay(
    kv: &mut KvCacheManager,
    stored: &mut HashMap<(Option<u32>, BlockHash), u32>,
    bs: usize,
) {
    for event in kv.take_events() {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                group_idx,
                ..
            } => {
                for h in block_hashes {
                    *stored.entry((group_idx, h)).or_insert(0) += 1;
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                group_idx,
                ..
            } => {
                for h in block_hashes {
                    let n = stored
                        .get_mut(&(group_idx, h))
                        .expect("removed but not stored");
                    *n -= 1;
                    if *n == 0 {
                        stored.remove(&(group_idx, h));
                    }
                }
            }
            KvEvent::AllBlocksCleared => stored.clear(),
        }
    }
    if !kv.config().enable_prefix_caching {
        return;
    }
    let specs = kv.kv_groups().to_vec();
    for p in 0..4 {
        let t = prompt(p, 24);
        let hashes = kv.prefix_block_hashes(&t, None);
        let max = (t.len() - 1) / bs;
        let predicted = hit_rule(&specs, bs, max, |g, i| {
            stored.contains_key(&(Some(g as u32), hashes[i]))
        });
        assert_eq!(
            kv.match_prefix(&t, None),
            Ok(predicted * bs),
            "prompt {p}: the hit differs from what the events say is stored"
        );
    }
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
