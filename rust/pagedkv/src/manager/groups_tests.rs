//! Conformance scenarios of the manager with several KV groups, re-expressed from vLLM's tests
//! (`test_single_type_kv_cache_manager.py`, `test_prefix_caching.py`), plus pins, swap, events
//! and the invariant checker catching corruption (docs/design.md, KV groups).

use super::group_spec::{KvGroupSpec, NULL_BLOCK};
use super::{KvCacheManager, ManagerConfig};
use crate::prefix::events::KvEvent;
use crate::{BlockId, Error};

fn hybrid(
    groups: &[KvGroupSpec],
    num_blocks: usize,
    block_size: usize,
    caching: bool,
) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size,
        enable_prefix_caching: caching,
        enable_kv_events: true,
        num_host_blocks: 32,
        kv_groups: groups.to_vec(),
        ..Default::default()
    })
    .unwrap()
}

/// A targeted eviction (vLLM's tests pop a block from `cached_block_hash_to_block`).
fn evict(h: &mut KvCacheManager, b: BlockId) {
    let prefix = h.prefix.as_mut().unwrap();
    assert!(prefix.is_cached(b), "block {b} is not cached");
    prefix.release_cached(b, &h.pool);
}

fn table(h: &KvCacheManager, id: u64, g: usize) -> Vec<BlockId> {
    h.block_table_group(id, g).unwrap().to_vec()
}

/// `test_sliding_window_remove_skipped_blocks`: block size 2, window 4; the watermark before
/// each scheduling step is 0, 4, 5, 6, 7 and 11 tokens, and the window group's leading blocks
/// are released exactly as vLLM nulls them: none, none, block 0, block 0, blocks 0-1, blocks
/// 0-3, the later block first in the eviction order.
#[test]
fn remove_skipped_blocks_as_vllm() {
    let w = KvGroupSpec::SlidingWindow { window: 4 };
    let mut h = hybrid(&[w], 64, 2, true);
    let tokens: Vec<u32> = (0..22).collect();
    h.add_sequence_scheduled(1, &tokens, None, 0).unwrap();
    let original = table(&h, 1, 0);
    assert_eq!(original.len(), 11);
    let expect_nulls = |h: &KvCacheManager, n: usize| {
        let t = table(h, 1, 0);
        assert!(t[..n].iter().all(|&b| b == NULL_BLOCK), "{t:?}");
        assert_eq!(&t[n..], &original[n..]);
    };
    for (step, nulls) in [(4, 0), (1, 0), (1, 1), (1, 1), (4, 2), (1, 4)] {
        h.advance_computed(&[1], step).unwrap();
        expect_nulls(&h, nulls);
        h.check_invariants().unwrap();
    }
    // Block 0 went first, then 1, then 3 before 2 (vLLM: 1003 is evicted before 1002).
    assert_eq!(
        h.cached_blocks(),
        vec![original[0], original[1], original[3], original[2]]
    );
}

/// `test_prefill_hybrid_model`: one full group and two window groups of two blocks (block
/// size 4, window 8). A prompt of 3 full blocks + 3 tokens, then the same 3 blocks again: the
/// hit is 3 blocks, the window groups' block 0 released; then cached blocks are evicted one
/// by one and the hit shrinks as vLLM's does.
#[test]
fn prefill_hybrid_model_as_vllm() {
    let w = KvGroupSpec::SlidingWindow { window: 8 };
    let groups = [KvGroupSpec::FullAttention, w, w];
    let common: Vec<u32> = (0..3).flat_map(|i| [i; 4]).collect();
    let prompt = |tail: u32| {
        let mut p = common.clone();
        p.extend([tail; 3]);
        p
    };
    // Tables of the first request, then freed: everything cached.
    let setup = || {
        let mut h = hybrid(&groups, 64, 4, true);
        h.add_sequence(1, &prompt(3), None).unwrap();
        let tables: Vec<Vec<BlockId>> = (0..3).map(|g| table(&h, 1, g)).collect();
        h.free(1).unwrap();
        (h, tables)
    };
    let (mut h, t) = setup();
    assert_eq!(h.add_sequence(2, &prompt(4), None).unwrap(), 12);
    assert_eq!(table(&h, 2, 0)[..3], t[0][..3]);
    for (g, tg) in t.iter().enumerate().skip(1) {
        let got = table(&h, 2, g);
        assert_eq!(got[..3], [NULL_BLOCK, tg[1], tg[2]]);
    }
    h.check_invariants().unwrap();
    // (evicted (group, block index) pairs, hit in tokens)
    let cases: &[(&[(usize, usize)], usize)] = &[
        (&[(1, 0)], 12),
        (&[(0, 0)], 0),
        (&[(0, 2)], 8),
        (&[(1, 2)], 8),
        (&[(2, 2)], 8),
        (&[(0, 2), (1, 0)], 0),
    ];
    for &(evicted, want) in cases {
        let (mut h, t) = setup();
        for &(g, i) in evicted {
            evict(&mut h, t[g][i]);
        }
        assert_eq!(
            h.match_prefix(&prompt(4), None).unwrap(),
            want,
            "{evicted:?}"
        );
        assert_eq!(h.add_sequence(2, &prompt(4), None).unwrap(), want);
        h.check_invariants().unwrap();
    }
}

