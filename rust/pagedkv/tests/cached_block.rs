//! `KvCacheManager::cached_block`, the look-up of indexed content by one hash (vLLM's
//! `get_cached_block`), against the index's own account of what it holds: the KV events.
//! Random admissions of prompts sharing prefixes, frees and prefix-cache resets on a small pool
//! (evictions, chained runs, replaced copies); after every step, each hash ever seen must be
//! found exactly while the events say it is stored, and no block for two hashes;
//! `check_invariants` after every step. The first look-up comes only after
//! chained runs were entered, and admissions go on after it.

use std::collections::BTreeSet;

use pagedkv::{BlockHash, KvCacheManager, KvEvent, ManagerConfig};

/// A reproducible workload: the crate's SplitMix64 (`pagedkv::splitmix64`), seeded.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        pagedkv::splitmix64::next(&mut self.0) % n
    }
}

fn stored_set(kv: &mut KvCacheManager, stored: &mut BTreeSet<BlockHash>) {
    for event in kv.take_events() {
        match event {
            KvEvent::BlockStored { block_hashes, .. } => stored.extend(block_hashes),
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for h in block_hashes {
                    assert!(stored.remove(&h), "removal of {h:#x}, never stored");
                }
            }
            KvEvent::AllBlocksCleared => stored.clear(),
        }
    }
}

#[test]
fn cached_block_finds_exactly_the_indexed_contents() {
    for seed in 0..6u64 {
        let bs = 4;
        let mut kv = KvCacheManager::new(ManagerConfig {
            num_blocks: 48,
            block_size: bs,
            enable_prefix_caching: true,
            enable_kv_events: true,
            ..Default::default()
        })
        .unwrap();
        let mut rng = Rng(seed);
        let prefixes: Vec<Vec<u32>> = (0..3)
            .map(|_| (0..12).map(|_| rng.below(50) as u32 + 1).collect())
            .collect();
        let mut stored = BTreeSet::new();
        // Every hash any prompt produced.
        let mut seen: BTreeSet<BlockHash> = BTreeSet::new();
        let mut live: Vec<u64> = Vec::new();
        let mut next_seq = 0u64;
        let mut looked_up = false;
        for step in 0..400 {
            let roll = rng.below(10);
            if roll < 6 || live.is_empty() {
                let mut prompt = prefixes[rng.below(3) as usize].clone();
                prompt.truncate(rng.below(13) as usize);
                let extra = 1 + rng.below(24) as usize;
                prompt.extend((0..extra).map(|_| rng.below(50) as u32 + 1));
                if kv.add_sequence(next_seq, &prompt, None).is_ok() {
                    let full = prompt.len() / bs * bs;
                    let hashes = kv.prefix_block_hashes(&prompt[..full], None);
                    seen.extend(hashes);
                    live.push(next_seq);
                }
                next_seq += 1;
            } else if roll < 9 {
                let seq = live.swap_remove(rng.below(live.len() as u64) as usize);
                kv.free(seq).unwrap();
            } else if live.is_empty() {
                assert!(kv.reset_prefix_cache());
            } else {
                let seq = live.swap_remove(0);
                kv.free(seq).unwrap();
            }
            kv.check_invariants().unwrap();
            stored_set(&mut kv, &mut stored);
            // Chained runs first; then a look-up after every step.
            if step < 40 {
                continue;
            }
            looked_up = true;
            let mut holders = BTreeSet::new();
            for &h in &seen {
                let found = kv.cached_block(h, 0).unwrap();
                assert_eq!(
                    found.is_some(),
                    stored.contains(&h),
                    "seed {seed} step {step}: hash {h:#x}"
                );
                // One block holds one content.
                if let Some(b) = found {
                    assert!(
                        holders.insert(b),
                        "seed {seed} step {step}: block {b} twice"
                    );
                }
            }
            kv.check_invariants().unwrap();
        }
        assert!(looked_up);
        assert!(matches!(
            kv.cached_block(0, 1),
            Err(pagedkv::Error::InvalidArgument(_))
        ));
    }
}
