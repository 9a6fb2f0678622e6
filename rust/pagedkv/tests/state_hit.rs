//! `KvCacheManager::longest_cached_block`, a state group's hit (vLLM's
//! `MambaManager.find_longest_cache_hit`, align mode), against a model built from the index's
//! own account of what it holds, the KV events: the rightmost hash below the bound that the
//! events say the group stores, and the block `cached_block` finds under it. Random admissions
//! of prompts sharing prefixes, frees, `evict_blocks` of random table entries (which leaves
//! cached blocks after an evicted one, so a state hit differs from a chain's) and prefix-cache
//! resets on small pools, with one group and with a full-attention and a window group;
//! `check_invariants` after every step.

use std::collections::BTreeSet;

use pagedkv::{BlockHash, KvCacheManager, KvEvent, KvGroupSpec, ManagerConfig, NULL_BLOCK};

/// A reproducible workload: the crate's SplitMix64 (`pagedkv::splitmix64`), seeded.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        pagedkv::splitmix64::next(&mut self.0) % n
    }
}

/// The (group, hash) pairs the events say are stored.
fn stored_set(kv: &mut KvCacheManager, stored: &mut BTreeSet<(u32, BlockHash)>) {
    for event in kv.take_events() {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                group_idx,
                ..
            } => stored.extend(
                block_hashes
                    .into_iter()
                    .map(|h| (group_idx.unwrap_or(0), h)),
            ),
            KvEvent::BlockRemoved {
                block_hashes,
                group_idx,
                ..
            } => {
                for h in block_hashes {
                    assert!(
                        stored.remove(&(group_idx.unwrap_or(0), h)),
                        "removal of {h:#x}"
                    );
                }
            }
            KvEvent::AllBlocksCleared => stored.clear(),
        }
    }
}

#[test]
fn longest_cached_block_is_the_rightmost_stored_hash() {
    let mut past_chain = 0;
    for seed in 0..8u64 {
        let bs = 4;
        let kv_groups = match seed % 2 {
            0 => vec![KvGroupSpec::FullAttention],
            _ => vec![
                KvGroupSpec::FullAttention,
                KvGroupSpec::SlidingWindow { window: 6 },
            ],
        };
        let ng = kv_groups.len();
        let mut kv = KvCacheManager::new(ManagerConfig {
            num_blocks: 40,
            block_size: bs,
            enable_prefix_caching: true,
            enable_kv_events: true,
            kv_groups,
            ..Default::default()
        })
        .unwrap();
        let mut rng = Rng(seed);
        let prefixes: Vec<Vec<u32>> = (0..3)
            .map(|_| (0..16).map(|_| rng.below(50) as u32 + 1).collect())
            .collect();
        let mut stored = BTreeSet::new();
        let mut probes: Vec<Vec<BlockHash>> = Vec::new();
        let mut live: Vec<u64> = Vec::new();
        let mut next_seq = 0u64;
        for step in 0..300 {
            let roll = rng.below(20);
            if roll < 10 || live.is_empty() {
                let mut prompt = prefixes[rng.below(3) as usize].clone();
                prompt.truncate(rng.below(17) as usize);
                let extra = 1 + rng.below(16) as usize;
                prompt.extend((0..extra).map(|_| rng.below(50) as u32 + 1));
                if kv.add_sequence(next_seq, &prompt, None).is_ok() {
                    let full = prompt.len() / bs * bs;
                    let hashes = kv.prefix_block_hashes(&prompt[..full], None);
                    if !probes.contains(&hashes) {
                        probes.push(hashes);
                    }
                    live.push(next_seq);
                }
                next_seq += 1;
            } else if roll < 16 {
                let seq = live.swap_remove(rng.below(live.len() as u64) as usize);
                kv.free(seq).unwrap();
            } else if roll < 19 {
                // Entries of a live table, any group: held blocks leave the index.
                let seq = live[rng.below(live.len() as u64) as usize];
                let g = rng.below(ng as u64) as usize;
                let table = kv.block_table_group(seq, g).unwrap();
                let ids: Vec<u32> = table
                    .iter()
                    .copied()
                    .filter(|&b| b != NULL_BLOCK && rng.below(3) == 0)
                    .collect();
                kv.evict_blocks(&ids).unwrap();
            } else if live.is_empty() {
                assert!(kv.reset_prefix_cache());
            } else {
                let seq = live.swap_remove(0);
                kv.free(seq).unwrap();
            }
            kv.check_invariants().unwrap();
            stored_set(&mut kv, &mut stored);
            for hashes in &probes {
                for g in 0..ng {
                    let max_blocks = rng.below(hashes.len() as u64 + 2) as usize;
                    let bound = max_blocks.min(hashes.len());
                    let want = (0..bound)
                        .rev()
                        .find(|&i| stored.contains(&(g as u32, hashes[i])));
                    let got = kv.longest_cached_block(hashes, max_blocks, g).unwrap();
                    assert_eq!(
                        got.map(|h| h.0),
                        want.map(|i| i + 1),
                        "seed {seed} step {step} group {g}"
                    );
                    if let Some((n, b)) = got {
                        assert_eq!(kv.cached_block(hashes[n - 1], g).unwrap(), Some(b));
                        let chain = (0..bound)
                            .find(|&i| !stored.contains(&(g as u32, hashes[i])))
                            .unwrap_or(bound);
                        past_chain += usize::from(n > chain);
                    }
                }
            }
            kv.check_invariants().unwrap();
        }
        assert!(matches!(
            kv.longest_cached_block(&[0], 1, ng),
            Err(pagedkv::Error::InvalidArgument(_))
        ));
        assert_eq!(kv.longest_cached_block(&[], usize::MAX, 0).unwrap(), None);
    }
    // The workload reaches what tells a state hit from a chain's.
    assert!(past_chain > 0);
}
