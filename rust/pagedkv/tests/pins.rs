//! Pinned prefixes: pinned blocks are never evicted or reset, pins nest, and unpinning what
//! is not pinned is a typed error that changes nothing.

use pagedkv::{Error, KvCacheManager, ManagerConfig, Tier};

fn cached(num_blocks: usize, block_size: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size,
        enable_prefix_caching: true,
        ..Default::default()
    })
    .unwrap()
}

const SYSTEM: [u32; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

#[test]
fn pinned_blocks_survive_eviction_pressure() {
    let mut kv = cached(4, 4);
    kv.add_sequence(1, &SYSTEM, None).unwrap();
    kv.free(1).unwrap();
    assert_eq!(kv.pin_prefix(&SYSTEM, None).unwrap(), 8); // the last full block too
    let s = kv.stats();
    assert_eq!(
        (
            s.num_pinned_blocks,
            s.num_cached_blocks,
            s.num_blocks_in_use
        ),
        (2, 0, 2)
    );
    assert_eq!(kv.num_available_blocks(), 2);
    assert_eq!(
        kv.add_sequence_len(2, 16),
        Err(Error::OutOfBlocks {
            tier: Tier::Device,
            needed_blocks: 4,
            available_blocks: 2
        })
    );
    kv.add_sequence_len(2, 8).unwrap(); // takes the two free blocks, evicts nothing
    assert_eq!(kv.evict_cached(4), 0); // nor can a pool peer reclaim them
    kv.free(2).unwrap();
    assert_eq!(
        kv.match_prefix(&[1, 2, 3, 4, 5, 6, 7, 8, 9], None).unwrap(),
        8
    );
    kv.unpin_prefix(&SYSTEM, None).unwrap();
    assert_eq!(kv.stats().num_cached_blocks, 2);
    kv.add_sequence_len(3, 16).unwrap(); // evictable again
    kv.check_invariants().unwrap();
}

#[test]
fn pins_nest_and_hold_live_blocks() {
    let mut kv = cached(8, 4);
    kv.add_sequence(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9], None)
        .unwrap();
    let table = kv.block_table(1).unwrap().to_vec();
    assert_eq!(kv.pin_prefix(&SYSTEM[..4], None).unwrap(), 4);
    assert_eq!(kv.pin_prefix(&SYSTEM, None).unwrap(), 8);
    assert_eq!(kv.pin_prefix(&SYSTEM, None).unwrap(), 8);
    assert_eq!(kv.refcount(table[0]).unwrap(), 4);
    assert_eq!(kv.stats().num_pinned_blocks, 2);
    kv.free(1).unwrap();
    assert_eq!(kv.stats().num_cached_blocks, 0); // all still held by pins
    assert!(!kv.reset_prefix_cache()); // refused while anything is pinned
    kv.unpin_prefix(&SYSTEM, None).unwrap();
    kv.unpin_prefix(&SYSTEM, None).unwrap();
    assert_eq!(kv.stats().num_pinned_blocks, 1);
    assert!(matches!(
        kv.unpin_prefix(&SYSTEM, None),
        Err(Error::InvalidArgument(_))
    ));
    // A prompt differing only past its full blocks names the same pin.
    kv.unpin_prefix(&[1, 2, 3, 4, 0], None).unwrap();
    assert_eq!(kv.stats().num_pinned_blocks, 0);
    assert_eq!(kv.stats().num_cached_blocks, 2);
    assert!(kv.reset_prefix_cache());
    kv.check_invariants().unwrap();
}

#[test]
fn pinning_nothing_records_nothing() {
    let mut kv = cached(8, 4);
    let before = kv.stats();
    assert_eq!(kv.pin_prefix(&SYSTEM, None).unwrap(), 0); // nothing cached
    assert_eq!(kv.pin_prefix(&[1, 2], None).unwrap(), 0); // no full block
    assert_eq!(kv.stats(), before);
    for tokens in [&SYSTEM[..], &[1, 2][..], &[][..]] {
        assert!(matches!(
            kv.unpin_prefix(tokens, None),
            Err(Error::InvalidArgument(_))
        ));
    }
    kv.add_sequence(1, &SYSTEM, None).unwrap();
    assert_eq!(kv.pin_prefix(&SYSTEM, Some(b"other")).unwrap(), 0); // another namespace
    assert!(matches!(
        kv.unpin_prefix(&SYSTEM, Some(b"other")),
        Err(Error::InvalidArgument(_))
    ));
    let mut off = KvCacheManager::new(ManagerConfig::default()).unwrap();
    assert_eq!(off.pin_prefix(&SYSTEM, None).unwrap(), 0);
    assert!(matches!(
        off.unpin_prefix(&SYSTEM, None),
        Err(Error::InvalidArgument(_))
    ));
    kv.check_invariants().unwrap();
}
