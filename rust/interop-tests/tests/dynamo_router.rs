//! pagedkv's KV events, encoded by `pagedkv::wire`, consumed by NVIDIA Dynamo's KV router
//! unchanged: its `zmq_wire::decode_event_batch` decodes our bytes, its `ZmqEventNormalizer`
//! turns them into router events for our block size, its `RadixTree` applies them, and
//! `find_matches` on each new request gives exactly the prefix pagedkv then serves from cache,
//! across stores, evictions, resets and two replicas.

use dynamo_kv_router::indexer::RadixTree;
use dynamo_kv_router::protocols::{compute_block_hash_for_seq, BlockHashOptions, WorkerWithDpRank};
use dynamo_kv_router::zmq_wire::{decode_event_batch, ZmqEventNormalizer};
use pagedkv::wire::{encode_kv_events, HashFormat};
use pagedkv::{splitmix64, KvCacheManager, ManagerConfig};

const BLOCK_SIZE: usize = 4;

struct Replica {
    kv: KvCacheManager,
    worker: WorkerWithDpRank,
    normalizer: ZmqEventNormalizer,
    next_event_id: u64,
    batches: u64,
    events: u64,
}

impl Replica {
    fn new(worker_id: u64, num_blocks: usize) -> Self {
        let kv = KvCacheManager::new(ManagerConfig {
            num_blocks,
            block_size: BLOCK_SIZE,
            enable_prefix_caching: true,
            // Events are opt-in: without this the manager records nothing and Dynamo's index
            // stays empty (the test's predictions then read 0 blocks on every replica).
            enable_kv_events: true,
            ..Default::default()
        })
        .unwrap();
        Replica {
            kv,
            worker: WorkerWithDpRank::new(worker_id, 0),
            normalizer: ZmqEventNormalizer::new(BLOCK_SIZE as u32),
            next_event_id: 0,
            batches: 0,
            events: 0,
        }
    }

    /// Publishes what the engine recorded: encode with pagedkv, decode and apply with Dynamo.
    fn publish(&mut self, tree: &mut RadixTree, ts: f64) {
        let events = self.kv.take_events();
        if events.is_empty() {
            return;
        }
        let payload = encode_kv_events(&events, ts, Some(0), HashFormat::U64).unwrap();
        let batch = decode_event_batch(&payload).expect("Dynamo decodes pagedkv's batch");
        assert_eq!(batch.events.len(), events.len());
        assert_eq!(batch.data_parallel_rank, Some(0));
        assert_eq!(batch.ts, ts);
        for raw in batch.events {
            let placement = self
                .normalizer
                .normalize(raw, self.next_event_id, self.worker)
                .expect("Dynamo accepts every pagedkv event");
            self.next_event_id += 1;
            let event = placement.into_router_event().expect("a local GPU event");
            tree.apply_event(event)
                .expect("the router's tree takes the event");
            self.events += 1;
        }
        self.batches += 1;
    }
}

fn overlap(tree: &RadixTree, tokens: &[u32], worker: WorkerWithDpRank) -> u32 {
    let hashes = compute_block_hash_for_seq(tokens, BLOCK_SIZE as u32, BlockHashOptions::default());
    let scores = tree.find_matches(hashes, false);
    scores.scores.get(&worker).copied().unwrap_or(0)
}

#[test]
fn dynamo_router_matches_what_pagedkv_serves_from_cache() {
    let mut rng = 0x5eed_u64;
    let mut tree = RadixTree::new();
    // Small pools so that caching evicts often.
    let mut replicas = [Replica::new(1, 40), Replica::new(2, 56)];
    let prefixes: Vec<Vec<u32>> = (0..6)
        .map(|_| {
            (0..3 * BLOCK_SIZE)
                .map(|_| (splitmix64::next(&mut rng) % 5000) as u32)
                .collect()
        })
        .collect();
    let mut live: Vec<(usize, u64)> = Vec::new();
    let (mut checked, mut hits, mut resets) = (0, 0, 0);
    for step in 0..3000u64 {
        let r = (splitmix64::next(&mut rng) % 2) as usize;
        let roll = splitmix64::next(&mut rng) % 100;
        if roll < 3 {
            // Drain replica r (reset needs no block in use), then clear its index.
            live.retain(|&(owner, seq)| {
                if owner == r {
                    replicas[r].kv.free(seq).unwrap();
                }
                owner != r
            });
            assert!(replicas[r].kv.reset_prefix_cache());
            resets += 1;
        } else if roll < 45 && !live.is_empty() {
            let (owner, seq) = live.swap_remove((splitmix64::next(&mut rng) as usize) % live.len());
            replicas[owner].kv.free(seq).unwrap();
            replicas[owner].publish(&mut tree, step as f64);
            continue;
        } else {
            // A prompt with a shared prefix (or two) and a tail that never ends on a block
            // boundary, so pagedkv's hit is exactly its cached full blocks.
            let mut prompt = prefixes[(splitmix64::next(&mut rng) % 6) as usize].clone();
            if splitmix64::next(&mut rng) % 2 == 0 {
                prompt.extend_from_slice(&prefixes[(splitmix64::next(&mut rng) % 6) as usize]);
            }
            let tail = 1 + (splitmix64::next(&mut rng) % (2 * BLOCK_SIZE as u64)) as usize;
            let tail = if (prompt.len() + tail) % BLOCK_SIZE == 0 {
                tail + 1
            } else {
                tail
            };
            prompt.extend((0..tail).map(|_| (splitmix64::next(&mut rng) % 5000) as u32));
            let predicted = overlap(&tree, &prompt, replicas[r].worker) as usize;
            match replicas[r].kv.add_sequence(step, &prompt, None) {
                Ok(cached) => {
                    assert_eq!(
                        cached,
                        predicted * BLOCK_SIZE,
                        "step {step}: Dynamo predicted {predicted} blocks on replica {r}"
                    );
                    checked += 1;
                    hits += usize::from(cached > 0);
                    live.push((r, step));
                }
                Err(pagedkv::Error::OutOfBlocks { .. }) => {}
                Err(other) => panic!("{other:?}"),
            }
        }
        replicas[r].publish(&mut tree, step as f64);
        replicas[r].kv.check_invariants().unwrap();
    }
    let removed: u64 = replicas.iter().map(|r| r.kv.stats().blocks_evicted).sum();
    assert!(
        checked > 1000 && hits > 300,
        "checked {checked}, hits {hits}"
    );
    assert!(
        resets > 10 && removed > 100,
        "resets {resets}, evictions {removed}"
    );
    assert!(replicas
        .iter()
        .all(|r| r.batches > 100 && r.events > r.batches));
}