#[test]
fn pins_hold_every_groups_blocks() {
    let groups = [
        KvGroupSpec::FullAttention,
        KvGroupSpec::SlidingWindow { window: 3 },
    ];
    let mut h = hybrid(&groups, 16, 2, true);
    let system: Vec<u32> = (0..8).collect();
    h.add_sequence(1, &system, None).unwrap();
    h.free(1).unwrap();
    assert_eq!(h.pin_prefix(&system, None).unwrap(), 8);
    // Window 3 needs one block before the hit point: blocks 0-2 of the window group stay out.
    assert_eq!(h.stats().num_pinned_blocks, 4 + 1);
    assert!(!h.reset_prefix_cache());
    h.check_invariants().unwrap();
    assert!(matches!(
        h.unpin_prefix(&[9, 9], None),
        Err(Error::InvalidArgument(_))
    ));
    h.unpin_prefix(&system, None).unwrap();
    assert_eq!(h.stats().num_pinned_blocks, 0);
    h.check_invariants().unwrap();
    assert!(h.reset_prefix_cache());
    assert_eq!(h.cached_blocks(), vec![]);
    h.check_invariants().unwrap();
}

#[test]
fn swap_moves_live_entries_and_keeps_nulls() {
    let groups = [
        KvGroupSpec::SlidingWindow { window: 2 },
        KvGroupSpec::FullAttention,
    ];
    let mut h = hybrid(&groups, 32, 2, false);
    h.add_sequence_len(1, 7).unwrap();
    h.append_len(1, 1).unwrap(); // watermark 7: window group releases blocks 0-2
    h.fork(1, 2).unwrap();
    let live = 1 + 4;
    let out = h.swap_out(&[1, 2]).unwrap();
    assert_eq!(
        out.len(),
        live,
        "shared blocks cross once, null entries not at all"
    );
    assert_eq!(h.stats().num_blocks_in_use, 0);
    assert_eq!(
        h.host_block_table_group(1, 0).unwrap()[..3],
        [NULL_BLOCK; 3]
    );
    h.check_invariants().unwrap();
    assert_eq!(h.swap_in(&[1, 2]).unwrap().len(), live);
    assert_eq!(table(&h, 2, 0)[..3], [NULL_BLOCK; 3]);
    assert_eq!(table(&h, 1, 0), table(&h, 2, 0));
    h.check_invariants().unwrap();
}

