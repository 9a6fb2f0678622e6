//! Queue-aware eviction: the order a wanted block outlives an unwanted one in, and a randomized
//! state machine that checks the invariants after every step and the order at every eviction.

use std::collections::HashSet;

use crate::{BlockHash, KvCacheManager, KvEvent, ManagerConfig};

fn manager(num_blocks: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size: 2,
        enable_prefix_caching: true,
        enable_kv_events: true,
        ..Default::default()
    })
    .unwrap()
}

/// The hashes of the cached-evictable blocks, in list order.
fn cached_hashes(kv: &KvCacheManager) -> Vec<BlockHash> {
    let prefix = kv.prefix.as_ref().unwrap();
    kv.cached_blocks()
        .into_iter()
        .map(|b| prefix.hash_of(b).expect("cached blocks are indexed"))
        .collect()
}

fn removed(events: &[KvEvent]) -> Vec<BlockHash> {
    events
        .iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

/// Four cached single-block prompts, the two oldest wanted: the unwanted ones go first (the
/// newer one after the older), then the wanted ones in the order they were set aside; a block
/// unmarked while set aside goes back to the LRU's tail. Plain LRU would evict `a` first.
#[test]
fn wanted_blocks_outlive_unwanted_ones() {
    let mut kv = manager(8);
    let prompts: [[u32; 3]; 4] = [[1, 1, 0], [2, 2, 0], [3, 3, 0], [4, 4, 0]];
    for (id, p) in prompts.iter().enumerate() {
        kv.add_sequence(id as u64, p, None).unwrap();
        kv.free(id as u64).unwrap();
    }
    let h: Vec<BlockHash> = prompts
        .iter()
        .map(|p| kv.prefix_block_hashes(p, None)[0])
        .collect();
    kv.take_events();
    kv.set_eviction_priority(&h[..2], true).unwrap();
    assert_eq!(kv.wanted_block_hashes(), Some(2));
    let mut order = Vec::new();
    for _ in 0..3 {
        assert_eq!(kv.evict_cached(1), 1);
        kv.check_invariants().unwrap();
        order.extend(removed(&kv.take_events()));
    }
    assert_eq!(order, vec![h[2], h[3], h[0]]);
    // `b`'s block is set aside; unmarked, it is the next to go even with a wanted block newer.
    kv.add_sequence(9, &[5, 5, 0], None).unwrap();
    kv.free(9).unwrap();
    let e = kv.prefix_block_hashes(&[5, 5, 0], None)[0];
    kv.set_eviction_priority(&[e], true).unwrap();
    kv.set_eviction_priority(&[h[1]], false).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.evict_cached(1), 1);
    assert_eq!(removed(&kv.take_events()), vec![h[1]]);
    assert_eq!(cached_hashes(&kv), vec![e]);
}

#[test]
fn off_by_default_and_refused_without_a_prefix_cache() {
    let kv = manager(4);
    assert_eq!(kv.wanted_block_hashes(), None);
    let mut plain = KvCacheManager::new(ManagerConfig {
        num_blocks: 4,
        block_size: 2,
        ..Default::default()
    })
    .unwrap();
    assert!(matches!(
        plain.set_eviction_priority(&[1], true),
        Err(crate::Error::InvalidArgument(_))
    ));
}

/// Random admissions (prompts over a two-token alphabet: many shared prefixes), frees,
/// evictions and marks on a small pool: the invariants hold after every step (both lists
/// included), and no eviction takes a wanted block while an unwanted cached block is left.
#[test]
fn randomized_marks_keep_invariants_and_order() {
    for seed in 0..20u64 {
        let mut rng = 0x44_0000 + seed;
        let mut below = |n: u64| crate::splitmix64::next(&mut rng) % n;
        let mut kv = manager(10);
        let mut wanted: HashSet<BlockHash> = HashSet::new();
        let mut live: Vec<u64> = Vec::new();
        let mut seen: Vec<BlockHash> = Vec::new();
        for id in 0..300u64 {
            match below(5) {
                0 | 1 => {
                    let len = 1 + below(7) as usize;
                    let prompt: Vec<u32> = (0..len).map(|_| below(2) as u32).collect();
                    seen.extend(kv.prefix_block_hashes(&prompt, None));
                    if kv.add_sequence(id, &prompt, None).is_ok() {
                        live.push(id);
                    }
                }
                2 if !live.is_empty() => {
                    let gone = live.remove(below(live.len() as u64) as usize);
                    kv.free(gone).unwrap();
                }
                3 if !seen.is_empty() => {
                    let h = seen[below(seen.len() as u64) as usize];
                    let mark = below(2) == 0;
                    kv.set_eviction_priority(&[h], mark).unwrap();
                    if mark {
                        wanted.insert(h);
                    } else {
                        wanted.remove(&h);
                    }
                }
                _ => {
                    kv.take_events();
                    if kv.evict_cached(1) == 1 {
                        let gone = removed(&kv.take_events());
                        assert_eq!(gone.len(), 1);
                        if wanted.contains(&gone[0]) {
                            let left = cached_hashes(&kv);
                            assert!(
                                left.iter().all(|h| wanted.contains(h)),
                                "seed {seed}: a wanted block was evicted before an unwanted one"
                            );
                        }
                    }
                }
            }
            kv.check_invariants().unwrap();
        }
    }
}