#[test]
fn events_are_recorded_per_group() {
    let groups = [
        KvGroupSpec::FullAttention,
        KvGroupSpec::SlidingWindow { window: 2 },
    ];
    let mut h = hybrid(&groups, 16, 2, true);
    h.add_sequence(1, &[1, 2, 3, 4, 5], None).unwrap();
    let events = h.take_drained_events().into_events();
    let stored: Vec<(&Vec<u128>, Option<u32>)> = events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                group_idx,
                ..
            } => (block_hashes, *group_idx),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(stored.len(), 2, "one run per group");
    assert_eq!(
        stored[0].0, stored[1].0,
        "the same content hashes in both groups"
    );
    assert_eq!(stored[0].0.len(), 2);
    // vLLM's group_idx tells the two apart.
    assert_eq!((stored[0].1, stored[1].1), (Some(0), Some(1)));
    // Evicting them: one removal per group's block, each with its group.
    h.free(1).unwrap();
    assert_eq!(h.evict_cached(16), 4);
    let mut removed: Vec<(u128, Option<u32>)> = h
        .take_drained_events()
        .into_events()
        .into_iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved {
                block_hashes,
                group_idx,
                ..
            } => block_hashes.into_iter().map(move |b| (b, group_idx)),
            other => panic!("{other:?}"),
        })
        .collect();
    removed.sort();
    let mut want: Vec<(u128, Option<u32>)> = stored
        .iter()
        .flat_map(|(hashes, g)| hashes.iter().map(move |&b| (b, *g)))
        .collect();
    want.sort();
    assert_eq!(removed, want);
}

#[test]
fn invariant_checker_catches_corruption() {
    let groups = [
        KvGroupSpec::FullAttention,
        KvGroupSpec::SlidingWindow { window: 2 },
    ];
    let mut h = hybrid(&groups, 16, 2, true);
    h.add_sequence(1, &[1, 2, 3, 4, 5], None).unwrap();
    h.append_tokens(1, &[6]).unwrap(); // the window group releases blocks 0-1
    h.append_tokens(1, &[7]).unwrap(); // block 2 is computed and indexed
    assert_eq!(h.seqs[&1].groups[0][..2], [NULL_BLOCK; 2]);
    h.check_invariants().unwrap();
    // A released position in a full-attention group.
    let saved = h.seqs.get(&1).unwrap().clone();
    let b = std::mem::replace(
        &mut h.seqs.get_mut(&1).unwrap().table.block_ids[0],
        NULL_BLOCK,
    );
    assert!(matches!(
        h.check_invariants(),
        Err(Error::InvariantViolation(_))
    ));
    h.seqs.get_mut(&1).unwrap().table.block_ids[0] = b;
    // A window group releasing more than its watermark allows.
    h.seqs.get_mut(&1).unwrap().groups[0][2] = NULL_BLOCK;
    assert!(matches!(
        h.check_invariants(),
        Err(Error::InvariantViolation(_))
    ));
    *h.seqs.get_mut(&1).unwrap() = saved.clone();
    // Tables of different lengths.
    h.seqs.get_mut(&1).unwrap().groups[0].pop();
    assert!(matches!(
        h.check_invariants(),
        Err(Error::InvariantViolation(_))
    ));
    *h.seqs.get_mut(&1).unwrap() = saved;
    // A block of one group's index in another group's table.
    let (g0, g1) = {
        let s = &h.seqs[&1];
        (s.table.block_ids[2], s.groups[0][2])
    };
    h.seqs.get_mut(&1).unwrap().groups[0][2] = g0;
    h.seqs.get_mut(&1).unwrap().table.block_ids[2] = g1;
    assert!(matches!(
        h.check_invariants(),
        Err(Error::InvariantViolation(_))
    ));
    h.seqs.get_mut(&1).unwrap().groups[0][2] = g1;
    h.seqs.get_mut(&1).unwrap().table.block_ids[2] = g0;
    h.check_invariants().unwrap();
}

/// A caller that never drains `take_copy_ops` keeps bounded memory: dead copies (into blocks
/// since freed) are eliminated, live ones kept.
#[test]
fn undrained_copies_stay_bounded() {
    let groups = [
        KvGroupSpec::FullAttention,
        KvGroupSpec::SlidingWindow { window: 3 },
    ];
    let mut h = hybrid(&groups, 16, 2, false);
    h.add_sequence_len(1, 3).unwrap();
    for i in 0..2000 {
        h.fork(1, 2).unwrap();
        h.append_len(2, 1).unwrap(); // copy-on-write in both groups
        h.free(2).unwrap();
        assert!(h.pending_copies.len() <= 2 * 16 + 64 + 2, "step {i}");
    }
    assert_eq!(h.counters.cow_copies, 4000);
    assert!(h.counters.copy_ops_elided > 3000);
    h.check_invariants().unwrap();
}
